#include "tools/replay/run_logs.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/errors.h"
#include "core/fragments/message_budget.h"
#include "core/kafka/run_log.h"
#include "core/kafka/security.h"

namespace diloco {

namespace {

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

// The run's delta topics: the named regions, or every diloco.<run>.deltas.* topic.
std::vector<std::string> find_delta_topics(const RunTopics& topics, const std::vector<std::string>& regions,
                                           const std::map<std::string, int>& existing) {
  std::vector<std::string> out;
  if (!regions.empty()) {
    for (const auto& region : regions) {
      std::string name = topics.deltas(region);
      if (!existing.count(name))
        throw InvalidInput("region " + region + ": no topic " + name + " (leave --regions out to find the run's regions)");
      out.push_back(name);
    }
  } else {
    const std::string prefix = topics.deltas("");
    for (const auto& [name, n] : existing)
      if (name.size() > prefix.size() && name.compare(0, prefix.size(), prefix) == 0) out.push_back(name);
    if (out.empty())
      throw InvalidInput("run " + topics.run_id + " has no delta topics (" + prefix + "<region>): no learner has " +
                         "published yet, or pass --regions A,B");
  }
  std::sort(out.begin(), out.end());
  return out;
}

// apply_logged_merge, with the record's position in every error (most already name it).
void apply_record(const LogContext& ctx, FragmentState& state, const LoggedMerge& merge, const DeltaMessages& deltas) {
  try {
    apply_logged_merge(ctx, state, merge, deltas);
  } catch (const InvalidInput& e) {
    const std::string where = describe(merge.position);
    if (std::string(e.what()).find(where) != std::string::npos) throw;
    throw InvalidInput("merge record at " + where + ": " + e.what());
  }
}

}  // namespace

// ---- the run --------------------------------------------------------------------------------

DecodeLimits ReplayRun::limits() const {
  return run_decode_limits(config, *layout);
}

LogContext ReplayRun::context() const {
  return LogContext{.kafka = kafka, .topics = topics, .config = &config, .layout = layout, .limits = limits(),
                    .timeout_ms = timeout_ms, .pool = pool.get(), .reader = reader};
}

int32_t ReplayRun::partition_of(uint32_t fragment) const {
  return static_cast<int32_t>(fragment % static_cast<uint32_t>(partitions));
}

std::vector<uint32_t> ReplayRun::fragments_of(int32_t partition) const {
  std::vector<uint32_t> out;
  for (uint32_t p = 0; p < layout->num_fragments(); ++p)
    if (partition_of(p) == partition) out.push_back(p);
  return out;
}

ReplayRun open_run(const ReplayOptions& options) {
  std::vector<std::string> overrides = options.overrides;
  if (!options.run_id.empty()) overrides.push_back("run.id=\"" + options.run_id + "\"");
  RunConfig config = load_run_config(options.config_file, overrides);
  RunTopics topics{config.run.id};
  KafkaOptions kafka = options.kafka;
  apply_kafka_security(kafka, config.security);  // a secured broker: read as the config's principal
  wait_for_broker(kafka);
  auto reader = std::make_shared<LogReader>(kafka);
  auto existing = topic_partitions(*reader, options.timeout_ms);
  auto partitions_of = [&](const std::string& topic) {
    auto it = existing.find(topic);
    if (it == existing.end())
      throw InvalidInput("run " + config.run.id + " not found at " + options.kafka.bootstrap_servers + ": no topic " +
                         topic + ". Check --run (or run.id in " + options.config_file.string() +
                         ") and --bootstrap; `scripts/broker status` lists the topics.");
    return it->second;
  };
  const int partitions = partitions_of(topics.merges());
  auto delta_topics = find_delta_topics(topics, options.regions, existing);
  std::vector<std::string> co_partitioned = delta_topics;
  co_partitioned.push_back(topics.state());
  for (const auto& topic : co_partitioned)
    if (partitions_of(topic) != partitions)
      throw InvalidInput(topic + " has " + std::to_string(partitions_of(topic)) + " partitions but " + topics.merges() +
                         " has " + std::to_string(partitions) + ": these are not one run's topics");
  auto layout = read_run_layout(kafka, topics, config, options.timeout_ms);
  if (!layout)
    throw InvalidInput("run " + config.run.id + " has no version 0 yet: " + topics.state() +
                       " holds no checkpoint (no learner's proposal was committed; is a merger running?)");
  return ReplayRun{.config = std::move(config), .layout = std::move(layout), .kafka = kafka,
                   .topics = std::move(topics), .delta_topics = std::move(delta_topics),
                   .partitions = partitions, .timeout_ms = options.timeout_ms,
                   .pool = std::make_shared<WorkPool>(options.threads), .reader = std::move(reader)};
}

Position position_key(const LogPosition& p) { return {p.topic, p.partition, p.offset}; }

// ---- Kafka reads ----------------------------------------------------------------------------

std::map<std::string, int> topic_partitions(LogReader& reader, int timeout_ms) {
  auto topics = reader.list_topics(timeout_ms);
  return {topics.begin(), topics.end()};
}

ConsumedMessage fetch_one(const ReplayRun& run, const LogPosition& position) {
  auto existing = topic_partitions(*run.reader, run.timeout_ms);
  auto topic = existing.find(position.topic);
  if (topic == existing.end())
    throw InvalidInput("no topic " + position.topic + " (the run's delta topics: " + join(run.delta_topics) + ")");
  if (position.partition < 0 || position.partition >= topic->second)
    throw InvalidInput(position.topic + " has partitions 0.." + std::to_string(topic->second - 1) + ", not " +
                       std::to_string(position.partition));
  const DecodeLimits limits = run.limits();
  auto found = run.reader->fetch({{position.topic, position.partition, position.offset}}, run.timeout_ms, &limits);
  if (!found.empty()) return std::move(found.front());
  auto [low, high] = run.reader->watermarks(position.topic, position.partition, run.timeout_ms);
  throw InvalidInput("no committed message at " + describe(position) + " (the partition holds offsets " +
                     std::to_string(low) + ".." + std::to_string(high - 1) + ")");
}

// ---- fragment histories ---------------------------------------------------------------------

std::optional<GenesisProposal> proposal_from_record(const ReplayRun& run, const LoggedMerge& merge) {
  if (!merge.record.genesis) return std::nullopt;
  const DeltaRef& input = merge.record.inputs.front();
  const LogPosition& at = input.position;
  const DecodeLimits limits = run.limits();
  auto found = run.reader->fetch({{at.topic, at.partition, at.offset}}, run.timeout_ms, &limits);
  if (found.empty()) return std::nullopt;  // deleted by retention
  GenesisProposalAssembler assembler(limits);
  assembler.only(input.learner_id, merge.record.fragment, input.seq);
  std::optional<GenesisProposal> proposal = assembler.add(found.front().value, at);
  if (!proposal && assembler.pending()) {
    // A streamed proposal: its other segments follow in the partition, among other messages. The
    // read starts at segment 0's first piece again: the segments of one proposal share its chunk
    // id, so a read from inside segment 0's pieces would take its tail for the next segment's.
    assembler.reset();
    run.reader->read_to_end(
        {{at.topic, at.partition, at.offset}},
        [&](const ConsumedMessage& m) {
          if (!proposal) proposal = assembler.add(m.value, {m.topic, m.partition, m.offset});
        },
        run.timeout_ms, &limits, [](const ChunkProblem&) {});
  }
  if (!proposal)
    throw InvalidInput("the proposal at " + describe(at) + " is not the one the genesis record at " +
                       describe(merge.position) + " names" +
                       (assembler.pending() ? " (its segments end before its last one)" : ""));
  return proposal;
}

std::optional<FragmentState> genesis_from_record(const ReplayRun& run, const LoggedMerge& merge) {
  auto proposal = proposal_from_record(run, merge);
  if (!proposal) return std::nullopt;
  return genesis_state(run.config, run.layout, proposal->fragment, std::move(proposal->tensors));
}

std::map<uint32_t, FragmentLog> read_fragment_logs(const ReplayRun& run, int32_t partition, StartAt start,
                                                   const OnRejected& rejected) {
  const LogContext ctx = run.context();
  std::map<uint32_t, FragmentLog> out;
  for (uint32_t p : run.fragments_of(partition)) out[p];
  CheckpointReader checkpoints(ctx.limits);
  run.reader->read_to_end(
      {{run.topics.state(), partition, -2}},
      [&](const ConsumedMessage& m) {
        if (m.tombstone) return;
        LogPosition position{m.topic, m.partition, m.offset};
        FragmentState s;
        try {
          auto read = checkpoints.add(m);
          if (!read) return;  // a segment of a streamed checkpoint not yet complete
          s = std::move(read->state);
          position = read->position;
        } catch (const Rejection& e) {
          rejected(position, std::string("checkpoint: ") + e.what());
          return;
        }
        auto it = out.find(s.fragment);
        if (it == out.end()) return;  // not in this partition: reported by its own partition's reader
        FragmentLog& f = it->second;
        f.checkpoints.push_back({.version = s.version,
                                 .checksum = s.checksum,
                                 .momentum_checksum = checksum_fp32(s.momentum),
                                 .outer_state_checksum = checksum_fp32(s.outer_state),
                                 .residual_checksum = checksum_fp32(s.downlink_residual),
                                 .position = position});
        f.latest_version = std::max(f.latest_version, s.version);
        const bool eligible = start.earliest || s.version <= start.at_most;
        const bool preferred = !f.start_position ||
                               (start.earliest ? s.version < f.start.version : s.version >= f.start.version);
        if (eligible && preferred) {
          f.start = std::move(s);
          f.start_position = position;
        }
      },
      run.timeout_ms, &ctx.limits);
  for (auto& [p, f] : out)
    if (f.start_position) f.start.layout = run.layout;
  for (auto& merge : read_merges(ctx, partition, -2, rejected)) {
    auto it = out.find(merge.record.fragment);
    if (it == out.end()) continue;
    FragmentLog& f = it->second;
    f.latest_version = std::max(f.latest_version, merge.record.version);
    if (merge.record.genesis && !f.genesis) {
      f.genesis = merge;
      // Version 0 from the proposal itself, when no checkpoint of version 0 is the start (the
      // checkpoint was compacted away, or none is left at or below the version asked for).
      if ((!f.start_position || (start.earliest && f.start.version > 0))) {
        if (auto v0 = genesis_from_record(run, merge)) {
          f.start = std::move(*v0);
          f.start_position.reset();
        }
      }
    }
    // Records up to the start checkpoint's own record are already in it.
    if (f.start.last_merge && merge.position.offset <= f.start.last_merge->offset) continue;
    f.merges.push_back(std::move(merge));
  }
  return out;
}

void replay_records(const ReplayRun& run, FragmentState& state, std::span<const LoggedMerge> merges,
                    uint64_t until, const std::function<void(const FragmentState&, const LoggedMerge&)>& applied) {
  // Records past `until` need no deltas fetched.
  size_t needed = 0;
  while (needed < merges.size() && merges[needed].record.version <= until) ++needed;
  const LogContext ctx = run.context();
  for_each_with_deltas(ctx, merges.first(needed), input_positions,
                       [&](const LoggedMerge& merge, const DeltaMessages& deltas) {
                         if (is_merge(merge.record) && state.version >= until) return false;
                         if (!continues_state(state, merge)) return true;
                         apply_record(ctx, state, merge, deltas);
                         applied(state, merge);
                         return true;
                       });
}

// ---- JSON helpers ---------------------------------------------------------------------------

double l2_norm(std::span<const DenseTensor> tensors) {
  double sum = 0;
  for (const auto& t : tensors)
    for (float v : t.values) sum += static_cast<double>(v) * v;
  return std::sqrt(sum);
}

nlohmann::json tensor_summaries(std::span<const DenseTensor> tensors, std::span<const TensorSpec> layout,
                                int first_values) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& t : tensors) {
    const auto& v = t.values;
    auto [lo, hi] = std::minmax_element(v.begin(), v.end());
    size_t first = std::min(v.size(), static_cast<size_t>(std::max(0, first_values)));
    out.push_back({{"index", t.index},
                   {"name", t.index < layout.size() ? layout[t.index].name : ""},
                   {"shape", t.shape},
                   {"numel", v.size()},
                   {"l2_norm", l2_norm(std::span<const DenseTensor>(&t, 1))},
                   {"min", v.empty() ? 0.0f : *lo},
                   {"max", v.empty() ? 0.0f : *hi},
                   {"first", std::vector<float>(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(first))}});
  }
  return out;
}

nlohmann::json position_json(const LogPosition& p) {
  return {{"topic", p.topic}, {"partition", p.partition}, {"offset", p.offset}};
}

const char* fate_kind_name(DeltaFate::Kind kind) {
  switch (kind) {
    case DeltaFate::Kind::Unaccounted: return "unaccounted";
    case DeltaFate::Kind::Merged: return "merged";
    case DeltaFate::Kind::Dropped: return "dropped";
    case DeltaFate::Kind::Pending: return "pending";
    case DeltaFate::Kind::Rejected: return "rejected";
  }
  return "unknown";
}

nlohmann::json fate_json(const DeltaFate& fate) {
  nlohmann::json out{{"fate", fate_kind_name(fate.kind)}};
  switch (fate.kind) {
    case DeltaFate::Kind::Unaccounted: return out;
    case DeltaFate::Kind::Merged:
      out["version"] = fate.version;
      out["weight"] = fate.weight;
      out["share"] = fate.share;
      out["staleness"] = fate.staleness;
      break;
    case DeltaFate::Kind::Dropped:
    case DeltaFate::Kind::Pending:
      out["reason"] = drop_reason_name(fate.reason);
      out["detail"] = fate.detail;
      out["staleness"] = fate.staleness;
      break;
    case DeltaFate::Kind::Rejected:
      out["reason"] = fate.rejected_reason;
      out["detail"] = fate.detail;
      out["rejected_by"] = fate.rejected_by;
      break;
  }
  out["record"] = position_json(fate.record);
  return out;
}

nlohmann::json rejection_json(const Rejection& rejection) {
  const std::string reason = reject_reason_name(rejection.reason);
  std::string detail = rejection.what();
  if (detail.rfind(reason + ": ", 0) == 0) detail.erase(0, reason.size() + 2);
  return {{"fate", "rejected"}, {"reason", reason}, {"detail", detail}};
}

std::map<Position, DeltaFate> delta_fates(const ReplayRun& run, const std::vector<int32_t>& partitions,
                                          const OnRejected& rejected) {
  const LogContext ctx = run.context();
  std::map<Position, DeltaFate> out;
  run.reader->read_to_end(
      {{ctx.topics.rejected(), 0, -2}},
      [&](const ConsumedMessage& m) {
        try {
          RejectedInput r = decode_rejected(m.value, ctx.limits);
          out[position_key(r.source)] = DeltaFate{.kind = DeltaFate::Kind::Rejected, .rejected_reason = r.reason,
                                                  .rejected_by = r.rejected_by, .detail = r.detail,
                                                  .record = {m.topic, m.partition, m.offset}};
        } catch (const Rejection& e) {
          if (rejected) rejected({m.topic, m.partition, m.offset}, e.what());
        }
      },
      run.timeout_ms);
  for (int32_t partition : partitions)
    for (const auto& [record, position] : read_merges(ctx, partition, -2, rejected)) {
      double total = 0;
      for (const auto& in : record.inputs) total += in.weight;
      for (const auto& in : record.inputs)
        out[position_key(in.position)] = DeltaFate{.kind = DeltaFate::Kind::Merged, .version = record.version,
                                                   .weight = in.weight, .share = total > 0 ? in.weight / total : 0,
                                                   .staleness = in.staleness, .record = position};
      for (const auto& d : record.dropped) {
        const bool pending = d.reason == DropReason::PendingAtStop;
        DeltaFate& fate = out[position_key(d.delta.position)];
        if (pending && fate.kind != DeltaFate::Kind::Unaccounted && fate.kind != DeltaFate::Kind::Pending) continue;
        fate = DeltaFate{.kind = pending ? DeltaFate::Kind::Pending : DeltaFate::Kind::Dropped,
                         .staleness = d.delta.staleness, .reason = d.reason, .detail = d.detail, .record = position};
      }
    }
  return out;
}

}  // namespace diloco
