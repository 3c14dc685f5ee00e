// remerge: the merge policy re-run offline over the recorded deltas, with other settings.
#include <algorithm>
#include <iomanip>
#include <iterator>
#include <iostream>
#include <set>

#include "core/errors.h"
#include "merger/fragment_merger.h"
#include "merger/grace_window.h"
#include "merger/merge_step.h"
#include "merger/weighting.h"
#include "tools/replay/replay.h"
#include "tools/replay/run_logs.h"

namespace diloco {

namespace {

// The settings of one merge: the record's, with the ones the options set replaced.
MergeOptions merge_options(const RemergeOptions& o, const MergeRecord& r, std::span<const TensorSpec> layout) {
  MergeOptions m = recorded_merge_options(r, layout);
  if (o.rule) m.rule = *o.rule;
  if (o.optimizer) m.optimizer = *o.optimizer;
  if (o.staleness_alpha) m.hyper.staleness_alpha = *o.staleness_alpha;
  if (o.lr) m.hyper.lr = *o.lr;
  if (o.momentum) m.hyper.momentum = *o.momentum;
  if (o.quorum) m.hyper.quorum = *o.quorum;
  return m;
}

// With --alpha, the staleness scale of the re-weighted inputs replaces the recorded one in the
// recorded share; without it (or when it comes out the same) the recorded share stays, bit for bit.
void rescale_share(const RemergeOptions& o, const MergeRecord& r, std::span<const MergeInput> inputs,
                   MergeOptions& m) {
  if (!o.staleness_alpha) return;
  const double scale = staleness_scale(inputs, m.hyper.staleness_alpha);
  const float recorded = scaled_share(1.0f, scale);
  if (recorded == r.staleness_scale) return;
  m.share = std::min(1.0f, scaled_share(r.share, scale / static_cast<double>(r.staleness_scale)));
  m.staleness_scale = recorded;
}

// A quorum other than a recorded one changes how arrivals group into merges.
bool regroups(const RemergeOptions& o, const std::map<uint32_t, FragmentLog>& logs) {
  if (!o.quorum) return false;
  for (const auto& [p, f] : logs)
    for (const auto& m : f.merges)
      if (is_merge(m.record) && m.record.hyper.quorum != *o.quorum) return true;
  return false;
}

// Where the original run was, version and record, to tell which records continue it.
struct OriginalCursor {
  FragmentState at;  // only fragment, version and last_merge are used

  explicit OriginalCursor(const FragmentState& start) {
    at.fragment = start.fragment;
    at.version = start.version;
    at.last_merge = start.last_merge;
  }
  bool continued_by(const LoggedMerge& merge) const { return continues_state(at, merge); }
  void advance(const LoggedMerge& merge) {
    at.version = merge.record.version;
    at.last_merge = merge.position;
  }
};

// Every delta a record accounts for for good that other merge settings could take: merged, or
// dropped as superseded or too stale. Not those pending at a stop (a later record takes them),
// nor those dropped as invalid (tokens above what their learner announced, a norm out of bounds:
// a fault of the delta under any settings). A genesis record accounts for none: its one input is
// a proposal of version 0.
std::vector<DeltaRef> accounted_refs(const MergeRecord& record) {
  if (record.genesis) return {};
  std::vector<DeltaRef> out = record.inputs;
  for (const auto& d : record.dropped)
    if (d.reason != DropReason::PendingAtStop && d.reason != DropReason::Invalid) out.push_back(d.delta);
  return out;
}

std::vector<LogPosition> accounted_positions(const MergeRecord& record) {
  std::vector<LogPosition> out;
  for (const auto& ref : accounted_refs(record)) out.push_back(ref.position);
  return out;
}

// Each merge takes the inputs its record names, re-weighted with the new settings.
void remerge_as_recorded(const ReplayRun& run, const RemergeOptions& o, const FragmentLog& f, FragmentState& state,
                         RemergedFragment& out) {
  const LogContext ctx = run.context();
  const auto layout = run.layout->fragments.at(f.start.fragment);
  OriginalCursor original(f.start);
  FragmentState next;
  for_each_with_deltas(ctx, f.merges, input_positions, [&](const LoggedMerge& merge, const DeltaMessages& deltas) {
    if (!original.continued_by(merge)) return true;
    original.advance(merge);
    if (!is_merge(merge.record)) return true;
    MergeOptions options = merge_options(o, merge.record, layout);
    options.pool = ctx.pool;
    std::vector<Delta> decoded;
    std::vector<MergeInput> inputs;
    for (const auto& ref : merge.record.inputs) decoded.push_back(logged_delta(ctx, deltas, ref, merge.position));
    for (size_t i = 0; i < decoded.size(); ++i) {
      DeltaRef ref = merge.record.inputs[i];
      weigh(ref, state.version, options.hyper);
      inputs.push_back({ref, decoded[i]});
    }
    rescale_share(o, merge.record, inputs, options);
    merge_step(state, inputs, options, next);
    std::swap(state, next);
    ++out.merges;
    return true;
  });
}

// The arrivals each record accounts for go, in send-time order, through the merger's own pending
// set (supersession, staleness, weights); a merge happens as soon as the quorum is pending.
void remerge_regrouped(const ReplayRun& run, const RemergeOptions& o, const FragmentLog& f, FragmentState& state,
                       RemergedFragment& out) {
  auto first = std::find_if(f.merges.begin(), f.merges.end(), [](const LoggedMerge& m) { return is_merge(m.record); });
  if (first == f.merges.end()) return;
  const LogContext ctx = run.context();
  MergeOptions options = merge_options(o, first->record, run.layout->fragments.at(f.start.fragment));
  options.pool = ctx.pool;
  // Regrouped merges hold other numbers of learners than the recorded ones: with share scaling,
  // each applies its share of the learners this fragment's log has seen.
  std::set<std::string> population;
  for (const auto& m : f.merges)
    for (const auto& ref : accounted_refs(m.record)) population.insert(ref.learner_id);
  FragmentMerger merger(f.start.fragment, state.version, options.hyper, 0);
  const GraceWindow no_grace;  // nothing observed: merges at quorum
  OriginalCursor original(f.start);
  // Original version -> the re-merged version current when it was made.
  std::map<uint64_t, uint64_t> remerged_at{{f.start.version, state.version}};
  auto translate = [&](uint64_t base) {
    auto it = remerged_at.upper_bound(base);
    return it == remerged_at.begin() ? base : std::prev(it)->second;
  };
  FragmentState next;
  double now = 0;
  for_each_with_deltas(ctx, f.merges, accounted_positions, [&](const LoggedMerge& merge, const DeltaMessages& deltas) {
    if (!original.continued_by(merge)) return true;
    std::vector<std::pair<LogPosition, Delta>> arrivals;
    for (const auto& ref : accounted_refs(merge.record))
      arrivals.emplace_back(ref.position, logged_delta(ctx, deltas, ref, merge.position));
    std::sort(arrivals.begin(), arrivals.end(), [](const auto& a, const auto& b) {
      return std::tie(a.second.header.send_time_us, a.first.topic, a.first.partition, a.first.offset) <
             std::tie(b.second.header.send_time_us, b.first.topic, b.first.partition, b.first.offset);
    });
    for (auto& [position, delta] : arrivals) {
      DeltaRef ref = delta_ref(delta.header, position);
      ref.base_version = translate(ref.base_version);
      now += 1;
      merger.offer(std::move(ref), DeltaTensors(std::move(delta)), now);
      while (merger.poll(now, {}, no_grace)) {
        MergePlan plan = merger.take_merge_inputs(now);
        set_merge_share(options, plan.inputs, population.size(), run.config.merger.share_scaling);
        merge_step(state, plan.inputs, options, next);
        std::swap(state, next);
        merger.merge_committed(state.version);
        merger.published(now);
        ++out.merges;
      }
    }
    original.advance(merge);
    remerged_at[original.at.version] = state.version;
    return true;
  });
  for (const auto& held : merger.stop())
    if (held.reason == DropReason::PendingAtStop) ++out.unmerged;
}

// Drops the records logged after `last` (all of them when there is none: no merge yet).
void trim_after(std::vector<LoggedMerge>& merges, const std::optional<LogPosition>& last) {
  std::erase_if(merges, [&](const LoggedMerge& m) { return !last || m.position.offset > last->offset; });
}

}  // namespace

RemergeReport remerge(const ReplayRun& run, const RemergeOptions& o, std::ostream& progress) {
  auto warn = [&](const LogPosition& p, const std::string& why) {
    progress << "remerge: skipping the undecodable message at " << describe(p) << ": " << why << "\n";
  };
  std::map<uint32_t, FragmentLog> logs;
  std::vector<FragmentState> originals;
  const LogContext ctx = run.context();
  for (int32_t partition = 0; partition < run.partitions; ++partition) {
    auto fragments = run.fragments_of(partition);
    for (auto& [p, r] : recover_partition(ctx, partition, fragments)) originals.push_back(std::move(r.state));
    logs.merge(read_fragment_logs(run, partition, StartAt{.earliest = true}, warn));
  }
  // On a live run the logs may have grown since the newest state was read: re-merge the same records.
  for (const auto& original : originals) trim_after(logs.at(original.fragment).merges, original.last_merge);
  RemergeReport report{.regrouped = regroups(o, logs)};
  std::vector<FragmentState> states;
  for (const auto& original : originals) {
    const FragmentLog& f = logs.at(original.fragment);
    RemergedFragment out{.fragment = original.fragment, .original_version = original.version,
                         .original_checksum = original.checksum, .start_version = f.start.version};
    FragmentState state = f.start;
    if (report.regrouped)
      remerge_regrouped(run, o, f, state, out);
    else
      remerge_as_recorded(run, o, f, state, out);
    out.version = state.version;
    out.checksum = state.checksum;
    progress << "remerge: fragment " << out.fragment << ": " << out.merges << " merges, version " << out.version << "\n";
    report.fragments.push_back(out);
    states.push_back(std::move(state));
  }
  if (!o.out.empty()) {
    save_states(run, std::move(states), {{"kind", "remerge"}, {"run_id", run.config.run.id}, {"regrouped", report.regrouped}}, o.out);
    progress << "remerge: wrote the re-merged model to " << o.out.string() << "\n";
  }
  return report;
}

void print_remerge(const RemergeReport& report, bool json, std::ostream& out) {
  if (json) {
    nlohmann::json fragments = nlohmann::json::array();
    for (const auto& f : report.fragments)
      fragments.push_back({{"fragment", f.fragment}, {"start_version", f.start_version},
                           {"original_version", f.original_version}, {"original_checksum", f.original_checksum},
                           {"version", f.version}, {"checksum", f.checksum}, {"merges", f.merges},
                           {"unmerged", f.unmerged}, {"identical", f.checksum == f.original_checksum}});
    nlohmann::json doc{{"grouping", report.regrouped ? "regrouped" : "recorded"}, {"fragments", fragments}};
    out << doc.dump() << "\n";
    return;
  }
  out << "grouping: " << (report.regrouped ? "regrouped by the new quorum" : "as recorded") << "\n";
  for (const auto& f : report.fragments)
    out << "fragment " << f.fragment << ": original v" << f.original_version << " checksum " << f.original_checksum
        << ", remerged v" << f.version << " checksum " << f.checksum << " (" << f.merges << " merges from v"
        << f.start_version << (f.unmerged ? ", left pending: " + std::to_string(f.unmerged) : "")
        << (f.checksum == f.original_checksum ? ", identical" : "") << ")\n";
}

}  // namespace diloco
