#include "merger/recovery.h"

#include <algorithm>
#include <optional>

#include "core/fragments/message_budget.h"
#include "core/fragments/partition.h"
#include "core/kafka/run_log.h"


namespace diloco {

MergeRule merge_rule(const RunConfig& config) {
  return config.merger.rule == "avg" ? MergeRule::WeightedAverage : MergeRule::RadialDirectional;
}

OuterOptimizerKind outer_optimizer(const RunConfig& config) {
  const auto kind = parse_outer_optimizer(config.merger.optimizer);
  if (!kind)
    throw InvalidInput("merger.optimizer must be one of " + outer_optimizer_names() + ", not \"" +
                       config.merger.optimizer + "\"");
  return *kind;
}

OuterHyper outer_hyper(const RunConfig& config) {
  const auto& m = config.merger;
  return OuterHyper{.lr = static_cast<float>(m.outer_lr),
                    .momentum = static_cast<float>(m.outer_momentum),
                    .staleness_alpha = static_cast<float>(m.staleness_alpha),
                    .max_staleness = m.max_staleness < 0 ? std::numeric_limits<uint32_t>::max()
                                                         : static_cast<uint32_t>(m.max_staleness),
                    .quorum = m.quorum,
                    .dn_period = m.dn_period,
                    .dn_activation = static_cast<float>(m.dn_activation),
                    .cgad_decay = static_cast<float>(m.cgad_decay),
                    .cgad_cutoff = m.cgad_cutoff,
                    .adam_beta2 = static_cast<float>(m.adam_beta2),
                    .adam_epsilon = static_cast<float>(m.adam_epsilon)};
}

MomentumSchedule momentum_schedule(const RunConfig& config) {
  const auto& m = config.merger;
  return {.momentum = static_cast<float>(m.outer_momentum), .warmup = m.momentum_warmup,
          .decay_from = m.momentum_decay_from, .decay_to = m.momentum_decay_to,
          .final_momentum = static_cast<float>(m.momentum_final)};
}

DownlinkCodec downlink_codec(const RunConfig& config) {
  const DType dtype = config.codec.downlink_dtype;
  const bool blocks = dtype == DType::INT8 || dtype == DType::INT4;
  return {.dtype = dtype, .block_size = blocks ? config.codec.downlink_block_size : 0,
          .topk = blocks ? config.codec.downlink_topk : 0};
}

void account(FragmentState& state, const MergeRecord& record) {
  auto raise = [](std::map<std::string, uint64_t>& by_learner, const std::string& learner, uint64_t value) {
    auto& v = by_learner[learner];
    v = std::max(v, value);
  };
  if (record.genesis) {
    for (const auto& in : record.inputs) state.recent.insert(in.position);
    return;
  }
  for (const auto& in : record.inputs) {
    state.recent.insert(in.position);
    raise(state.accounted, in.learner_id, in.seq);
    raise(state.merged_bases, in.learner_id, in.base_version);
  }
  for (const auto& d : record.dropped) {
    if (d.reason == DropReason::PendingAtStop) continue;
    state.recent.insert(d.delta.position);
    if (d.reason != DropReason::Invalid) raise(state.accounted, d.delta.learner_id, d.delta.seq);
  }
}

void prune_recent(FragmentState& state, std::span<const TopicPartitionOffset> committed) {
  for (auto it = state.recent.begin(); it != state.recent.end();) {
    auto c = std::find_if(committed.begin(), committed.end(), [&](const TopicPartitionOffset& tp) {
      return tp.topic == it->topic && tp.partition == it->partition;
    });
    if (c != committed.end() && it->offset < c->offset)
      it = state.recent.erase(it);
    else
      ++it;
  }
}

DeltaMessages index_by_position(const std::vector<ConsumedMessage>& messages) {
  DeltaMessages by_position;
  for (const auto& m : messages) by_position[{m.topic, m.partition, m.offset}] = &m;
  return by_position;
}

FragmentState genesis_state(const RunConfig& config, std::shared_ptr<const FragmentLayout> layout, uint32_t p,
                            std::vector<DenseTensor> params) {
  FragmentState state;
  state.run_id = config.run.id;
  state.fingerprint = layout->fingerprint;
  state.fragment = p;
  state.version = 0;
  state.params = std::move(params);
  state.momentum = state.params;
  for (auto& t : state.momentum) std::fill(t.values.begin(), t.values.end(), 0.0f);
  if (has_outer_state(outer_optimizer(config))) state.outer_state = state.momentum;
  state.checksum = checksum_fp32(state.params);
  state.layout = std::move(layout);
  return state;
}

std::shared_ptr<const FragmentLayout> read_run_layout(const KafkaOptions& kafka, const RunTopics& topics,
                                                      const RunConfig& config, int timeout_ms) {
  DecodeLimits any{.run_id = config.run.id, .max_message_bytes = kMaxLogicalMessageBytes,
                   .max_decompressed_bytes = kMaxLogicalMessageBytes};
  // The parameters alone: the momentum and residual of every checkpoint (8 bytes a parameter
  // more, twice while a newer checkpoint of a fragment is read) would be decoded for nothing.
  StateScan scan = read_states(kafka, topics, any, config.diloco.fragments, timeout_ms, StateParts::ParamsOnly);
  std::shared_ptr<const FragmentLayout> out;
  for (const auto& [p, state] : scan.latest) {
    if (!out) out = state.layout;
    if (state.fingerprint != out->fingerprint)
      throw InvalidInput(detail::concat(topics.state(), " holds checkpoints of two models (fragment ", p, ": ",
                                        describe_difference(out->tensors, state.layout->tensors),
                                        "): the run's logs are mixed; start a new run (another run.id)"));
  }
  return out;
}

Delta logged_delta(const LogContext& ctx, const DeltaMessages& messages, const DeltaRef& ref,
                   const LogPosition& named_by) {
  auto it = messages.find({ref.position.topic, ref.position.partition, ref.position.offset});
  if (it == messages.end())
    throw InvalidInput("delta " + describe(ref.position) + " named by the merge record at " +
                       describe(named_by) + " is missing from the log (deleted by retention?)");
  Delta d = decode_delta(it->second->value, ctx.limits, DeltaValues::AsSent);
  if (d.header.learner_id != ref.learner_id || d.header.seq != ref.seq)
    throw InvalidInput("delta " + describe(ref.position) + " is not the one the merge record at " +
                       describe(named_by) + " names (learner " + d.header.learner_id + " seq " +
                       std::to_string(d.header.seq) + ")");
  return d;
}

LogContext with_reader(const LogContext& ctx) {
  LogContext out = ctx;
  if (!out.reader) out.reader = std::make_shared<LogReader>(ctx.kafka);
  return out;
}

std::vector<LogPosition> input_positions(const MergeRecord& record) {
  std::vector<LogPosition> out;
  if (!is_merge(record)) return out;  // nothing to fetch for a record that merges nothing
  for (const auto& in : record.inputs) out.push_back(in.position);
  return out;
}

void for_each_with_deltas(const LogContext& context, std::span<const LoggedMerge> merges, const NamedDeltas& named,
                          const std::function<bool(const LoggedMerge&, const DeltaMessages&)>& visit) {
  const LogContext ctx = with_reader(context);
  size_t window = kFirstWindowDeltas;
  uint64_t largest = 0;  // bytes of the largest delta fetched so far
  for (size_t begin = 0; begin < merges.size();) {
    std::vector<TopicPartitionOffset> wanted;
    size_t end = begin;
    while (end < merges.size() && (end == begin || wanted.size() < window)) {
      for (const auto& p : named(merges[end].record)) wanted.push_back({p.topic, p.partition, p.offset});
      ++end;
    }
    const auto messages = ctx.reader->fetch(wanted, ctx.timeout_ms, &ctx.limits);
    for (const auto& m : messages) largest = std::max<uint64_t>(largest, m.value.size());
    window = std::clamp<uint64_t>(ctx.window_bytes / std::max<uint64_t>(largest, 1), 1, kMaxWindowDeltas);
    const DeltaMessages index = index_by_position(messages);
    for (size_t i = begin; i < end; ++i)
      if (!visit(merges[i], index)) return;
    begin = end;
  }
}

void apply_logged_merge(const LogContext& ctx, FragmentState& state, const LoggedMerge& merge) {
  for_each_with_deltas(ctx, std::span<const LoggedMerge>(&merge, 1), input_positions,
                       [&](const LoggedMerge& m, const DeltaMessages& messages) {
                         apply_logged_merge(ctx, state, m, messages);
                         return true;
                       });
}

void apply_logged_merge(const LogContext& ctx, FragmentState& state, const LoggedMerge& merge,
                        const DeltaMessages& messages) {
  const MergeRecord& r = merge.record;
  if (r.prev_version != state.version)
    throw InvalidInput("merge record at " + describe(merge.position) + " continues version " +
                       std::to_string(r.prev_version) + " but fragment " + std::to_string(state.fragment) +
                       " is at version " + std::to_string(state.version));
  if (!is_merge(r)) {
    account(state, r);
    return;
  }
  std::vector<Delta> deltas;
  deltas.reserve(r.inputs.size());
  for (const auto& in : r.inputs) deltas.push_back(logged_delta(ctx, messages, in, merge.position));
  std::vector<MergeInput> inputs;
  for (size_t i = 0; i < r.inputs.size(); ++i) inputs.push_back(MergeInput{r.inputs[i], deltas[i]});
  MergeOptions options = recorded_merge_options(r, ctx.layout->fragments.at(state.fragment));
  options.pool = ctx.pool;
  // In place, as the merger merges: a second copy of the fragment's state would double what a
  // rebuild holds (12 bytes per parameter more). Inputs that do not fit throw before anything is
  // written; a checksum that differs throws after (the caller drops the state).
  const uint32_t fragment = state.fragment;
  MergeRecord rebuilt = merge_step_in_place(state, inputs, options);
  if (rebuilt.checksum != r.checksum)
    throw InvalidInput("rebuilding version " + std::to_string(r.version) + " of fragment " +
                       std::to_string(fragment) + " from the merge record at " + describe(merge.position) +
                       " gives checksum " + std::to_string(rebuilt.checksum) + ", the record says " +
                       std::to_string(r.checksum) + ": the logs are inconsistent (diloco-replay verify shows where)");
  account(state, r);
  state.last_merge = merge.position;
}

std::vector<LoggedMerge> read_merges(const LogContext& ctx, int32_t partition, int64_t from_offset,
                                     const std::function<void(const LogPosition&, const std::string&)>& rejected) {
  std::vector<LoggedMerge> out;
  with_reader(ctx).reader->read_to_end(
      {{ctx.topics.merges(), partition, from_offset}},
      [&](const ConsumedMessage& m) {
        LogPosition position{m.topic, m.partition, m.offset};
        try {
          out.push_back(LoggedMerge{decode_merge_record(m.value, ctx.limits), position});
        } catch (const Rejection& e) {
          if (rejected) rejected(position, e.what());
        }
      },
      ctx.timeout_ms);
  return out;
}

bool continues_state(const FragmentState& state, const LoggedMerge& merge) {
  // Records at or before the checkpoint are already in it.
  if (state.last_merge && merge.position.offset <= state.last_merge->offset) return false;
  if (merge.record.prev_version == state.version) return true;
  if (merge.record.version <= state.version) return false;  // older than the checkpoint
  throw InvalidInput("fragment " + std::to_string(state.fragment) + ": merge record at " +
                     describe(merge.position) + " continues version " + std::to_string(merge.record.prev_version) +
                     " but the log reached only version " + std::to_string(state.version));
}

std::map<uint32_t, RecoveredFragment> recover_partition(const LogContext& context, int32_t partition,
                                                        std::span<const uint32_t> fragments) {
  const LogContext ctx = with_reader(context);  // one reader for every read below
  std::map<uint32_t, RecoveredFragment> out;
  for (uint32_t p : fragments) out[p];
  // Read only settled logs: reading around an open transaction would miss a merge that is
  // about to become visible, and the next merge would then continue an old version.
  auto unstable = ctx.reader->wait_until_stable({{ctx.topics.state(), partition, 0}, {ctx.topics.merges(), partition, 0}},
                                    ctx.stable_wait_ms);
  if (!unstable.empty()) {
    const auto& u = unstable.front();
    throw Unavailable(u.topic + "[" + std::to_string(u.partition) + "] still has a transaction open at offset " +
                      std::to_string(u.stable) + " (log end " + std::to_string(u.high) + ") after " +
                      std::to_string(ctx.stable_wait_ms) + " ms: another merger is writing this partition, " +
                      "or the broker has not yet aborted a killed merger's transaction");
  }
  // Newest checkpoint of each fragment, never two of one fragment held at once; read again
  // keeping the older ones in the rare case that a newer one begun did not complete.
  std::optional<NewestCheckpoints> checkpoints;
  for (const bool let_go_early : {true, false}) {
    checkpoints.emplace(ctx.limits, fragments, let_go_early);
    ctx.reader->read_to_end({{ctx.topics.state(), partition, -2}},
                            [&](const ConsumedMessage& m) { checkpoints->add(m); }, ctx.timeout_ms, &ctx.limits);
    if (checkpoints->complete()) break;
  }
  for (auto& [p, read] : checkpoints->newest()) {
    out[p].state = std::move(read.state);
    out[p].state_pieces = read.records;
  }
  for (auto& [p, f] : out) {
    if (f.state.run_id.empty())
      f.awaiting_genesis = true;
    else
      f.state.layout = ctx.layout;
  }
  int64_t from = -1;
  for (auto& [p, f] : out) {
    if (f.awaiting_genesis) continue;
    int64_t start = f.state.last_merge ? f.state.last_merge->offset + 1 : 0;
    from = from < 0 ? start : std::min(from, start);
  }
  if (out.empty()) return out;
  // The records of these fragments after their checkpoints, replayed with their deltas fetched a
  // window at a time.
  // Records certainly in a checkpoint already (at or before its record, or merges older than its
  // version) are left out, so their deltas are not fetched.
  std::vector<LoggedMerge> records;
  for (auto& merge : read_merges(ctx, partition, from < 0 ? -2 : from)) {
    auto it = out.find(merge.record.fragment);
    if (it == out.end()) continue;
    // Version 0 is committed with its checkpoint in one transaction: records without one are
    // not this run's (or the state topic lost them).
    if (it->second.awaiting_genesis)
      throw InvalidInput(detail::concat("fragment ", merge.record.fragment, " has a merge record at ",
                                        describe(merge.position), " but no checkpoint in ", ctx.topics.state()));
    const FragmentState& s = it->second.state;
    if (s.last_merge && merge.position.offset <= s.last_merge->offset) continue;
    if (is_merge(merge.record) && merge.record.version < s.version) continue;
    records.push_back(std::move(merge));
  }
  for_each_with_deltas(ctx, records, input_positions, [&](const LoggedMerge& merge, const DeltaMessages& deltas) {
    auto& f = out.at(merge.record.fragment);
    // A checkpoint names a record at or before the one that produced it (the merger encodes it
    // before that record's offset is known); from here on, last_merge is that record itself.
    if (f.replayed.empty() && is_merge(merge.record) && merge.record.version == f.state.version &&
        (!f.state.last_merge || merge.position.offset > f.state.last_merge->offset))
      f.state.last_merge = merge.position;
    if (!continues_state(f.state, merge)) return true;
    apply_logged_merge(ctx, f.state, merge, deltas);
    f.replayed.push_back(merge.record);
    return true;
  });
  return out;
}

}  // namespace diloco
