#include "learner/runtime.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/codec/chunk.h"
#include "core/codec/learner_state.h"
#include "core/fragments/message_budget.h"
#include "core/fragments/partition.h"
#include "core/fragments/schedule.h"
#include "core/kafka/consumer.h"
#include "core/kafka/log_reader.h"
#include "core/kafka/producer.h"
#include "core/kafka/run_log.h"
#include "core/kafka/security.h"
#include "core/kafka/traffic.h"
#include "core/metrics/metrics.h"
#include "core/process.h"
#include "learner/delta_publisher.h"
#include "learner/fragment_track.h"
#include "learner/param_inbox.h"
#include "learner/refusal_watch.h"
#include "learner/resume.h"

namespace diloco {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

long max_rss_kb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

uint64_t draw_incarnation() {
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32 | device()) | 1;  // never 0 (older binaries' value)
}

// The records of `members` that say where the run stands for learner `self`, in log order: those
// of the last `lookback_s` (every live process announced itself since), `self`'s own of any age
// (a learner restarted after a long stop continues where it stopped), and the newest record
// before the tail (its stamp is the broker's "now" when nothing is recent). The others, a run's
// old heartbeats, are skipped undecoded.
std::vector<MemberRecord> read_members(const KafkaOptions& kafka, const RunTopics& topics, const DecodeLimits& limits,
                                       const std::string& self, double lookback_s, int timeout_ms) {
  std::vector<MemberRecord> records;
  LogReader reader(kafka);
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch()).count();
  int64_t tail = 0;
  try {
    tail = reader.offset_at_time(topics.members(), 0, now_ms - static_cast<int64_t>(lookback_s * 1000), timeout_ms)
               .value_or(std::numeric_limits<int64_t>::max());
  } catch (const Unavailable&) {
    tail = 0;  // everything is decoded
  }
  std::optional<ConsumedMessage> newest_skipped;
  auto take = [&](const ConsumedMessage& m) {
    MemberRecord r{.key = m.key, .stamp_ms = m.timestamp_ms};
    if (!m.tombstone) {
      try {
        r.member = decode_member(m.value, limits);
      } catch (const Rejection&) {
        return;  // not an announcement of this run: it says nothing about where the run stands
      }
    }
    records.push_back(std::move(r));
  };
  reader.read_to_end(
      {{topics.members(), 0, -2}},
      [&](const ConsumedMessage& m) {
        if (m.offset >= tail) {
          if (newest_skipped) take(*std::exchange(newest_skipped, std::nullopt));
          take(m);
        } else if (m.key == self) {
          take(m);
        } else {
          newest_skipped = m;
        }
      },
      timeout_ms);
  if (newest_skipped) take(*newest_skipped);
  return records;
}

// The newest announcement of `id` among `records`, and the newest stamp of all (the broker's now).
struct Claim {
  std::optional<MemberRecord> own;
  int64_t now_ms = 0;
};
Claim claim_of(const std::string& id, const std::vector<MemberRecord>& records) {
  Claim c;
  for (const auto& r : records) {
    c.now_ms = std::max(c.now_ms, r.stamp_ms);
    if (r.key != id) continue;
    if (r.member)
      c.own = r;
    else
      c.own.reset();
  }
  return c;
}

}  // namespace

const char* learner_mode_name(LearnerMode mode) {
  switch (mode) {
    case LearnerMode::Train: return "train";
    case LearnerMode::NoPublish: return "no-publish";
    case LearnerMode::Standalone: return "standalone";
    case LearnerMode::EvalOnly: return "eval-only";
  }
  return "?";
}

struct LearnerRuntime::Impl {
  Impl(RuntimeOptions options, std::vector<RegisteredTensor> registered, HostSync host_sync);

  bool networked() const { return o.mode != LearnerMode::Standalone; }
  DecodeLimits limits() const { return run_decode_limits(o.config, *layout); }
  bool stopping() const { return o.should_stop && o.should_stop(); }
  void say(const std::string& text) const { std::cerr << "learner " << o.learner_id << ": " << text << "\n"; }

  // Host buffers of fragment p.
  std::vector<std::vector<float>> read_values(uint32_t p);
  std::vector<DenseTensor> read_tensors(uint32_t p);
  void write_tensors(uint32_t p, const std::vector<DenseTensor>& tensors);
  // Fragment p's values in the host buffers, to be written in place; `current`: they must hold the
  // model's values now (the device's copied to the host first), else only the rows of a partial
  // tensor that p does not hold are brought up to date. written() copies them back to the device.
  FragmentTrack::Model host_view(uint32_t p, bool current);
  void written(uint32_t p);

  void log(nlohmann::json record);
  bool claim_id(std::vector<MemberRecord>& records);
  bool join_run();
  void check_model(const FragmentState& state) const;
  std::vector<LogPosition> propose_genesis(const std::vector<uint32_t>& missing);
  void check_rejections(int64_t& from, const std::set<LogPosition>& proposals);
  void adopt_received(float loss);
  bool cut_early(uint32_t p, uint64_t coming, float loss);
  void publish_delta(uint32_t p, float loss, bool early);
  void wait_for_merges(float loss);
  void wait_for_versions(const std::map<uint32_t, uint64_t>& versions);
  void heartbeat(bool force = false, bool leaving = false);
  void write_step_line(float loss);

  RuntimeOptions o;
  std::vector<RegisteredTensor> tensors;
  HostSync sync;
  std::shared_ptr<const FragmentLayout> layout;
  // Per fragment: the registered tensors it touches (each once, model order), and those of them
  // it holds only some rows of.
  std::vector<std::vector<uint32_t>> members, partial;
  RunTopics topics;
  Metrics metrics{"diloco_learner_"};
  std::unique_ptr<JsonLines> log_file;
  std::unique_ptr<MetricsEndpoint> endpoint;
  std::vector<FragmentTrack> fragments;  // the global state of every fragment as this learner knows it
  std::vector<bool> takes_part;          // per fragment: in RuntimeOptions::fragments (or all)
  std::vector<uint64_t> seqs;            // per fragment: seq of the last delta sent
  std::optional<CutSchedule> schedule;   // Train mode: when each fragment is next due
  std::unique_ptr<DeltaPublisher> publisher;
  std::unique_ptr<ParamInbox> inbox;
  std::unique_ptr<RefusalWatch> refusals;  // Train mode: what the mergers dropped or refused of ours
  std::vector<std::shared_ptr<const FragmentParams>> held_at_start;
  int partitions = 1;
  const uint64_t incarnation = draw_incarnation();
  Clock::time_point start_time = Clock::now();
  Clock::time_point last_heartbeat{};
  Clock::time_point last_refusal_poll{};
  Clock::time_point last_step_end = Clock::now();
  double step_time_ema = 0;
  double tokens_per_s = 0;
  double loss_ema = 0;
  float last_loss = 0;
  uint64_t step = 0;
  uint64_t total_tokens = 0;
  uint64_t adopted = 0;
  double compute_seconds = 0;  // in inner steps (as the client reports them), not waiting
  double wait_seconds = 0;     // waiting for merges (diloco.wait_steps >= 0)
  bool started = false;
  bool closed = false;
};

LearnerRuntime::Impl::Impl(RuntimeOptions options, std::vector<RegisteredTensor> registered, HostSync host_sync)
    : o(std::move(options)), tensors(std::move(registered)), sync(std::move(host_sync)), topics{o.config.run.id} {
  validate_run_config(o.config);
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& t : tensors) specs.push_back(TensorSpec{t.name, t.shape});
  layout = std::make_shared<const FragmentLayout>(partition_tensors(specs, o.config.diloco.fragments));
  members.resize(layout->num_fragments());
  partial.resize(layout->num_fragments());
  for (uint32_t p = 0; p < layout->num_fragments(); ++p)
    for (const auto& piece : layout->pieces[p]) {
      if (members[p].empty() || members[p].back() != piece.tensor) members[p].push_back(piece.tensor);
      if (!piece.whole && (partial[p].empty() || partial[p].back() != piece.tensor)) partial[p].push_back(piece.tensor);
    }
  takes_part.assign(layout->num_fragments(), o.fragments.empty());
  for (uint32_t p : o.fragments) {
    if (p >= layout->num_fragments())
      throw InvalidInput(detail::concat("fragment ", p, " is not in the layout (fragments 0 to ",
                                        layout->num_fragments() - 1, ")"));
    if (takes_part[p]) throw InvalidInput(detail::concat("fragment ", p, " is listed twice"));
    takes_part[p] = true;
  }
  for (uint32_t p = 0; p < layout->num_fragments(); ++p)
    for (uint32_t t : takes_part[p] ? members[p] : std::vector<uint32_t>{})
      if (tensors[t].host == nullptr) throw InvalidInput("tensor '" + tensors[t].name + "' has no host buffer");
  if (o.learner_id.empty()) throw InvalidInput("the learner id is empty");
  if (o.region.empty()) throw InvalidInput("the region is empty");
  if (!o.spill_dir.empty() && !std::filesystem::is_directory(o.spill_dir))
    throw InvalidInput("the spill directory '" + o.spill_dir +
                       "' is not a directory: create it, or leave it unset to keep the residuals in memory");
  if ((o.batch == 0) != (o.context == 0))
    throw InvalidInput(detail::concat("batch ", o.batch, " and context ", o.context,
                                      ": declare both (sequences per step, tokens per sequence) or neither"));
  if (o.learners == 0 || o.index >= o.learners)
    throw InvalidInput(detail::concat("learner index ", o.index, " must be below the number of learners ", o.learners));
  // A model whose fragments cannot travel is refused now, not when its first delta is sent.
  if (networked()) check_message_sizes(o.config, *layout, o.kafka.max_message_bytes);
  seqs.assign(layout->num_fragments(), 0);
  fragments.resize(layout->num_fragments());
}

std::vector<std::vector<float>> LearnerRuntime::Impl::read_values(uint32_t p) {
  if (sync.to_host) sync.to_host(members[p]);
  std::vector<std::vector<float>> out;
  out.reserve(layout->pieces[p].size());
  for (const auto& piece : layout->pieces[p]) {
    const float* first = tensors[piece.tensor].host + piece.offset;
    out.emplace_back(first, first + piece.numel);
  }
  return out;
}

std::vector<DenseTensor> LearnerRuntime::Impl::read_tensors(uint32_t p) {
  auto values = read_values(p);
  std::vector<DenseTensor> out;
  out.reserve(values.size());
  for (uint32_t k = 0; k < values.size(); ++k)
    out.push_back(DenseTensor{k, layout->fragments[p][k].shape, std::move(values[k])});
  return out;
}

FragmentTrack::Model LearnerRuntime::Impl::host_view(uint32_t p, bool current) {
  // from_host copies whole tensors back: the rows of a partial tensor that this fragment does not
  // hold must be current on the host first.
  if (sync.to_host && current) sync.to_host(members[p]);
  else if (sync.to_host && !partial[p].empty()) sync.to_host(partial[p]);
  FragmentTrack::Model out;
  for (const auto& piece : layout->pieces[p])
    out.emplace_back(tensors[piece.tensor].host + piece.offset, static_cast<size_t>(piece.numel));
  return out;
}

void LearnerRuntime::Impl::written(uint32_t p) {
  if (sync.from_host) sync.from_host(members[p]);
}

void LearnerRuntime::Impl::write_tensors(uint32_t p, const std::vector<DenseTensor>& values) {
  const auto& pieces = layout->pieces[p];
  DILOCO_ENFORCE(values.size() == pieces.size(), "fragment ", p, ": ", values.size(), " tensors to write, ",
                 pieces.size(), " in the layout");
  for (size_t k = 0; k < values.size(); ++k)
    DILOCO_ENFORCE(values[k].values.size() == static_cast<size_t>(pieces[k].numel), "tensor '",
                   layout->fragments[p][k].name, "': ", values[k].values.size(), " values for ", pieces[k].numel);
  const FragmentTrack::Model view = host_view(p, false);
  for (size_t k = 0; k < values.size(); ++k) std::copy(values[k].values.begin(), values[k].values.end(), view[k].begin());
  written(p);
}

void LearnerRuntime::Impl::log(nlohmann::json record) {
  record["t"] = seconds_since(start_time);
  record["time_us"] = unix_us();
  record["learner"] = o.learner_id;
  if (log_file) log_file->write(record);
}

// A learner id is held by the process that announced it last, while its announcements go on:
// two processes under one id would interleave their deltas' seqs and their resume points. One
// whose last announcement is recent but not a clean stop's may have been killed; it is watched
// for id_claim_wait_s, and a newer announcement of the id means it lives.
bool LearnerRuntime::Impl::claim_id(std::vector<MemberRecord>& records) {
  const auto liveness_ms = static_cast<int64_t>(o.config.merger.liveness_seconds * 1000);
  Claim before = claim_of(o.learner_id, records);
  if (!before.own || before.own->member->leaving || before.now_ms - before.own->stamp_ms > liveness_ms) return true;
  say(detail::concat("the id was announced ", (before.now_ms - before.own->stamp_ms) / 1000.0,
                     " s ago by another process; watching it for ", o.id_claim_wait_s, " s"));
  const auto t0 = Clock::now();
  while (seconds_since(t0) < o.id_claim_wait_s) {
    if (stopping()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  records = read_members(o.kafka, topics, limits(), o.learner_id, o.config.merger.members_lookback_seconds,
                         o.members_read_ms);
  Claim after = claim_of(o.learner_id, records);
  if (after.own && !after.own->member->leaving &&
      (after.own->stamp_ms != before.own->stamp_ms || after.own->member->incarnation != before.own->member->incarnation))
    throw InvalidInput(detail::concat(
        "learner id '", o.learner_id, "' is held by a live process (it announced itself ",
        std::max<int64_t>(0, after.now_ms - after.own->stamp_ms) / 1000.0, " s ago, at step ", after.own->member->step,
        ", region ", after.own->member->region, "): give this learner another id, or stop that process first"));
  return true;
}

void LearnerRuntime::Impl::check_model(const FragmentState& state) const {
  if (state.fingerprint == layout->fingerprint) return;
  const FragmentLayout& run = *state.layout;
  std::string why = describe_difference(run.tensors, layout->tensors);
  if (why.empty())
    why = detail::concat("the run splits its tensors into ", run.num_fragments(), " fragments, this learner into ",
                         layout->num_fragments(), " (diloco.fragments)");
  throw InvalidInput(detail::concat("run '", o.config.run.id, "' trains another model: ", why,
                                    ". Register the run's tensors, or start a new run (another run.id)"));
}

std::vector<LogPosition> LearnerRuntime::Impl::propose_genesis(const std::vector<uint32_t>& missing) {
  std::vector<LogPosition> positions;
  int failed = 0;
  std::string failure;
  ProducerOptions options{.kafka = o.kafka};
  options.kafka.client_id = o.learner_id + "-genesis";
  Producer producer(options, [&](const DeliveryReport& r) {
    if (r.ok)
      positions.push_back({topics.genesis(), r.partition, r.offset});
    else {
      ++failed;
      failure = r.error;
    }
  });
  for (uint32_t p : missing) {
    seqs[p] = std::max<uint64_t>(seqs[p] + 1, static_cast<uint64_t>(unix_us() / 1000));
    GenesisProposal proposal{.run_id = o.config.run.id, .fingerprint = layout->fingerprint, .learner_id = o.learner_id,
                             .region = o.region, .fragment = p, .seq = seqs[p], .send_time_us = unix_us(),
                             .layout = layout, .tensors = read_tensors(p)};
    // Above codec.segment_bytes of values it goes out in segments (core/kafka/run_log.h).
    const SentMessage sent = produce_proposal(producer, topics, partitions, proposal, o.config.codec.segment_bytes,
                                              o.config.codec.chunk_bytes, p, o.kafka.connect_timeout_ms);
    metrics.add("genesis_proposals_total", 1);
    log({{"event", "genesis_proposal"}, {"fragment", p}, {"seq", seqs[p]}, {"wire_bytes", sent.bytes},
         {"segments", sent.segments}});
  }
  if (producer.flush(o.kafka.connect_timeout_ms) != 0 || failed)
    throw Unavailable(detail::concat("the proposal of version 0 did not reach ", topics.genesis(), ": ",
                                     failed ? failure : "the broker did not acknowledge it in time"));
  return positions;
}

// A merger's rejection of one of this learner's proposals, other than a version 0 already there.
void LearnerRuntime::Impl::check_rejections(int64_t& from, const std::set<LogPosition>& proposals) {
  LogReader reader(o.kafka);
  reader.read_to_end(
      {{topics.rejected(), 0, from}},
      [&](const ConsumedMessage& m) {
        from = m.offset + 1;
        RejectedInput r;
        try {
          r = decode_rejected(m.value, limits());
        } catch (const Rejection&) {
          return;
        }
        if (!proposals.count(r.source) || r.reason == "genesis_exists") return;
        throw InvalidInput("the merger " + r.rejected_by + " rejected this learner's proposal of version 0 (" +
                           describe(r.source) + "): " + r.reason + ": " + r.detail);
      },
      10000);
}

// Reads the run's newest state of every fragment; proposes this learner's values for the
// fragments that have none (unless it only evaluates) and waits until every fragment has one.
bool LearnerRuntime::Impl::join_run() {
  DecodeLimits any = limits();
  any.layout = nullptr;  // states of another model must be read to say how it differs
  const uint32_t n = layout->num_fragments();
  std::set<LogPosition> proposed;
  int64_t rejected_from = -1;
  const auto t0 = Clock::now();
  auto last_note = t0 - std::chrono::hours(1);
  for (;;) {
    // The parameters only: the merger's optimizer buffers and residual are never used here.
    StateScan scan = read_states(o.kafka, topics, any, n, 60000, StateParts::ParamsOnly);
    // A merger's verdict on this learner's own proposals first: when another model's version 0
    // won the race, the rejection of ours says so, and how the models differ.
    if (!proposed.empty()) check_rejections(rejected_from, proposed);
    for (const auto& [p, state] : scan.latest) check_model(state);
    std::vector<uint32_t> missing;
    for (uint32_t p = 0; p < n; ++p)
      if (takes_part[p] && !scan.latest.count(p)) missing.push_back(p);
    if (missing.empty()) {
      held_at_start.clear();
      for (auto& [p, state] : scan.latest) {
        if (!takes_part[p]) continue;
        write_tensors(p, state.params);
        // One copy, shared by the inbox (the base of the next update) and the anchor.
        auto held = std::make_shared<const FragmentParams>(
            FragmentParams{.run_id = state.run_id, .fingerprint = state.fingerprint, .fragment = p,
                           .version = state.version, .checksum = state.checksum, .tensors = std::move(state.params)});
        fragments[p] = FragmentTrack(FragmentTrack::Version(held, &held->tensors), state.version, state.checksum,
                                     o.spill_dir);
        held_at_start.push_back(std::move(held));
      }
      return true;
    }
    if (proposed.empty() && o.mode != LearnerMode::EvalOnly) {
      rejected_from = LogReader(o.kafka).watermarks(topics.rejected(), 0, 10000).second;
      for (auto& position : propose_genesis(missing)) proposed.insert(std::move(position));
      say(detail::concat("the run has no version 0 of ", missing.size(), " fragment(s): proposed this learner's values"));
    }
    if (seconds_since(t0) > static_cast<double>(o.genesis_timeout.count()))
      throw Unavailable(detail::concat("no version 0 of ", missing.size(), " of ",
                                       std::count(takes_part.begin(), takes_part.end(), true), " fragments in ", topics.state(),
                                       " after ", o.genesis_timeout.count(),
                                       " s: is a merger of run '", o.config.run.id, "' running?"));
    if (seconds_since(last_note) >= 5) {
      last_note = Clock::now();
      say(detail::concat("waiting for version 0 of ", missing.size(), " fragment(s): start a merger"));
    }
    for (int i = 0; i < 50; ++i) {
      if (stopping()) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
}

// Cuts p now, ahead of its schedule, if a version `coming` of p would otherwise miss or overwrite
// this learner's unsent progress (diloco.cut_on_arrival); p's next cut is then H steps later.
bool LearnerRuntime::Impl::cut_early(uint32_t p, uint64_t coming, float loss) {
  const auto& d = o.config.diloco;
  if (o.mode != LearnerMode::Train || !fragments[p].cut_before_adopting(coming, d.cut_on_arrival, d.H)) return false;
  publish_delta(p, loss, true);
  schedule->cut(p, step);
  return true;
}

void LearnerRuntime::Impl::adopt_received(float loss) {
  if (!inbox) return;
  std::vector<uint64_t> known;
  for (const auto& f : fragments) known.push_back(f.version());
  const auto& d = o.config.diloco;
  // A merger's quorum for p is in: a learner whose own cut of p is close sends it now, inside the
  // grace window, so that it joins that merge instead of missing it by a few steps.
  for (const RoundOpen& notice : inbox->take_round_opens()) {
    const uint32_t p = notice.fragment;
    if (p >= fragments.size() || !takes_part[p] || notice.version < fragments[p].version()) continue;
    if (!cut_early(p, notice.version + 1, loss)) continue;
    log({{"event", "round_open_cut"}, {"fragment", p}, {"version", notice.version}, {"merger", notice.merger_instance}});
  }
  for (const auto& taken : inbox->take(known)) {
    const FragmentParams& params = *taken;
    const uint32_t p = params.fragment;
    if (!takes_part[p]) continue;
    auto& f = fragments[p];
    // Cut before an overwrite: with overwrite-on-adoption, a learner a few steps behind the others
    // would lose all its progress on p since its base when another learner's merge arrives first.
    // Cutting first sends that progress, and restarting p's cycle here pulls this learner's
    // schedule into phase with the learners whose merge just arrived.
    cut_early(p, params.version, loss);
    const uint64_t behind = params.version - f.version();
    const double alpha = d.blend_alpha;
    const bool rebase = d.adopt == "rebase";
    const bool needs_local = (alpha > 0 || rebase) && o.mode != LearnerMode::EvalOnly;
    // The version itself becomes the anchor, shared with the inbox: no copy of it; the adopted
    // values are written straight into the host buffers.
    FragmentTrack::Version received(taken, &taken->tensors);
    const FragmentTrack::Model model = host_view(p, needs_local);
    if (needs_local && rebase)
      f.rebase_into(params.version, params.checksum, std::move(received), model);
    else
      f.adopt_into(params.version, params.checksum, std::move(received), needs_local ? alpha : 0, model);
    written(p);
    ++adopted;
    metrics.add("versions_adopted_total", 1);
    metrics.set("fragment_version", static_cast<double>(f.version()), {{"fragment", std::to_string(p)}});
    metrics.observe("adoption_gap_versions", static_cast<double>(behind), {1, 2, 4, 8, 16, 32});
    log({{"event", "adopt"}, {"fragment", p}, {"version", f.version()}, {"versions_behind", behind},
         {"checksum", f.checksum()}});
  }
}

void LearnerRuntime::Impl::publish_delta(uint32_t p, float loss, bool early) {
  auto& f = fragments[p];
  if (f.steps() == 0) return;
  const auto& codec = o.config.codec;
  // Read from the host buffers: the values at the cut are copied a range at a time into the
  // track (into its spill directory when it has one).
  CutDelta cut = f.cut_from(host_view(p, true), codec.dtype, codec.block_size, codec.topk);
  DeltaHeader h;
  h.run_id = o.config.run.id;
  h.fingerprint = layout->fingerprint;
  h.learner_id = o.learner_id;
  h.region = o.region;
  h.fragment = p;
  // Wall-clock milliseconds as a floor keep seqs increasing across restarts of this learner id,
  // so a merger never mistakes a new delta for a re-read old one.
  seqs[p] = std::max<uint64_t>(seqs[p] + 1, static_cast<uint64_t>(unix_us() / 1000));
  h.seq = seqs[p];
  h.base_version = cut.base_version;
  h.inner_steps = cut.inner_steps;
  h.tokens = cut.tokens;
  h.learner_step = step;
  h.train_loss = std::isfinite(loss) ? loss : 0.0f;
  h.send_time_us = unix_us();
  CodecOptions options{.dtype = codec.dtype, .block_size = codec.block_size, .topk = codec.topk,
                       .byte_shuffle = codec.byte_shuffle, .zstd_level = codec.zstd_level};
  auto bytes = encode_delta(h, std::span<const QuantizedTensor>(cut.tensors), options);
  metrics.add("deltas_submitted_total", 1);
  metrics.add("delta_wire_bytes_total", static_cast<double>(bytes.size()));
  if (early) metrics.add("deltas_cut_on_arrival_total", 1);
  log({{"event", "delta"}, {"step", step}, {"fragment", p}, {"seq", h.seq}, {"base_version", h.base_version},
       {"inner_steps", h.inner_steps}, {"tokens", h.tokens}, {"wire_bytes", bytes.size()}, {"early", early}});
  publisher->submit(OutgoingDelta{std::move(h), std::move(bytes)});
  f.expect_merge(step, o.config.diloco.wait_steps);
}

// Synchronous modes (diloco.wait_steps >= 0): before the next inner step, wait until every
// fragment whose wait is due holds a version above the base its last delta was cut on. The wait
// polls the inbox, adopts, sends heartbeats and gives up after diloco.wait_timeout_seconds.
void LearnerRuntime::Impl::wait_for_merges(float loss) {
  if (o.steps > 0 && static_cast<int64_t>(step) >= o.steps) return;  // no further step needs it
  const double timeout = o.config.diloco.wait_timeout_seconds;
  for (uint32_t p = 0; p < fragments.size(); ++p) {
    if (!fragments[p].must_wait(step)) continue;
    const uint64_t base = fragments[p].awaited_base().value_or(0);
    const auto t0 = Clock::now();
    auto last_note = t0;
    bool timed_out = false;
    while (!stopping()) {
      adopt_received(loss);
      if (!fragments[p].must_wait(step)) break;
      heartbeat();
      if (seconds_since(t0) >= timeout) {
        timed_out = true;
        fragments[p].give_up_wait();
        say(detail::concat("gave up waiting for a merge of fragment ", p, " above version ", base, " after ", timeout,
                           " s"));
        log({{"event", "wait_timeout"}, {"fragment", p}, {"base_version", base}, {"seconds", seconds_since(t0)}});
        break;
      }
      if (seconds_since(last_note) >= 10) {
        last_note = Clock::now();
        say(detail::concat("step ", step, ": waiting ", static_cast<int>(seconds_since(t0)), " s for a merge of fragment ",
                           p, " above version ", base));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const double waited = seconds_since(t0);
    wait_seconds += waited;
    metrics.add("wait_seconds_total", waited);
    log({{"event", "wait"}, {"fragment", p}, {"base_version", base}, {"seconds", waited}, {"timed_out", timed_out}});
  }
}

// A restarted learner first takes the versions the mergers announce, so that its first deltas are
// cut on current bases (a delta on a base its earlier process already had merged is superseded).
void LearnerRuntime::Impl::wait_for_versions(const std::map<uint32_t, uint64_t>& versions) {
  const auto t0 = Clock::now();
  const double timeout = o.resume_wait_s;
  std::set<uint32_t> silent;  // fragments whose mergers went silent: not waited for
  // Whether a fragment is still worth waiting for; one whose mergers went silent is given up.
  auto behind = [&] {
    bool waiting = false;
    for (const auto& [p, v] : versions) {
      if (p >= fragments.size() || !takes_part[p] || fragments[p].version() >= v || silent.count(p)) continue;
      if (inbox && inbox->owner_silent(p, o.resume_silent_intervals)) {
        silent.insert(p);
        say(detail::concat("fragment ", p, ": no merger announced it for ", o.resume_silent_intervals,
                           " of its announce intervals; not waiting for version ", v, " (training on version ",
                           fragments[p].version(), ")"));
      } else {
        waiting = true;
      }
    }
    return waiting;
  };
  while (behind() && !stopping() && seconds_since(t0) < timeout) {
    adopt_received(0);
    heartbeat();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (behind()) say(detail::concat("the announced versions did not arrive within ", timeout, " s; training on what it holds"));
  log({{"event", "resume_versions"}, {"seconds", seconds_since(t0)}, {"complete", !behind() && silent.empty()},
       {"silent_fragments", silent.size()}});
}

void LearnerRuntime::Impl::heartbeat(bool force, bool leaving) {
  if (!publisher || (!force && seconds_since(last_heartbeat) < o.heartbeat_interval_s)) return;
  last_heartbeat = Clock::now();
  Member m;
  m.run_id = o.config.run.id;
  m.instance_id = o.learner_id;
  m.role = o.mode == LearnerMode::EvalOnly ? Role::Evaluator : Role::Learner;
  m.region = o.region;
  m.time_us = unix_us();
  m.step = step;
  m.step_time_s = static_cast<float>(step_time_ema);
  m.tokens_per_s = static_cast<float>(tokens_per_s);
  m.loss = std::isfinite(last_loss) ? last_loss : 0.0f;
  m.tokens = total_tokens;
  m.bytes_sent = publisher->stats().bytes_delivered;
  if (inbox) m.bytes_received = inbox->bytes_received();
  for (uint32_t p = 0; p < fragments.size(); ++p) {
    if (!takes_part[p]) continue;
    m.owned_fragments.push_back(p);
    m.fragment_versions.push_back(fragments[p].version());
  }
  m.incarnation = incarnation;
  m.leaving = leaving;
  m.batch = o.batch;
  m.context = o.context;
  publisher->submit_heartbeat(o.learner_id, encode_member(m));
}

void LearnerRuntime::Impl::write_step_line(float loss) {
  nlohmann::json record{{"event", "step"},           {"step", step},
                        {"loss", loss},              {"loss_ema", loss_ema},
                        {"step_time", step_time_ema}, {"tokens", total_tokens},
                        {"tokens_per_s", tokens_per_s}, {"adopted", adopted},
                        {"max_rss_kb", max_rss_kb()}, {"compute_seconds", compute_seconds},
                        {"wait_seconds", wait_seconds}};
  if (publisher) {
    auto s = publisher->stats();
    record["deltas_delivered"] = s.delivered;
    record["deltas_superseded"] = s.superseded;
    record["deltas_in_flight"] = s.in_flight;
    record["deltas_waiting"] = s.waiting;
    record["bytes_sent"] = s.bytes_delivered;
  }
  if (refusals) {
    record["deltas_dropped"] = refusals->dropped();
    record["deltas_refused"] = refusals->refused();
  }
  if (inbox) {
    record["params_received"] = inbox->received();
    record["params_rejected"] = inbox->rejected();
    record["bytes_received"] = inbox->bytes_received();
  }
  const KafkaTraffic kafka = kafka_traffic();
  record["kafka_sent"] = kafka.sent;
  record["kafka_received"] = kafka.received;
  metrics.set("kafka_bytes_sent", static_cast<double>(kafka.sent));
  metrics.set("kafka_bytes_received", static_cast<double>(kafka.received));
  nlohmann::json versions = nlohmann::json::array();
  for (const auto& f : fragments) versions.push_back(f.version());
  record["versions"] = versions;
  log(record);
}

// ---- the public face ----------------------------------------------------------------------------

LearnerRuntime::LearnerRuntime(RuntimeOptions options, std::vector<RegisteredTensor> tensors, HostSync sync)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(tensors), std::move(sync))) {}

LearnerRuntime::~LearnerRuntime() {
  try {
    close(impl_->started ? "destroyed" : "not started");
  } catch (const std::exception& e) {
    std::cerr << "learner " << impl_->o.learner_id << ": error while closing: " << e.what() << "\n";
  }
}

bool LearnerRuntime::start() {
  auto& s = *impl_;
  DILOCO_ENFORCE(!s.started && !s.closed, "LearnerRuntime::start() called twice or after close()");
  s.started = true;
  if (!s.o.run_dir.empty()) {
    std::filesystem::create_directories(s.o.run_dir);
    s.log_file = std::make_unique<JsonLines>(s.o.run_dir + "/metrics.jsonl");
  }
  s.endpoint = std::make_unique<MetricsEndpoint>(s.metrics, s.o.metrics_port);
  s.metrics.add("wait_seconds_total", 0);  // listed from the start, also in runs that never wait
  s.log({{"event", "start"}, {"mode", learner_mode_name(s.o.mode)}, {"region", s.o.region},
         {"config", s.o.config.source}, {"parameters", s.layout->numel()}, {"tensors", s.layout->tensors.size()},
         {"fragments", s.layout->num_fragments()}, {"fingerprint", s.layout->fingerprint}, {"client", s.o.client}});
  const StreamingSchedule schedule{
      .sync_interval = s.o.config.diloco.H, .num_fragments = s.o.config.diloco.fragments,
      .offset = s.o.config.diloco.stagger ? stagger_offset(s.o.index, s.o.learners, s.o.config.diloco.H) : 0u};
  if (!s.networked()) {
    // A standalone learner trains from the client's values, as version 0 of every fragment.
    for (uint32_t p = 0; p < s.layout->num_fragments(); ++p)
      if (s.takes_part[p]) s.fragments[p] = FragmentTrack(s.read_tensors(p), 0, 0, s.o.spill_dir);
    s.schedule.emplace(schedule, 0);
    s.last_step_end = Clock::now();
    return true;
  }
  // Authenticated parameters: the keys are read (and checked) before anything else.
  std::optional<CurveClientOptions> curve = curve_client_options(s.o.config.security);
  apply_kafka_security(s.o.kafka, s.o.config.security);
  wait_for_broker(s.o.kafka);
  {
    ConsumerOptions probe_options{.kafka = s.o.kafka};
    Consumer probe(probe_options);
    s.partitions = probe.partition_count(s.topics.deltas(s.o.region), 10000);
    const int genesis_partitions = probe.partition_count(s.topics.genesis(), 10000);
    if (genesis_partitions != s.partitions)
      throw InvalidInput(detail::concat(s.topics.genesis(), " has ", genesis_partitions, " partitions but ",
                                        s.topics.deltas(s.o.region), " has ", s.partitions,
                                        ": recreate the run's topics (scripts/broker topics)"));
  }
  std::vector<MemberRecord> records;
  try {
    const auto t0 = Clock::now();
    records = read_members(s.o.kafka, s.topics, s.limits(), s.o.learner_id,
                           s.o.config.merger.members_lookback_seconds, s.o.members_read_ms);
    s.log({{"event", "members_read"}, {"records", records.size()}, {"seconds", seconds_since(t0)}});
  } catch (const Unavailable& e) {
    s.say("cannot read " + s.topics.members() + " (" + e.what() + "): starting as a new learner");
  }
  if (!s.claim_id(records) || !s.join_run()) {
    s.log({{"event", "stop"}, {"step", 0}, {"tokens", 0}, {"reason", "signal"}, {"compute_seconds", 0.0},
           {"wait_seconds", 0.0}});
    s.say("stopped before the run began");
    return false;
  }
  {
    std::string versions;
    for (const auto& f : s.fragments) versions += " " + std::to_string(f.version());
    s.say("starting from versions" + versions);
  }
  ProducerOptions producer{.kafka = s.o.kafka, .delivery_timeout_ms = 0};
  producer.kafka.client_id = s.o.learner_id;
  s.publisher = std::make_unique<DeltaPublisher>(
      DeltaPublisherOptions{.producer = producer, .topics = s.topics, .partitions = s.partitions,
                            .chunk_bytes = s.o.config.codec.chunk_bytes},
      s.metrics);
  s.inbox = std::make_unique<ParamInbox>(
      ParamInboxOptions{.kafka = s.o.kafka, .topics = s.topics, .limits = s.limits(),
                        .endpoints = s.o.merger_endpoints,
                        .members_lookback_s = s.o.config.merger.members_lookback_seconds, .held = std::move(s.held_at_start),
                        .fragments = s.o.fragments, .curve = std::move(curve)},
      s.metrics);
  if (s.o.mode == LearnerMode::Train)
    s.refusals = std::make_unique<RefusalWatch>(
        RefusalWatchOptions{.kafka = s.o.kafka, .topics = s.topics, .partitions = s.partitions,
                            .learner_id = s.o.learner_id, .limits = s.limits(),
                            .say = [&s](const std::string& text) { s.say(text); },
                            .log = [&s](nlohmann::json record) { s.log(std::move(record)); }},
        s.metrics);
  // A learner restarted under the same id continues where the run stands (learner/resume.h).
  std::map<uint32_t, uint64_t> current;
  if (s.o.mode != LearnerMode::EvalOnly) {
    const bool synchronous = s.o.config.diloco.wait_steps >= 0;
    const ResumePoint r = resume_point(s.o.learner_id, records,
                                       static_cast<int64_t>(s.o.config.merger.liveness_seconds * 1000), synchronous);
    if (r.restarted) {
      s.step = r.step;
      current = r.versions;
      s.say(detail::concat("restarted, continuing at step ", r.step,
                           synchronous ? " (one below the slowest of " : " (its last announced step; ", r.live_peers,
                           " live peer(s))"));
      s.log({{"event", "resume"}, {"step", r.step}, {"live_peers", r.live_peers}, {"synchronous", synchronous}});
    }
  }
  s.schedule.emplace(schedule, s.step);
  if (!current.empty()) s.wait_for_versions(current);
  // The first announcement holds the id: start() returns once the broker has it, so that another
  // process starting under this id from now on finds the claim (claim_id). Bounded: a slow broker
  // delays the claim, never the training.
  s.heartbeat(true);
  const auto claimed = Clock::now();
  while (s.publisher->stats().heartbeats_delivered == 0 && seconds_since(claimed) < s.o.id_claim_wait_s &&
         !s.stopping())
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  s.last_step_end = Clock::now();
  return true;
}

void LearnerRuntime::step(const StepReport& report) {
  auto& s = *impl_;
  DILOCO_ENFORCE(s.started && !s.closed, "LearnerRuntime::step() before start() or after close()");
  DILOCO_ENFORCE(s.o.mode != LearnerMode::EvalOnly, "LearnerRuntime::step() of an eval-only learner");
  if (report.tokens == 0) throw InvalidInput("a step of 0 tokens: report the tokens (or samples) it trained on");
  if (const uint64_t most = uint64_t{s.o.batch} * s.o.context; most > 0 && report.tokens > most)
    throw InvalidInput(detail::concat("a step of ", report.tokens, " tokens, more than the ", s.o.batch, " sequences x ",
                                      s.o.context, " tokens this learner declared (batch and context): the mergers "
                                      "would refuse its deltas; declare the largest step it takes"));
  const auto entered = Clock::now();
  const double before = std::chrono::duration<double>(entered - s.last_step_end).count();
  const float loss = report.loss.value_or(std::numeric_limits<float>::quiet_NaN());
  ++s.step;
  s.total_tokens += report.tokens;
  if (std::isfinite(loss)) s.last_loss = loss;
  for (auto& f : s.fragments) f.count_step(report.tokens);
  if (s.o.mode == LearnerMode::Train && s.networked()) {
    for (uint32_t p : s.schedule->due(s.step)) {
      if (!s.takes_part[p]) continue;
      s.publish_delta(p, loss, false);
      s.schedule->cut(p, s.step);
    }
  }
  s.adopt_received(loss);
  const double step_time = report.seconds.value_or(before) + seconds_since(entered);
  s.compute_seconds += step_time;
  s.step_time_ema = s.step_time_ema == 0 ? step_time : 0.9 * s.step_time_ema + 0.1 * step_time;
  s.tokens_per_s = s.step_time_ema > 0 ? static_cast<double>(report.tokens) / s.step_time_ema : 0;
  if (std::isfinite(loss)) s.loss_ema = s.loss_ema == 0 ? loss : 0.95 * s.loss_ema + 0.05 * loss;
  s.metrics.set("step", static_cast<double>(s.step));
  s.metrics.set("step_time_seconds", s.step_time_ema);
  s.metrics.set("tokens_per_second", s.tokens_per_s);
  if (std::isfinite(loss)) s.metrics.set("train_loss", loss);
  s.metrics.add("tokens_total", static_cast<double>(report.tokens));
  s.heartbeat();
  // What the mergers refused is news on the heartbeat's scale, not the step's: read once a second.
  if (s.refusals && seconds_since(s.last_refusal_poll) >= 1.0) {
    s.last_refusal_poll = Clock::now();
    s.refusals->poll();
  }
  if (s.o.log_every > 0 && s.step % static_cast<uint64_t>(s.o.log_every) == 0)
    s.write_step_line(std::isfinite(loss) ? loss : s.last_loss);
  s.wait_for_merges(loss);
  s.last_step_end = Clock::now();
}

size_t LearnerRuntime::poll() {
  auto& s = *impl_;
  DILOCO_ENFORCE(s.started && !s.closed, "LearnerRuntime::poll() before start() or after close()");
  const uint64_t before = s.adopted;
  s.adopt_received(s.last_loss);
  s.heartbeat();
  return static_cast<size_t>(s.adopted - before);
}

void LearnerRuntime::record_eval(double loss) {
  auto& s = *impl_;
  DILOCO_ENFORCE(s.started, "LearnerRuntime::record_eval() before start()");
  if (s.o.mode == LearnerMode::EvalOnly) {
    nlohmann::json versions = nlohmann::json::array();
    uint64_t sum = 0;
    for (const auto& f : s.fragments) {
      versions.push_back(f.version());
      sum += f.version();
    }
    s.metrics.set("global_eval_loss", loss);
    s.log({{"event", "global_eval"}, {"eval_loss", loss}, {"versions", versions}, {"version_sum", sum}});
  } else {
    s.metrics.set("eval_loss", loss);
    s.log({{"event", "eval"}, {"step", s.step}, {"eval_loss", loss}, {"tokens", s.total_tokens}});
  }
}

void LearnerRuntime::close(std::string_view reason) {
  auto& s = *impl_;
  if (s.closed) return;
  s.closed = true;
  if (!s.started) return;
  if (s.o.mode != LearnerMode::EvalOnly)
    s.log({{"event", "stop"}, {"step", s.step}, {"tokens", s.total_tokens}, {"reason", reason},
           {"compute_seconds", s.compute_seconds}, {"wait_seconds", s.wait_seconds}});
  if (!s.publisher) return;
  // The last announcement says where this learner stopped (a restart continues there) and that it
  // left: mergers stop counting it as live and the id is free at once.
  s.heartbeat(true, true);
  auto undelivered = s.publisher->close(s.o.shutdown_flush);
  auto stats = s.publisher->stats();
  s.say(detail::concat(stats.delivered, " deltas delivered, ", stats.superseded, " superseded, ", undelivered.size(),
                       " not delivered"));
  nlohmann::json lost = nlohmann::json::array();
  for (auto [p, seq] : undelivered) lost.push_back({{"fragment", p}, {"seq", seq}});
  nlohmann::json record{{"event", "shutdown"}, {"delivered", stats.delivered}, {"superseded", stats.superseded},
                        {"bytes_sent", stats.bytes_delivered}, {"undelivered", lost}};
  if (s.inbox) {
    record["bytes_received"] = s.inbox->bytes_received();
    record["snapshots_received"] = s.inbox->snapshots();
    record["updates_received"] = s.inbox->updates();
  }
  const KafkaTraffic kafka = kafka_traffic();
  record["kafka_sent"] = kafka.sent;
  record["kafka_received"] = kafka.received;
  s.log(record);
  s.inbox.reset();
}

const FragmentLayout& LearnerRuntime::layout() const { return *impl_->layout; }
uint64_t LearnerRuntime::fingerprint() const { return impl_->layout->fingerprint; }
const RuntimeOptions& LearnerRuntime::options() const { return impl_->o; }
bool LearnerRuntime::started() const { return impl_->started; }
bool LearnerRuntime::closed() const { return impl_->closed; }
uint64_t LearnerRuntime::step_count() const { return impl_->step; }
uint64_t LearnerRuntime::tokens() const { return impl_->total_tokens; }
std::vector<uint64_t> LearnerRuntime::versions() const {
  std::vector<uint64_t> out;
  for (const auto& f : impl_->fragments) out.push_back(f.version());
  return out;
}
std::vector<uint32_t> LearnerRuntime::fragment_tensors(uint32_t p) const { return impl_->members.at(p); }
Metrics& LearnerRuntime::metrics() { return impl_->metrics; }
void LearnerRuntime::log(nlohmann::json record) { impl_->log(std::move(record)); }

std::vector<uint8_t> LearnerRuntime::save_state() const {
  const auto& s = *impl_;
  SavedLearner saved{.run_id = s.o.config.run.id, .fingerprint = s.layout->fingerprint, .learner_id = s.o.learner_id,
                     .step = s.step, .tokens = s.total_tokens};
  for (uint32_t p = 0; p < s.fragments.size(); ++p) {
    if (!s.takes_part[p]) continue;
    FragmentTrack::Saved f = s.fragments[p].save();
    saved.fragments.push_back(SavedFragment{.fragment = p, .version = f.version, .checksum = f.checksum,
                                            .anchor = std::move(f.anchor), .carried = std::move(f.carried),
                                            .last_cut = std::move(f.last_cut), .cut_point = std::move(f.cut_point),
                                            .sent_on_base = f.sent_on_base, .steps = f.steps, .tokens = f.tokens,
                                            .steps_at_cut = f.steps_at_cut, .tokens_at_cut = f.tokens_at_cut,
                                            .seq = s.seqs[p]});
  }
  return encode_learner_state(saved);
}

void LearnerRuntime::load_state(std::span<const uint8_t> bytes) {
  auto& s = *impl_;
  DILOCO_ENFORCE(s.started && !s.closed, "LearnerRuntime::load_state() before start() or after close()");
  SavedLearner saved;
  try {
    saved = decode_learner_state(bytes, s.limits());
  } catch (const Rejection& e) {
    throw InvalidInput(std::string("not a saved state of this learner's run and model: ") + e.what());
  }
  if (saved.learner_id != s.o.learner_id)
    throw InvalidInput("the saved state belongs to learner '" + saved.learner_id + "', this learner is '" +
                       s.o.learner_id + "'");
  {  // the fragments this learner takes part in, no more and no fewer, before anything changes
    std::vector<bool> saved_here(s.fragments.size(), false);
    for (const auto& f : saved.fragments) saved_here[f.fragment] = true;  // each < P, once: decoded
    if (saved_here != s.takes_part) {
      auto list = [](const std::vector<bool>& in) {
        std::string out;
        for (uint32_t p = 0; p < in.size(); ++p)
          if (in[p]) out += (out.empty() ? "" : ",") + std::to_string(p);
        return out;
      };
      throw InvalidInput("the saved state holds fragments " + list(saved_here) + ", this learner takes part in " +
                         list(s.takes_part) + " (RuntimeOptions::fragments): load it into a learner of the same fragments");
    }
  }
  for (auto& f : saved.fragments) {
    const uint32_t p = f.fragment;
    FragmentTrack current = std::move(s.fragments[p]);
    s.fragments[p] = FragmentTrack::restore(FragmentTrack::Saved{
        .version = f.version, .checksum = f.checksum, .anchor = std::move(f.anchor), .carried = std::move(f.carried),
        .last_cut = std::move(f.last_cut), .sent_on_base = f.sent_on_base, .steps = f.steps, .tokens = f.tokens,
        .cut_point = std::move(f.cut_point), .steps_at_cut = f.steps_at_cut, .tokens_at_cut = f.tokens_at_cut},
        s.o.spill_dir);
    s.seqs[p] = std::max(s.seqs[p], f.seq);
    // The run moved on while this learner was away: rebase its saved progress onto the version it
    // joined at, as an adoption would.
    if (current.version() > f.version) {
      s.fragments[p].rebase_into(current.version(), current.checksum(), current.anchor_version(), s.host_view(p, true));
      s.written(p);
    }
  }
  s.step = saved.step;
  s.total_tokens = saved.tokens;
  const StreamingSchedule schedule{
      .sync_interval = s.o.config.diloco.H, .num_fragments = s.o.config.diloco.fragments,
      .offset = s.o.config.diloco.stagger ? stagger_offset(s.o.index, s.o.learners, s.o.config.diloco.H) : 0u};
  s.schedule.emplace(schedule, s.step);
  s.log({{"event", "load_state"}, {"step", s.step}, {"versions", versions()}});
}

}  // namespace diloco
