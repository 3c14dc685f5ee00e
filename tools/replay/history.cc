// rebuild and verify: every version of a fragment is its checkpoint plus the merge records after
// it, applied by the merger's recovery code (merger/recovery.h).
#include <chrono>
#include <iostream>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "core/files/safetensors.h"
#include "core/model/builtin_specs.h"
#include "tools/replay/replay.h"
#include "tools/replay/run_logs.h"

namespace diloco {

namespace {

using Clock = std::chrono::steady_clock;

std::string start_text(const FragmentLog& f) {
  if (f.start.run_id.empty()) return "nothing (no version 0 yet)";
  if (!f.start_position) return "version 0 from the proposal at " + describe(f.genesis->record.inputs.front().position);
  return "checkpoint v" + std::to_string(f.start.version) + " at " + describe(*f.start_position);
}

void warn_rejected(const LogPosition& p, const std::string& why) {
  std::cerr << "diloco-replay: skipping the undecodable message at " << describe(p) << ": " << why << "\n";
}

// Every fragment's history, read one partition at a time.
std::map<uint32_t, FragmentLog> read_histories(const ReplayRun& run, StartAt start, const OnRejected& rejected) {
  std::map<uint32_t, FragmentLog> out;
  for (int32_t partition = 0; partition < run.partitions; ++partition) out.merge(read_fragment_logs(run, partition, start, rejected));
  return out;
}

// The state of one fragment at `version` (which its history must hold), from its start, which
// it moves out.
FragmentState rebuild_fragment(const ReplayRun& run, FragmentLog& f, uint64_t version) {
  FragmentState state = std::move(f.start);
  replay_records(run, state, f.merges, version, [](const FragmentState&, const LoggedMerge&) {});
  if (state.version != version)
    throw InvalidInput("fragment " + std::to_string(state.fragment) + ": the merge log stops at version " +
                       std::to_string(state.version) + ", not " + std::to_string(version));
  return state;
}

// Tracks one fragment's verification: compares checkpoints with the rebuilt state and reports
// progress every few seconds.
class FragmentCheck {
 public:
  FragmentCheck(const FragmentLog& log, uint32_t fragment, VerifyReport& report, std::ostream& progress)
      : log_(log), fragment_(fragment), report_(report), progress_(progress) {}

  // Every checkpoint of `state.version` other than the start must match it.
  void compare_checkpoints(const FragmentState& state) {
    for (const auto& c : log_.checkpoints) {
      if (c.version != state.version || c.position == log_.start_position) continue;
      ++report_.checkpoints;
      const uint64_t momentum = checksum_fp32(state.momentum);
      const uint64_t outer_state = checksum_fp32(state.outer_state);
      const uint64_t residual = checksum_fp32(state.downlink_residual);
      if (c.checksum != state.checksum || c.momentum_checksum != momentum || c.outer_state_checksum != outer_state ||
          c.residual_checksum != residual)
        fail("checkpoint at " + describe(c.position) + " of version " + std::to_string(c.version) +
             " has checksum " + std::to_string(c.checksum) + " (momentum " + std::to_string(c.momentum_checksum) +
             ", outer state " + std::to_string(c.outer_state_checksum) + ", downlink residual " +
             std::to_string(c.residual_checksum) + "), the rebuilt state " + std::to_string(state.checksum) +
             " (momentum " + std::to_string(momentum) + ", outer state " + std::to_string(outer_state) +
             ", downlink residual " + std::to_string(residual) + ")");
    }
  }

  void applied(const FragmentState& state, const LoggedMerge& merge) {
    if (!is_merge(merge.record)) return;  // an accounting record keeps the version
    ++report_.versions;
    compare_checkpoints(state);
    if (Clock::now() - last_report_ > std::chrono::seconds(2)) {
      last_report_ = Clock::now();
      progress_ << "verify: fragment " << state.fragment << ": version " << state.version << " of "
                << log_.latest_version << "\n";
    }
  }

  void fail(const std::string& what) {
    if (!failed_) report_.mismatches.push_back("fragment " + std::to_string(fragment_) + ": " + what);
    failed_ = true;
  }
  bool failed() const { return failed_; }

 private:
  const FragmentLog& log_;  // its start may have been moved out
  uint32_t fragment_;
  VerifyReport& report_;
  std::ostream& progress_;
  Clock::time_point last_report_ = Clock::now();
  bool failed_ = false;
};

// Version 0 is the values of the proposal its genesis record names (when the proposal is still
// there), and the checksum the record and the checkpoints say. Only the proposal's values are
// held, not a state built from them: a fragment's start is in memory already.
void verify_genesis(const ReplayRun& run, const FragmentLog& f, FragmentCheck& check) {
  if (!f.genesis) {
    check.fail("no genesis record: version 0 was never committed from a learner's proposal");
    return;
  }
  try {
    if (const auto proposal = proposal_from_record(run, *f.genesis)) {
      const uint64_t checksum = checksum_fp32(proposal->tensors);
      if (checksum != f.genesis->record.checksum)
        check.fail("the proposal at " + describe(f.genesis->record.inputs.front().position) + " has checksum " +
                   std::to_string(checksum) + ", the genesis record at " + describe(f.genesis->position) +
                   " says " + std::to_string(f.genesis->record.checksum));
    }
  } catch (const InvalidInput& e) {
    check.fail(e.what());
    return;
  }
  for (const auto& c : f.checkpoints)
    if (c.version == 0 && c.checksum != f.genesis->record.checksum)
      check.fail("the version 0 checkpoint at " + describe(c.position) + " has checksum " + std::to_string(c.checksum) +
                 ", the genesis record at " + describe(f.genesis->position) + " says " +
                 std::to_string(f.genesis->record.checksum));
}

// Replays fragment `fragment`'s history `f` from its start, which it moves out (one copy of the
// fragment's state in memory). Returns false when the fragment has no version 0 yet.
bool verify_fragment(const ReplayRun& run, uint32_t fragment, FragmentLog& f, VerifyReport& report,
                     std::ostream& progress) {
  const std::string from = start_text(f);
  FragmentCheck check(f, fragment, report, progress);
  if (f.start.run_id.empty()) {
    progress << "verify: fragment " << fragment << ": no version 0 yet, nothing to verify\n";
    return false;
  }
  verify_genesis(run, f, check);
  FragmentState state = std::move(f.start);
  check.compare_checkpoints(state);
  try {
    replay_records(run, state, f.merges, UINT64_MAX,
                   [&](const FragmentState& s, const LoggedMerge& m) { check.applied(s, m); });
  } catch (const InvalidInput& e) {
    check.fail(e.what());
    return true;
  }
  for (const auto& c : f.checkpoints)
    if (c.version > state.version)
      check.fail("checkpoint at " + describe(c.position) + " is version " + std::to_string(c.version) +
                 " but the merge log rebuilds only up to version " + std::to_string(state.version));
  progress << "verify: fragment " << fragment << ": " << (check.failed() ? "MISMATCH" : "ok") << " from " << from
           << " to version " << state.version << "\n";
  return true;
}

}  // namespace

std::vector<NamedTensor> named_tensors(const FragmentLayout& layout, std::vector<FragmentState>& states) {
  auto check = [&](const FragmentState& state, const DenseTensor& t) {
    if (state.fragment >= layout.num_fragments() || t.index >= layout.fragments[state.fragment].size() ||
        t.values.size() != static_cast<size_t>(layout.pieces[state.fragment][t.index].numel))
      throw InvalidInput(detail::concat("fragment ", state.fragment, ": tensor ", t.index, " (", t.values.size(),
                                        " values) is not in the layout"));
  };
  std::set<uint32_t> present;
  for (const auto& state : states) present.insert(state.fragment);
  std::vector<NamedTensor> out;
  if (present.size() != layout.num_fragments() || states.size() != present.size()) {
    for (auto& state : states)
      for (auto& t : state.params) {
        check(state, t);
        out.push_back(NamedTensor{layout.fragments[state.fragment][t.index].name, t.shape, std::move(t.values)});
      }
    return out;
  }
  for (const auto& spec : layout.tensors)
    out.push_back(NamedTensor{spec.name, spec.shape, std::vector<float>(static_cast<size_t>(spec.numel()))});
  for (auto& state : states)
    for (auto& t : state.params) {
      check(state, t);
      const TensorPiece& piece = layout.pieces[state.fragment][t.index];
      if (piece.whole) {
        out[piece.tensor].values = std::move(t.values);
      } else {
        std::copy(t.values.begin(), t.values.end(), out[piece.tensor].values.begin() + piece.offset);
        t.values = {};
      }
    }
  return out;
}

void save_states(const ReplayRun& run, std::vector<FragmentState> states, const nlohmann::json& info,
                 const std::filesystem::path& path) {
  const bool whole_model = states.size() == run.layout->num_fragments();
  std::vector<NamedTensor> tensors = named_tensors(*run.layout, states);
  std::map<std::string, std::string> metadata{{"info", info.dump()}};
  // A whole model of the built-in architecture names it, so that diloco-sample reads the file.
  if (whole_model && builtin_layout(run.config).fingerprint == run.layout->fingerprint) {
    const ModelOptions m = model_options(run.config.model);
    metadata["model"] = nlohmann::json{{"vocab", m.vocab}, {"layers", m.layers}, {"width", m.width},
                                       {"heads", m.heads}, {"context", m.context}}.dump();
  }
  save_safetensors(path, tensors, metadata);
}

void rebuild(const ReplayRun& run, const RebuildOptions& o, std::ostream& out) {
  const uint32_t fragments = run.layout->num_fragments();
  if (o.fragment && *o.fragment >= fragments)
    throw InvalidInput("--fragment " + std::to_string(*o.fragment) + ": the model has fragments 0.." +
                       std::to_string(fragments - 1));
  std::map<uint32_t, FragmentLog> logs =
      o.fragment ? read_fragment_logs(run, run.partition_of(*o.fragment), StartAt{.at_most = o.version}, warn_rejected)
                 : read_histories(run, StartAt{.at_most = o.version}, warn_rejected);
  std::string latest;
  uint64_t newest = 0;
  for (const auto& [p, f] : logs)
    if (!o.fragment || p == *o.fragment) {
      latest += (latest.empty() ? "" : ", ") + std::to_string(p) + ": " + std::to_string(f.latest_version);
      newest = std::max(newest, f.latest_version);
    }
  if (o.version > newest)
    throw InvalidInput("version " + std::to_string(o.version) + " does not exist: the newest version " +
                       (o.fragment ? "of fragment " + std::to_string(*o.fragment) + " is " + std::to_string(newest)
                                   : "of any fragment is " + std::to_string(newest) + " (per fragment " + latest + ")"));

  nlohmann::json versions = nlohmann::json::object(), checksums = nlohmann::json::object();
  std::vector<FragmentState> states;
  for (auto& [p, f] : logs) {
    if (o.fragment && p != *o.fragment) continue;
    if (f.start.run_id.empty()) throw InvalidInput("fragment " + std::to_string(p) + " has no version 0 yet");
    const uint64_t version = std::min(o.version, f.latest_version);
    const std::string from = start_text(f);
    states.push_back(rebuild_fragment(run, f, version));
    versions[std::to_string(p)] = version;
    checksums[std::to_string(p)] = states.back().checksum;
    out << "fragment " << p << ": version " << version << " checksum " << states.back().checksum << " (from "
        << from << ")\n";
  }
  nlohmann::json info{{"kind", "rebuild"}, {"run_id", run.config.run.id}, {"fingerprint", run.layout->fingerprint},
                      {"version", o.version}, {"versions", versions}, {"checksums", checksums},
                      {"config", run.config.source}};
  save_states(run, std::move(states), info, o.out);
  out << "wrote " << o.out.string() << "\n";
}

std::vector<FragmentState> rebuild_states(const ReplayRun& run, uint64_t version) {
  std::vector<FragmentState> states;
  for (auto& [p, f] : read_histories(run, StartAt{.at_most = version}, warn_rejected)) {
    if (f.start.run_id.empty()) throw InvalidInput("fragment " + std::to_string(p) + " has no version 0 yet");
    states.push_back(rebuild_fragment(run, f, std::min(version, f.latest_version)));
  }
  return states;
}

VerifyReport verify(const ReplayRun& run, std::ostream& progress) {
  VerifyReport report;
  auto rejected = [&](const LogPosition& p, const std::string& why) {
    report.mismatches.push_back("undecodable message at " + describe(p) + ": " + why);
  };
  for (int32_t partition = 0; partition < run.partitions; ++partition) {
    auto logs = read_fragment_logs(run, partition, StartAt{.earliest = true}, rejected);
    for (auto& [p, f] : logs) {
      progress << "verify: fragment " << p << ": " << f.merges.size() << " merge records after " << start_text(f)
               << ", " << f.checkpoints.size() << " checkpoints\n";
      if (verify_fragment(run, p, f, report, progress)) ++report.fragments;
    }
  }
  return report;
}

}  // namespace diloco
