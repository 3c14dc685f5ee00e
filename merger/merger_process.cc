#include "merger/merger_process_impl.h"

#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <thread>

#include "core/codec/chunk.h"
#include "core/fragments/partition.h"
#include "core/kafka/run_log.h"
#include "core/kafka/security.h"
#include "core/kafka/traffic.h"
#include "core/process.h"

namespace diloco {

namespace {

using Clock = MergerProcess::Clock;

// The first tensor of `state` with a value that is not finite, named, if any.
std::optional<std::string> first_non_finite(const FragmentState& state) {
  auto scan = [](const std::vector<DenseTensor>& tensors, const char* what) -> std::optional<std::string> {
    for (const auto& t : tensors)
      for (float v : t.values)
        if (!std::isfinite(v)) return std::string(what) + " of tensor " + std::to_string(t.index);
    return std::nullopt;
  };
  if (auto bad = scan(state.params, "params")) return bad;
  if (auto bad = scan(state.momentum, "momentum")) return bad;
  return scan(state.outer_state, "outer state");
}

}  // namespace

MergerProcess::MergerProcess(const MergerOptions& options, const std::atomic<bool>& stop)
    : o_(options), t_(options.timeouts), pool_(options.merge_threads), topics_{options.config.run.id},
      grace_(GraceWindowOptions{.gamma = options.config.merger.grace_gamma,
                                .tau = options.config.merger.grace_tau,
                                .cap_step_times = options.config.merger.grace_cap_steps,
                                .cap_seconds = options.config.merger.grace_cap_seconds}),
      book_(stop, options.config.diloco.fragments, limits()),
      membership_(options.config.merger.liveness_seconds),
      snapshots_(SnapshotRequestOptions{.interval = std::chrono::milliseconds(options.timeouts.snapshot_interval_ms),
                                        .resend = std::chrono::milliseconds(options.timeouts.snapshot_resend_ms),
                                        .queue_bytes = options.snapshot_queue_bytes}) {
  validate_run_config(o_.config);
  // Chunks that cannot fit one Kafka record are refused now; the layout's own bounds are checked
  // when a learner's proposal or a checkpoint tells it (adopt_layout).
  check_chunk_bytes(o_.config, o_.kafka.max_message_bytes);
}

// The transaction timeout the run's model needs (merger.transaction_seconds alone before the
// layout is known: the genesis checkpoints wait for it).
int MergerProcess::transaction_timeout() const {
  const auto& m = o_.config.merger;
  const uint64_t bytes =
      layout_ ? largest_transaction_bytes(*layout_, o_.config.codec.downlink_dtype != DType::F32,
                                          has_outer_state(*parse_outer_optimizer(m.optimizer)))
              : 0;
  return transaction_timeout_ms(bytes, m.transaction_seconds, m.min_write_mb_per_s * 1e6);
}

// The transactional producer, with a timeout for transactions this long. Called with no
// transaction open (every commit opens and ends its own): a new producer of the same
// transactional id fences the old one, which has nothing left to lose.
void MergerProcess::make_writer(int timeout_ms) {
  writer_.reset();
  writer_ = std::make_unique<LogWriter>(writer_kafka_, "diloco." + o_.config.run.id + ".merger." + o_.instance_id, t_,
                                        timeout_ms, faults_.fail_commit, [this] { book_.request_recovery(true); },
                                        [this] { injected_fault(); });
  log({{"event", "transaction_timeout"}, {"ms", timeout_ms}});
  if (timeout_ms >= kMaxTransactionTimeoutMs)
    std::cerr << "merger " << o_.instance_id << ": the largest transaction needs more than the broker's "
              << kMaxTransactionTimeoutMs / 1000 << " s at merger.min_write_mb_per_s "
              << o_.config.merger.min_write_mb_per_s << ": run more mergers (fewer fragments each) or a faster link\n";
}

// The run's layout, once: a model whose messages cannot travel is refused (the learners check it
// before proposing, so a proposal that fails here was made with other Kafka limits).
void MergerProcess::adopt_layout(std::shared_ptr<const FragmentLayout> layout) {
  check_message_sizes(o_.config, *layout, o_.kafka.max_message_bytes);
  // Tightened, not replaced: a new assembler would drop the pieces of other proposals (and
  // deltas) still being put together.
  layout_ = std::move(layout);
  book_.set_limits(limits());
  if (writer_ && writer_->transaction_timeout_ms() != transaction_timeout()) make_writer(transaction_timeout());
  log({{"event", "layout"}, {"fingerprint", layout_->fingerprint}, {"tensors", layout_->tensors.size()},
       {"parameters", layout_->numel()}, {"fragments", layout_->num_fragments()}});
  std::cerr << "merger " << o_.instance_id << ": the run's model has " << layout_->tensors.size() << " tensors, "
            << layout_->numel() << " parameters in " << layout_->num_fragments() << " fragments\n";
}

void MergerProcess::log(nlohmann::json record) {
  record["t"] = now();
  record["time_us"] = unix_us();
  record["merger"] = o_.instance_id;
  if (log_) log_->write(record);
}

void MergerProcess::add_state_write(std::vector<LogWrite>& writes, const FragmentState& state) {
  const uint32_t p = state.fragment;
  LogWrite w{.topic = topics_.state(), .partition = book_.partition_of(p), .key = std::to_string(p), .value = {},
             .chunk_id = ChunkId{o_.config.run.id, o_.instance_id, p, state.version},
             .chunk_bytes = o_.config.codec.chunk_bytes, .replaces_pieces = state_pieces_[p], .segments = {}};
  const uint64_t segment_bytes = o_.config.codec.segment_bytes;
  if (fragment_state_segments(state, segment_bytes) == 1)
    w.value = encode_fragment_state(state);
  else  // encoded inside the transaction, one segment at a time; `state` outlives the commit
    w.segments = [&state, segment_bytes](const SegmentSink& sink) {
      for_each_fragment_state_segment(state, segment_bytes, 1, sink);
    };
  writes.push_back(std::move(w));
}

// Fault injection (MergerFaults): the stop a test times on the Nth injected fault arrives as a real
// SIGTERM, handled before the fault is thrown.
void MergerProcess::injected_fault() {
  if (++faults_fired_ == faults_.stop_at) std::raise(SIGTERM);
}

void MergerProcess::recover(const std::set<int32_t>& partitions) {
  auto t0 = Clock::now();
  if (const int recovery = book_.begin_recovery(); recovery == faults_.fail_recovery) {
    injected_fault();
    throw Unavailable("fault injection: recovery " + std::to_string(recovery) + " fails");
  }
  if (!layout_)
    if (auto layout = read_run_layout(o_.kafka, topics_, o_.config, t_.metadata_ms)) adopt_layout(std::move(layout));
  for (int32_t partition : partitions) {
    auto fragments = book_.fragments_of(partition);
    if (!layout_) {  // the run has no version 0 anywhere yet
      book_.awaiting_genesis.insert(fragments.begin(), fragments.end());
      continue;
    }
    auto recovered = recover_partition(log_context(), partition, fragments);
    for (auto& [p, r] : recovered) {
      if (r.awaiting_genesis) {
        book_.awaiting_genesis.insert(p);
        continue;
      }
      OwnedFragment f;
      f.merger = std::make_unique<FragmentMerger>(p, r.state.version, outer_hyper(o_.config), now(),
                                                  r.state.merged_bases, input_bounds());
      f.state = std::move(r.state);
      state_pieces_[p] = r.state_pieces;
      log({{"event", "recovered"}, {"fragment", p}, {"version", f.state.version}, {"checksum", f.state.checksum},
           {"replayed", r.replayed.size()}, {"checkpoint_pieces", r.state_pieces}});
      book_.owned[p] = std::move(f);
      metrics_.set("fragment_version", static_cast<double>(book_.owned[p].state.version),
                   {{"fragment", std::to_string(p)}});
    }
  }
  if (!book_.awaiting_genesis.empty()) {
    std::cerr << "merger " << o_.instance_id << ": waiting for a learner's proposal of version 0 of fragment(s)";
    for (uint32_t p : book_.awaiting_genesis) std::cerr << " " << p;
    std::cerr << "\n";
  }
  // Nothing is broadcast: learners hold what the logs hold (they start from the `state` topic) and
  // ask for a snapshot when this merger's heartbeat, sent next, names a version they lack.
  double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  metrics_.observe("recovery_seconds", seconds, {0.1, 0.5, 1, 2, 5, 10, 30});
  std::cerr << "merger " << o_.instance_id << ": owns fragments";
  for (const auto& [p, f] : book_.owned) std::cerr << " " << p << "@v" << f.state.version;
  std::cerr << " (recovered in " << seconds << " s)\n";
}

// Runs inside librdkafka's poll: it only records the assignment. Recovery, which reads the logs
// for seconds or minutes and may fail, runs in the loop (ensure_recovered) before the next delta.
void MergerProcess::on_assigned(const std::vector<TopicPartitionOffset>& partitions) {
  epoch_ = static_cast<uint64_t>(unix_us() / 1000);
  std::set<int32_t> assigned;
  for (const auto& tp : partitions) assigned.insert(tp.partition);
  book_.assign(std::move(assigned));
  const auto& now_assigned = book_.assigned();
  log({{"event", "assigned"}, {"partitions", std::vector<int32_t>(now_assigned.begin(), now_assigned.end())},
       {"epoch", epoch_}});
}

// Rebuilds the owned fragments if a new assignment or a failure asked for it, retrying while the
// broker is away. Returns true when the consumer was rewound: a message polled before this call
// will be read again and must not be handled.
bool MergerProcess::ensure_recovered() {
  bool rewound = false;
  while (book_.recovery_due()) {
    try {
      recover(book_.assigned());
      if (book_.rewind_needed()) {
        consumer_->rewind_to_committed(t_.committed_offsets_ms);
        if (const int rewind = book_.begin_rewind(); rewind == faults_.fail_rewind) {
          injected_fault();
          throw Unavailable("fault injection: rewind " + std::to_string(rewind) + " fails after its seeks");
        }
        book_.rewound();
        rewound = true;
        const auto& assigned = book_.assigned();
        log({{"event", "rewound"}, {"partitions", std::vector<int32_t>(assigned.begin(), assigned.end())}});
      }
      book_.recovered();
      announce(false);
    } catch (const Unavailable& e) {
      std::cerr << "merger " << o_.instance_id << ": broker unavailable, retrying recovery: " << e.what() << "\n";
      log({{"event", "recovery_failed"}, {"detail", e.what()}});
      book_.recovery_failed();
      std::this_thread::sleep_for(std::chrono::milliseconds(t_.recovery_retry_ms));
    }
  }
  return rewound;
}

// Polls one delta and handles it once the owned fragments are current. Returns whether one was
// handled. A stop that came before the recovery succeeded leaves the message unhandled: with no
// trusted fragments it would be refused as another owner's, and its offset is not committed, so
// the next owner reads it.
bool MergerProcess::consume(int timeout_ms) {
  auto message = consumer_->poll(timeout_ms);
  const bool rewound = ensure_recovered();
  if (!book_.handles_polled(rewound) || !message) return false;
  handle_delta(std::move(*message));
  return true;
}

// Unread deltas of an owned partition from the high watermark of its last fetch (the broker's
// offsets: no learner's clock decides whether the merger is behind, and no broker call blocks the
// loop); nullopt before that partition's first fetch.
std::optional<int64_t> MergerProcess::unread(const std::pair<std::string, int32_t>& tp, int64_t next) {
  auto high = consumer_->cached_high_watermark(tp.first, tp.second);
  if (!high) return std::nullopt;
  return std::max<int64_t>(0, *high - next);
}

bool MergerProcess::backlog() {
  for (const auto& [tp, next] : book_.next_offsets())
    if (unread(tp, next).value_or(0) > 0) return true;
  return false;
}

// After reading a delta while more are waiting (a backlog, e.g. after an outage), reads on while
// deltas keep coming, so that the merges see each learner's newest delta instead of its oldest
// (ARCHITECTURE.md section 6).
void MergerProcess::catch_up() {
  const auto until = Clock::now() + std::chrono::milliseconds(t_.catch_up_ms);
  while (Clock::now() < until && !book_.stop_requested()) {
    if (!consume(backlog() ? t_.catch_up_poll_ms : 0)) return;
  }
}

void MergerProcess::on_revoked(const std::vector<TopicPartitionOffset>&) {
  // Held deltas are not recorded: their offsets are not committed, so the next owner reads them.
  log({{"event", "revoked"}, {"fragments", book_.owned.size()}});
  book_.revoke();
}

void MergerProcess::reject(const ConsumedMessage& message, const std::string& reason, const std::string& detail,
                           const std::string& sender) {
  reject({message.topic, message.partition, message.offset}, message.value.size(), message.value, reason, detail,
         sender);
}

void MergerProcess::reject(const LogPosition& at, size_t payload_size, const std::vector<uint8_t>& head,
                           const std::string& reason, const std::string& detail, const std::string& sender) {
  metrics_.add("deltas_rejected_total", 1, {{"reason", reason}});
  RejectedInput r{.run_id = o_.config.run.id, .source = at, .reason = reason, .detail = detail,
                  .rejected_by = o_.instance_id, .time_us = unix_us(), .payload_size = payload_size,
                  .sender = sender};
  r.payload_head.assign(head.begin(), head.begin() + std::min<size_t>(head.size(), 256));
  auto bytes = encode_rejected(r);
  send_plain({.topic = topics_.rejected(), .partition = 0, .key = "", .value = bytes});
  log({{"event", "rejected"}, {"topic", at.topic}, {"partition", at.partition}, {"offset", at.offset},
       {"reason", reason}, {"detail", detail}});
}

void MergerProcess::reject_chunks(const std::vector<ChunkProblem>& problems) {
  for (const auto& p : problems) reject(p.position, p.payload_size, {}, reject_reason_name(p.reason), p.detail);
}

// Called with the owned fragments rebuilt (consume and drain hand in nothing else: ProcessState's
// handles_polled).
void MergerProcess::handle_delta(ConsumedMessage record) {
  auto assembled = book_.consume(std::move(record), now());
  if (!assembled) return;  // not consumed: a recovery is needed first
  reject_chunks(assembled->problems);
  if (!assembled->message) return;  // a piece of a delta still incomplete, or a bad piece
  const ConsumedMessage& message = *assembled->message;
  if (message.topic == topics_.genesis()) {
    handle_proposal(message);
    return;
  }
  const std::string no_genesis = "a delta of a fragment without version 0 (no learner's proposal was committed)";
  if (!layout_) {
    reject(message, "no_genesis", no_genesis);
    return;
  }
  // Read again after a restart, a rebalance or a rewind: a committed record accounts for it. Known
  // by its position alone, before decoding (a backlog read again must not cost decompressing it).
  // Any other delta, a duplicate or a replay included, goes through the pending-set rules and is
  // merged or dropped with a reason.
  if (book_.accounted({message.topic, message.partition, message.offset})) {
    metrics_.add("deltas_reread_total", 1);
    return;
  }
  Delta delta;
  try {
    metrics_.add("deltas_decoded_total", 1);
    delta = decode_delta(message.value, limits(), DeltaValues::AsSent);
  } catch (const Rejection& e) {
    std::string sender;
    try {
      sender = peek_delta_header(message.value, limits()).learner_id;
    } catch (const Rejection&) {
      // a header that does not decode names nobody
    }
    reject(message, reject_reason_name(e.reason), e.what(), sender);
    return;
  }
  uint32_t p = delta.header.fragment;
  const std::string sender = delta.header.learner_id;
  switch (book_.owner_of(p, message.partition)) {
    case DeltaOwner::Owned:
      break;
    case DeltaOwner::AwaitingGenesis:
      reject(message, "no_genesis", no_genesis, sender);
      return;
    case DeltaOwner::WrongPartition:
      reject(message, "wrong_partition",
             "fragment " + std::to_string(p) + " belongs in partition " + std::to_string(book_.partition_of(p)),
             sender);
      return;
    case DeltaOwner::Unrecovered:
      return;  // not reached: book_.consume took nothing in
  }
  auto& f = book_.owned.at(p);
  metrics_.add("deltas_received_total", 1, {{"region", delta.header.region}});
  metrics_.add("delta_wire_bytes_total", static_cast<double>(message.value.size()));
  // The sender's announcement in `members` bounds its tokens; follow_members() ran in this loop,
  // and a learner announces itself before its first delta, so it is normally known by now.
  auto declared = membership_.declared(sender);
  if (!declared) metrics_.add("deltas_tokens_unchecked_total", 1);
  auto dropped = f.merger->offer(delta_ref(delta.header, {message.topic, message.partition, message.offset}),
                                 DeltaTensors(std::move(delta)), now(), declared);
  if (dropped) metrics_.add("deltas_dropped_total", 1, {{"reason", drop_reason_name(dropped->reason)}});
}

// A learner's proposal of version 0 of a fragment. The first valid one of an owned fragment that
// has none is committed: its checkpoint and a genesis record naming the proposal, with the
// consumed offset, in one transaction (so exactly once, and replayable). Any other is rejected
// with its reason in `rejected`, which the proposing learner reads and prints; a second proposal
// of the same model (learners that started together) is rejected as genesis_exists, which the
// learner ignores.
void MergerProcess::handle_proposal(const ConsumedMessage& message) {
  // Decoded against its own layout, compared with the run's below. A streamed one (above
  // codec.segment_bytes of values) comes together segment by segment.
  GenesisProposal proposal;
  try {
    auto read = book_.read_proposal(message);
    if (!read) {
      metrics_.add("proposal_segments_total", 1);
      return;
    }
    proposal = std::move(*read);
  } catch (const Rejection& e) {
    // A streamed proposal cut short is rejected where it began, where replay's audit counts it.
    const auto& began = book_.dropped_proposal_head();
    reject(began.value_or(LogPosition{message.topic, message.partition, message.offset}), message.value.size(),
           message.value, reject_reason_name(e.reason), e.what());
    return;
  }
  // Where the proposal began (its segment 0, or the whole message): its genesis record names it
  // there, and so does any rejection of it below.
  const LogPosition at = book_.proposal_head();
  auto refuse = [&](const std::string& reason, const std::string& detail) {
    reject(at, message.value.size(), message.value, reason, detail, proposal.learner_id);
  };
  const uint32_t p = proposal.fragment;
  const std::string who = "learner " + proposal.learner_id;
  if (book_.partition_of(p) != message.partition || (!book_.awaiting_genesis.count(p) && !book_.owned.count(p))) {
    refuse("wrong_partition",
           detail::concat("fragment ", p, " belongs in partition ", book_.partition_of(p), " of ",
                          o_.config.diloco.fragments, " fragments"));
    return;
  }
  if (layout_ && proposal.fingerprint != layout_->fingerprint) {
    std::string why = describe_difference(layout_->tensors, proposal.layout->tensors);
    if (why.empty())
      why = detail::concat("the run has ", layout_->num_fragments(), " fragments, the proposal ",
                           proposal.layout->num_fragments());
    refuse("wrong_fingerprint", who + " proposed another model than the run's: " + why);
    return;
  }
  if (auto it = book_.owned.find(p); it != book_.owned.end()) {
    refuse("genesis_exists",
           detail::concat(who, " proposed version 0 of fragment ", p, ", which has one (now at version ",
                          it->second.state.version, ")"));
    return;
  }
  if (!layout_) {
    try {
      adopt_layout(proposal.layout);
    } catch (const InvalidInput& e) {
      refuse("too_large", e.what());
      return;
    }
  }
  OwnedFragment f;
  f.state = genesis_state(o_.config, layout_, p, std::move(proposal.tensors));
  f.merger = std::make_unique<FragmentMerger>(p, 0, outer_hyper(o_.config), now(), std::map<std::string, uint64_t>{},
                                              input_bounds());
  MergeRecord record{.run_id = o_.config.run.id, .fingerprint = layout_->fingerprint, .fragment = p, .version = 0,
                     .prev_version = 0,
                     .inputs = {DeltaRef{.position = at, .learner_id = proposal.learner_id, .seq = proposal.seq}},
                     .rule = merge_rule(o_.config), .optimizer = outer_optimizer(o_.config),
                     .hyper = outer_hyper(o_.config), .checksum = f.state.checksum, .merger_instance = o_.instance_id,
                     .epoch = epoch_, .merge_time_us = unix_us(), .genesis = true};
  book_.owned[p] = std::move(f);
  book_.awaiting_genesis.erase(p);
  try {
    commit(p, record, true);
  } catch (const Fenced&) {
    throw;
  } catch (const Error& e) {
    // Nothing of it is visible: the recovery reads the proposal again.
    std::cerr << "merger " << o_.instance_id << ": committing version 0 of fragment " << p << " failed, recovering: "
              << e.what() << "\n";
    log({{"event", "genesis_failed"}, {"fragment", p}, {"detail", e.what()}});
    writer_->abort();
    book_.request_recovery(true);
    return;
  }
  metrics_.add("genesis_total", 1);
  metrics_.set("fragment_version", 0, {{"fragment", std::to_string(p)}});
  log({{"event", "genesis"}, {"fragment", p}, {"learner", proposal.learner_id}, {"checksum", record.checksum},
       {"topic", message.topic}, {"partition", message.partition}, {"offset", message.offset}});
  std::cerr << "merger " << o_.instance_id << ": version 0 of fragment " << p << " from " << who << "\n";
  announce(false);
}

// Everything is encoded before the transaction starts, so that its timeout covers only the
// produce and commit round trips, whatever the fragment's size. The checkpoint cannot know the
// offset of the record it is written with; it names the previous record instead (a position at
// or before its own, where recovery starts reading: recover_partition).
void MergerProcess::commit(uint32_t p, MergeRecord& record, bool write_state) {
  // The bookkeeping is updated in place: if the commit fails, the loop rebuilds the fragment from
  // the logs (as it does the parameters a merge wrote over the state).
  auto& f = book_.owned.at(p);
  account(f.state, record);
  const auto offsets = book_.offsets_to_commit();
  prune_recent(f.state, offsets);
  std::vector<LogWrite> writes;
  writes.push_back({topics_.merges(), book_.partition_of(p), std::to_string(p), encode_merge_record(record)});
  if (write_state) {
    f.state.consumed.clear();
    for (const auto& tp : offsets) f.state.consumed.push_back({tp.topic, tp.partition, tp.offset});
    add_state_write(writes, f.state);
  }
  // The record's own position becomes the next checkpoint's starting point.
  if (auto position = writer_->commit(writes, offsets, *consumer_, true)) f.state.last_merge = *position;
  if (write_state) state_pieces_[p] = writer_->records_written().back();
  book_.committed(offsets);
}

RoundTiming MergerProcess::round_timing(const FragmentMerger& merger, const MergePlan& plan,
                                        const std::vector<std::string>& live) const {
  RoundTiming timing;
  const double t = now();
  const double quorum = merger.quorum_reached().value_or(t);
  timing.quorum_seconds = std::max(0.0, quorum - merger.round_first_delta().value_or(quorum));
  timing.grace_seconds = std::max(0.0, t - quorum);
  std::set<std::string> merged;
  for (const auto& in : plan.inputs) merged.insert(in.ref.learner_id);
  for (const auto& learner : live)
    if (!merged.count(learner)) timing.missed.push_back(learner);
  return timing;
}

namespace {
double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
}  // namespace

void MergerProcess::merge(uint32_t p, const std::vector<std::string>& live) {
  auto& f = book_.owned.at(p);
  MergePlan plan = f.merger->take_merge_inputs(now());
  const RoundTiming timing = round_timing(*f.merger, plan, live);

  MergeOptions options{.rule = merge_rule(o_.config), .optimizer = outer_optimizer(o_.config),
                       .hyper = outer_hyper(o_.config), .tensors = layout_->fragments[p],
                       .downlink = downlink_codec(o_.config), .change = &f.change, .pool = &pool_};
  const bool share_scaling = o_.config.merger.share_scaling;
  set_merge_share(options, plan.inputs, share_scaling ? live.size() : 0, share_scaling);
  const uint64_t version = f.state.version;
  // The momentum of this merge (the record keeps it).
  options.hyper.momentum =
      scheduled_momentum(momentum_schedule(o_.config), next_merge_count(f.state, options.optimizer), version + 1);
  const uint64_t checksum = f.state.checksum;
  // In place: a fragment is held once (no second copy to write the next version into).
  const auto t_step = Clock::now();
  MergeRecord record = merge_step_in_place(f.state, plan.inputs, options);
  const auto bad = first_non_finite(f.state);
  const auto t_commit = Clock::now();
  if (bad) {
    f.state.version = version;
    f.state.checksum = checksum;
    abandon_merge(p, plan, "the merge result is not finite (" + *bad + "): nothing of it was applied");
    // Its parameters were overwritten: rebuild them (and every owned fragment) from the logs.
    book_.request_recovery(true);
    return;
  }
  record.dropped = std::move(plan.dropped);
  record.merger_instance = o_.instance_id;
  record.epoch = epoch_;
  record.merge_time_us = unix_us();
  bool checkpoint = record.version % o_.config.merger.checkpoint_every == 0;
  commit(p, record, checkpoint);
  const auto t_publish = Clock::now();
  auto late_drops = f.merger->merge_committed(f.state.version);
  for (const auto& d : late_drops) metrics_.add("deltas_dropped_total", 1, {{"reason", drop_reason_name(d.reason)}});
  if (options.downlink.dtype == DType::F32)
    publish(p);
  else
    publish_update(p);
  const auto t_done = Clock::now();
  double sync = f.merger->published(now());
  grace_.observe_sync_time(sync);

  metrics_.add("merges_total", 1);
  metrics_.add("deltas_merged_total", static_cast<double>(record.inputs.size()));
  metrics_.set("fragment_version", static_cast<double>(f.state.version), {{"fragment", std::to_string(p)}});
  metrics_.observe("merge_latency_seconds", sync, {0.001, 0.01, 0.05, 0.1, 0.5, 1, 5});
  metrics_.observe("merge_inputs", static_cast<double>(record.inputs.size()), {1, 2, 3, 4, 6, 8, 12, 16, 32});
  metrics_.observe("learners_missed", static_cast<double>(timing.missed.size()), {0, 1, 2, 4, 8, 16});
  metrics_.observe("quorum_seconds", timing.quorum_seconds, {0.01, 0.1, 0.5, 1, 2, 5, 10, 30});
  metrics_.observe("grace_seconds", timing.grace_seconds, {0.001, 0.01, 0.05, 0.1, 0.5, 1, 5});
  metrics_.add("grace_seconds_total", timing.grace_seconds);
  nlohmann::json inputs = nlohmann::json::array();
  for (const auto& in : record.inputs) {
    metrics_.observe("staleness", static_cast<double>(in.staleness), {0, 1, 2, 4, 8, 16, 32});
    inputs.push_back({{"learner", in.learner_id}, {"seq", in.seq}, {"base", in.base_version}, {"staleness", in.staleness},
                      {"tokens", in.tokens}, {"weight", in.weight}});
  }
  nlohmann::json dropped = nlohmann::json::array();
  for (const auto& d : record.dropped)
    dropped.push_back({{"learner", d.delta.learner_id}, {"seq", d.delta.seq}, {"reason", drop_reason_name(d.reason)}});
  log({{"event", "merge"}, {"fragment", p}, {"version", record.version}, {"inputs", inputs}, {"dropped", dropped},
       {"checkpoint", checkpoint}, {"share", record.share}, {"staleness_scale", record.staleness_scale},
       {"sync_seconds", sync}, {"checksum", record.checksum},
       {"quorum_seconds", timing.quorum_seconds}, {"grace_seconds", timing.grace_seconds},
       {"grace_window", f.merger->granted_grace()}, {"live_learners", live.size()},
       {"missed", timing.missed},
       // Where the merge's time went: the arithmetic (and the finiteness check), encoding and
       // committing the record (and a checkpoint), encoding and publishing the new version.
       {"seconds", {{"merge", seconds_between(t_step, t_commit)}, {"commit", seconds_between(t_commit, t_publish)},
                    {"publish", seconds_between(t_publish, t_done)}}}});
}

// A merge whose result cannot be used: its inputs are recorded as Invalid drops in an
// accounting-only record (the version stays), so they are accounted for and change nothing.
void MergerProcess::abandon_merge(uint32_t p, MergePlan& plan, const std::string& reason) {
  auto& f = book_.owned.at(p);
  std::vector<DroppedDelta> dropped = std::move(plan.dropped);
  for (auto& d : f.merger->merge_abandoned(reason, now())) dropped.push_back(std::move(d));
  MergeRecord record = accounting_record(p, std::move(dropped));
  commit(p, record, false);
  metrics_.add("merges_abandoned_total", 1);
  for (const auto& d : record.dropped) metrics_.add("deltas_dropped_total", 1, {{"reason", drop_reason_name(d.reason)}});
  std::cerr << "merger " << o_.instance_id << ": fragment " << p << ": " << reason << "\n";
  log({{"event", "merge_abandoned"}, {"fragment", p}, {"version", f.state.version}, {"detail", reason},
       {"dropped", record.dropped.size()}});
}

// Encoded when sent and not kept: a snapshot of every owned fragment would cost about 3.4 bytes
// per parameter for as long as it is held. Above codec.segment_bytes of values it travels as
// segments, one ZeroMQ message each (core/codec/messages.h), so no message reaches FlatBuffers'
// 2 GiB and a subscriber decodes each into place.
SnapshotRequests::Message MergerProcess::snapshot_message(uint32_t p) const {
  const auto& f = book_.owned.at(p);
  const FragmentParams header{.run_id = o_.config.run.id, .fingerprint = layout_->fingerprint, .fragment = p,
                              .version = f.state.version, .checksum = f.state.checksum,
                              .merger_instance = o_.instance_id, .epoch = epoch_};
  auto parts = std::make_shared<MessageParts>();
  for_each_fragment_params_segment(header, f.state.params, o_.config.codec.segment_bytes, 1,
                                   [&](uint32_t, uint32_t, std::span<const uint8_t> segment) {
                                     parts->emplace_back(segment.begin(), segment.end());
                                   });
  return parts;
}

void MergerProcess::publish(uint32_t p) {
  const auto message = snapshot_message(p);
  for (const auto& part : *message) {
    publisher_->publish(p, part);
    metrics_.add("params_bytes_published_total", static_cast<double>(part.size()), {{"kind", "snapshot"}});
  }
}

// The change a merge made, for subscribers holding the previous version (the others ask for a
// snapshot). The snapshot of the new version is encoded only when someone asks for it.
void MergerProcess::publish_update(uint32_t p) {
  auto& f = book_.owned.at(p);
  FragmentParams header{.run_id = o_.config.run.id, .fingerprint = layout_->fingerprint, .fragment = p,
                        .version = f.state.version, .checksum = f.state.checksum,
                        .merger_instance = o_.instance_id, .epoch = epoch_, .update = true,
                        .base_version = f.state.version - 1};
  const CodecOptions codec{.dtype = o_.config.codec.downlink_dtype,
                           .block_size = o_.config.codec.downlink_block_size,
                           .topk = o_.config.codec.downlink_topk,
                           .byte_shuffle = o_.config.codec.byte_shuffle,
                           .zstd_level = o_.config.codec.zstd_level};
  const std::vector<uint8_t> message = encode_fragment_update(header, f.change, codec);
  publisher_->publish(p, message);
  metrics_.add("params_bytes_published_total", static_cast<double>(message.size()), {{"kind", "update"}});
}

// Subscribers that missed a version asked for fragments: each gets a snapshot of what it wants, to
// it alone, by the rules of merger/snapshot_requests.h. A subscriber that connects gets nothing
// unasked: it holds the versions it read from the `state` topic and asks for what the heartbeats
// show it lacks.
void MergerProcess::serve_requests() {
  auto r = publisher_->take_requests();
  if (r.count) metrics_.add("snapshot_requests_total", static_cast<double>(r.count));
  if (!r.joined.empty()) metrics_.add("subscribers_joined_total", static_cast<double>(r.joined.size()));
  for (const auto& id : r.joined) snapshots_.joined(id);
  for (const auto& [id, fragments] : r.fragments)
    for (uint32_t p : fragments)
      if (!snapshots_.want(id, p, book_.owned.count(p) > 0)) metrics_.add("snapshot_requests_dropped_total", 1);
  if (snapshots_.pending() == 0) return;
  std::map<uint32_t, uint64_t> versions;
  for (const auto& [p, f] : book_.owned) versions[p] = f.state.version;
  const auto turn = snapshots_.serve(
      Clock::now(), versions, [&] { return publisher_->queued_bytes(); },
      [&](uint32_t p) { return snapshot_message(p); },
      [&](const std::string& id, uint32_t p, const SnapshotRequests::Message& message) {
        publisher_->publish_to(id, p, message);
      });
  if (turn.sent) {
    metrics_.add("params_bytes_published_total", static_cast<double>(turn.bytes), {{"kind", "snapshot_to_one"}});
    metrics_.add("snapshots_published_total", static_cast<double>(turn.sent));
  }
  if (turn.coalesced) metrics_.add("snapshot_requests_coalesced_total", static_cast<double>(turn.coalesced));
  if (turn.deferred) metrics_.add("snapshots_deferred_total", static_cast<double>(turn.deferred));
}

// The quorum of fragment p is in: tell the learners while the grace window is open, so that those
// about to cut p can send it now and reach this merge (ARCHITECTURE.md section 6).
void MergerProcess::announce_round(uint32_t p) {
  auto& f = book_.owned.at(p);
  const double grace = f.merger->granted_grace();
  if (!(grace > 0)) return;
  RoundOpen notice{.run_id = o_.config.run.id, .fingerprint = layout_->fingerprint, .fragment = p,
                   .version = f.state.version, .pending = static_cast<uint32_t>(f.merger->pending_learners()),
                   .grace_ms = static_cast<uint32_t>(std::min(grace * 1e3, 4e9)), .merger_instance = o_.instance_id,
                   .epoch = epoch_, .time_us = unix_us()};
  publisher_->publish_round_open(p, encode_round_open(notice));
  metrics_.add("rounds_announced_total", 1);
}

void MergerProcess::follow_members() {
  // Everything fetched, up to a bound that keeps a turn short (a merge waiting on this loop).
  for (int i = 0; i < 4096; ++i) {
    auto message = members_->poll(0);
    if (!message) break;
    ++members_records_;
    std::optional<Member> member;
    if (!message->tombstone) {
      try {
        member = decode_member(message->value, limits());
      } catch (const Rejection&) {
        metrics_.add("members_rejected_total", 1);
        continue;
      }
    }
    const std::string id = member ? member->instance_id : message->key;
    const auto declared_before = membership_.declared(id);
    if (auto step_time = membership_.observe(message->key, message->timestamp_ms, member))
      grace_.observe_step_time(*step_time);
    // What a learner declares of its inner steps bounds its deltas' tokens: said once, and again
    // when it changes (a restart with another batch size).
    if (auto declared = membership_.declared(id);
        declared && (!declared_before || declared_before->batch != declared->batch ||
                     declared_before->context != declared->context))
      log({{"event", "learner_declared"}, {"learner", id}, {"batch", declared->batch}, {"context", declared->context}});
  }
  if (!members_read_ && members_->at_end()) {
    members_read_ = true;
    log({{"event", "members_read"}, {"records", members_records_},
         {"seconds", std::chrono::duration<double>(Clock::now() - members_since_).count()}});
  }
}

void MergerProcess::announce(bool leaving) {
  Member m{.run_id = o_.config.run.id, .instance_id = o_.instance_id, .role = Role::Merger, .endpoint = advertised_,
           .epoch = epoch_, .time_us = unix_us(), .announce_interval_s = static_cast<float>(o_.announce_interval_s)};
  if (!leaving)
    for (const auto& [p, f] : book_.owned) {
      m.owned_fragments.push_back(p);
      m.fragment_versions.push_back(f.state.version);
      m.fragment_checksums.push_back(f.state.checksum);
    }
  auto bytes = encode_member(m);
  send_plain({.topic = topics_.members(), .partition = 0, .key = o_.instance_id, .value = bytes});
}

// Records outside transactions (`rejected`, `members`) never block the loop: one the local queue
// cannot take, or the broker did not take, is counted and said, at most once a minute per topic
// with the count since. Nothing waits on them: the next heartbeat announces the same again, and a
// refusal stays in this merger's metrics.jsonl.
void MergerProcess::send_plain(const Record& record) {
  if (plain_->try_produce(record, 0) == Producer::Enqueue::QueueFull)
    plain_failed(record.topic, "the producer's local queue is full");
}

void MergerProcess::plain_failed(const std::string& topic, const std::string& why) {
  const std::string kind = topic == topics_.members() ? "members" : topic == topics_.rejected() ? "rejected" : topic;
  metrics_.add("records_lost_total", 1, {{"topic", kind}});
  auto& said = plain_said_[kind];
  ++said.since;
  if (Clock::now() - said.at < std::chrono::minutes(1)) return;
  std::cerr << "merger " << o_.instance_id << ": a record of " << topic << " was lost (" << why << "); "
            << said.since << " since the last report\n";
  log({{"event", "record_lost"}, {"topic", kind}, {"detail", why}, {"count", said.since}});
  said = {Clock::now(), 0};
}

// An accounting-only record of fragment p: the version stays, `dropped` are accounted for.
MergeRecord MergerProcess::accounting_record(uint32_t p, std::vector<DroppedDelta> dropped) const {
  const auto& f = book_.owned.at(p);
  return MergeRecord{.run_id = o_.config.run.id, .fingerprint = layout_->fingerprint, .fragment = p,
                     .version = f.state.version, .prev_version = f.state.version, .dropped = std::move(dropped),
                     .rule = merge_rule(o_.config), .optimizer = outer_optimizer(o_.config),
                     .hyper = outer_hyper(o_.config), .checksum = f.state.checksum,
                     .merger_instance = o_.instance_id, .epoch = epoch_, .merge_time_us = unix_us()};
}

void MergerProcess::stop_fragments(const StopWrites& stop) {
  // A clean stop records what is still held (ProcessState::stop_writes), in accounting-only
  // records, with the offsets that the held deltas allow, in one transaction.
  if (stop.empty()) return;
  std::vector<MergeRecord> records;
  for (const auto& [p, held] : stop.held) records.push_back(accounting_record(p, held));
  std::vector<LogWrite> writes;
  for (const auto& record : records)
    writes.push_back({topics_.merges(), book_.partition_of(record.fragment), std::to_string(record.fragment),
                      encode_merge_record(record)});
  writer_->commit(writes, stop.offsets, *consumer_);
  for (const auto& record : records)
    log({{"event", "stop_record"}, {"fragment", record.fragment}, {"version", record.version}, {"held", record.dropped.size()}});
}

int MergerProcess::run() {
  if (!o_.run_dir.empty()) {
    std::filesystem::create_directories(o_.run_dir);
    log_ = std::make_unique<JsonLines>(o_.run_dir + "/metrics.jsonl");
  }
  endpoint_ = std::make_unique<MetricsEndpoint>(metrics_, o_.metrics_port);
  wait_for_broker(o_.kafka);
  {
    // Authenticated parameters: CURVE with the allow-list of learner keys (core/zmq/curve.h).
    // Every handshake's outcome is counted; a refusal is said (at most one line a second).
    const auto curve = curve_server_options(o_.config.security);
    auto on_decision = [this, said = Clock::time_point{}](const ZapDecision& d) mutable {
      metrics_.add("zap_decisions_total", 1, {{"result", d.allowed ? "allowed" : "refused"}});
      if (d.allowed || Clock::now() - said < std::chrono::seconds(1)) return;
      said = Clock::now();
      std::cerr << "merger " << o_.instance_id << ": refused a subscriber at " << d.address << " (key "
                << d.client_key << "): " << d.reason << "\n";
    };
    publisher_ = std::make_unique<ParamsPublisher>(zmq_, o_.bind, kPublisherHighWaterMark, curve ? &*curve : nullptr, on_decision);
    if (curve)
      std::cerr << "merger " << o_.instance_id << ": parameters authenticated (CURVE), learners allowed by the keys in "
                << curve->allowed_dir.string() << "\n";
  }
  advertised_ = o_.advertise.empty() ? publisher_->bound_endpoint() : o_.advertise;

  KafkaOptions kafka = o_.kafka;
  kafka.client_id = o_.instance_id;
  {
    ConsumerOptions probe_options{.kafka = kafka};
    Consumer probe(probe_options);
    book_.set_partitions(probe.partition_count(topics_.merges(), t_.metadata_ms));
    for (const auto& topic : {topics_.state(), topics_.genesis()}) {
      const int count = probe.partition_count(topic, t_.metadata_ms);
      if (count != book_.partitions())
        throw InvalidInput(topic + " has " + std::to_string(count) + " partitions but " + topics_.merges() + " has " +
                           std::to_string(book_.partitions()) + ": recreate the run's topics (scripts/broker topics)");
    }
  }
  {
    ProducerOptions plain{.kafka = kafka};
    if (faults_.plain_queue > 0) {
      plain.queue_max_messages = faults_.plain_queue;
      plain.linger_ms = 1000;
    }
    // Runs on this thread, inside plain_->poll().
    plain_ = std::make_unique<Producer>(plain, [this](const DeliveryReport& r) {
      if (!r.ok) plain_failed(r.topic, "not delivered: " + r.error);
    });
  }
  writer_kafka_ = kafka;
  make_writer(transaction_timeout());
  {
    ConsumerOptions members_options{.kafka = kafka};
    members_options.kafka.client_id = o_.instance_id + "-members";
    members_ = std::make_unique<Consumer>(members_options);
    // From the recent tail: a live learner has announced itself (batch, context, step time)
    // since, and an older record describes a process that left.
    members_since_ = Clock::now();
    members_->assign({{topics_.members(), 0,
                       members_tail_offset(*members_, topics_, o_.config.merger.members_lookback_seconds,
                                           t_.metadata_ms)}});
  }
  ConsumerOptions group{.kafka = kafka, .group_id = "diloco." + o_.config.run.id + ".mergers",
                        .group_instance_id = o_.static_membership ? o_.instance_id : std::string(),
                        .topics = {topics_.deltas_pattern(), topics_.genesis()},
                        .session_timeout_ms = o_.session_timeout_ms};
  consumer_ = std::make_unique<Consumer>(group, this);
  log({{"event", "start"}, {"endpoint", advertised_}, {"partitions", book_.partitions()},
       {"fragments", o_.config.diloco.fragments}});
  std::cerr << "merger " << o_.instance_id << ": publishing on " << advertised_ << ", joining group "
            << group.group_id << "\n";

  auto last_announce = Clock::now() - std::chrono::hours(1);
  auto last_republish = Clock::now();
  auto last_status = Clock::now();
  double longest_turn = 0;  // seconds, the longest loop turn since the last status tick
  int exit_code = 0;
  try {
    while (!book_.stop_requested()) {
      const auto turn_start = Clock::now();
      if (consume(book_.owned.empty() ? t_.poll_idle_ms : t_.poll_owned_ms)) catch_up();
      follow_members();
      const auto all_live = membership_.live_learners();
      for (auto& [p, f] : book_.owned) {
        // The learners that train p: a learner of some fragments neither holds p's grace window
        // open nor counts in the share of a round a merge of p applies.
        const auto live = membership_.live_learners(p);
        const MergerState before = f.merger->state();
        const bool due = f.merger->poll(now(), live, grace_);
        if (before == MergerState::Collecting && f.merger->state() != MergerState::Collecting)
          announce_round(p);
        if (!due) continue;
        try {
          merge(p, live);
        } catch (const Fenced&) {
          throw;
        } catch (const Error& e) {
          // The transaction did not commit: nothing of this merge is visible. Start over from
          // the logs, the same path as a new owner, and read every held delta again.
          std::cerr << "merger " << o_.instance_id << ": merge of fragment " << p << " failed, recovering: "
                    << e.what() << "\n";
          log({{"event", "merge_failed"}, {"fragment", p}, {"detail", e.what()}});
          writer_->abort();
          book_.request_recovery(true);
          break;
        }
      }
      ensure_recovered();
      // Still needed only when a stop came first: what is held is not the logs' state (a merge
      // that did not commit, or a failed recovery's leftovers), so nothing of it may be announced,
      // served or written on the way out.
      if (!book_.trusted()) break;
      reject_chunks(book_.expire_chunks(now() - t_.chunk_expiry_ms / 1000.0));
      auto t = Clock::now();
      if (t - last_announce > std::chrono::duration<double>(o_.announce_interval_s)) {
        last_announce = t;
        announce(false);
      }
      serve_requests();
      if (o_.config.merger.republish_seconds > 0 &&
          t - last_republish > std::chrono::duration<double>(o_.config.merger.republish_seconds)) {
        last_republish = t;
        for (auto& [p, f] : book_.owned) publish(p);
      }
      if (t - last_status > std::chrono::milliseconds(t_.status_ms)) {
        last_status = t;
        nlohmann::json versions = nlohmann::json::object();
        for (const auto& [p, f] : book_.owned) versions[std::to_string(p)] = f.state.version;
        metrics_.set("live_learners", static_cast<double>(all_live.size()));
        // Consumer lag per owned delta partition (a broker query per partition here once stalled
        // every merge for about 2 s of each status period).
        double lag = 0;
        for (const auto& [tp, next] : book_.next_offsets()) {
          auto l = unread(tp, next);
          if (!l) continue;  // not fetched yet: the next status tick reports it
          metrics_.set("consumer_lag", static_cast<double>(*l),
                       {{"topic", tp.first}, {"partition", std::to_string(tp.second)}});
          lag += static_cast<double>(*l);
        }
        metrics_.set("consumer_lag_total", lag);
        metrics_.set("chunked_deltas_open", static_cast<double>(book_.chunks().open_messages()));
        metrics_.set("chunked_deltas_open_bytes", static_cast<double>(book_.chunks().open_bytes()));
        // A merge that is due waits for the loop: a long turn (recovery aside) delays every merge.
        metrics_.set("loop_turn_max_seconds", longest_turn);
        const KafkaTraffic traffic = kafka_traffic();
        metrics_.set("kafka_bytes_sent", static_cast<double>(traffic.sent));
        metrics_.set("kafka_bytes_received", static_cast<double>(traffic.received));
        log({{"event", "status"}, {"versions", versions}, {"live_learners", all_live.size()},
             {"kafka_sent", traffic.sent}, {"kafka_received", traffic.received},
             {"longest_loop_turn_s", longest_turn},
             {"step_time", grace_.step_time()}, {"sync_time", grace_.sync_time()},
             {"metrics", metrics_.snapshot()}});
        longest_turn = 0;
      }
      plain_->poll(0);
      longest_turn = std::max(longest_turn, std::chrono::duration<double>(Clock::now() - turn_start).count());
    }
    // Drain: deltas already in Kafka when the stop came are read and recorded as pending too,
    // until the partitions stay quiet for drain_quiet_ms (bounded by drain_ms).
    if (book_.trusted()) {
      auto drain_deadline = Clock::now() + std::chrono::milliseconds(t_.drain_ms);
      auto quiet_since = Clock::now();
      while (Clock::now() < drain_deadline &&
             Clock::now() - quiet_since < std::chrono::milliseconds(t_.drain_quiet_ms)) {
        auto message = consumer_->poll(t_.catch_up_poll_ms);
        if (!book_.trusted()) break;  // the group moved partitions: the new owner reads them
        if (message) {
          handle_delta(std::move(*message));
          quiet_since = Clock::now();
        }
      }
    }
    if (const auto writes = book_.stop_writes()) {
      stop_fragments(*writes);
    } else {
      // A merger that cannot trust what it holds (a merge that did not commit, a failed recovery's
      // leftovers, a new assignment not read yet) writes nothing on the way out: no stop record,
      // no offsets. The next owner recovers from the logs and reads every delta held here again.
      std::cerr << "merger " << o_.instance_id
                << ": stopping before its fragments were rebuilt from the logs: it records nothing, and the next "
                   "owner reads the deltas it held again\n";
      log({{"event", "stop_unrecovered"}});
    }
  } catch (const Fenced& e) {
    std::cerr << "merger " << o_.instance_id << ": fenced by a newer instance, stopping without committing: "
              << e.what() << "\n";
    log({{"event", "fenced"}, {"detail", e.what()}});
    exit_code = 4;
  }
  announce(true);
  plain_->flush(t_.flush_ms);
  const KafkaTraffic traffic = kafka_traffic();
  log({{"event", "stop"}, {"exit_code", exit_code}, {"kafka_sent", traffic.sent}, {"kafka_received", traffic.received},
       {"metrics", metrics_.snapshot()},
       {"params_bytes_published", metrics_.value("params_bytes_published_total", {{"kind", "update"}}) +
                                      metrics_.value("params_bytes_published_total", {{"kind", "snapshot"}}) +
                                      metrics_.value("params_bytes_published_total", {{"kind", "snapshot_to_one"}})}});
  return exit_code;
}

MergerFaults MergerFaults::from_environment() {
  const auto read = fault_count_from_environment;
  MergerFaults f{.fail_commit = read("DILOCO_FAULT_FAIL_COMMIT"), .fail_recovery = read("DILOCO_FAULT_FAIL_RECOVERY"),
                 .fail_rewind = read("DILOCO_FAULT_FAIL_REWIND"), .stop_at = read("DILOCO_FAULT_STOP_AT"),
                 .plain_queue = read("DILOCO_FAULT_PLAIN_QUEUE")};
  if (f.fail_commit || f.fail_recovery || f.fail_rewind || f.stop_at || f.plain_queue)
    std::cerr << "diloco-merger: fault injection on (DILOCO_FAULT_FAIL_COMMIT=" << f.fail_commit
              << ", DILOCO_FAULT_FAIL_RECOVERY=" << f.fail_recovery << ", DILOCO_FAULT_FAIL_REWIND=" << f.fail_rewind
              << ", DILOCO_FAULT_STOP_AT=" << f.stop_at << ", DILOCO_FAULT_PLAIN_QUEUE=" << f.plain_queue
              << "): for tests only\n";
  return f;
}

int run_merger(const MergerOptions& options, const std::atomic<bool>& stop) {
  // A secured broker (core/kafka/security.h): every client of the process speaks as its principal.
  MergerOptions secured = options;
  apply_kafka_security(secured.kafka, secured.config.security);
  MergerProcess process(secured, stop);
  return process.run();
}

}  // namespace diloco
