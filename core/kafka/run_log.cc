#include "core/kafka/run_log.h"

#include <algorithm>
#include <chrono>

#include "core/codec/chunk.h"
#include "core/errors.h"
#include "core/kafka/consumer.h"
#include "core/kafka/log_reader.h"
#include "core/kafka/producer.h"

namespace diloco {

CheckpointReader::CheckpointReader(DecodeLimits limits, StateParts parts) : assembler_(std::move(limits), parts) {}

std::optional<CheckpointReader::Checkpoint> CheckpointReader::add(const ConsumedMessage& m) {
  const bool was_pending = assembler_.pending();
  std::optional<FragmentState> state;
  try {
    state = assembler_.add(m.value);
  } catch (const Rejection& e) {
    if (!was_pending && e.reason == RejectReason::ChunkMissing) return std::nullopt;  // a tail begun before the read
    if (!was_pending) throw;
    // The streamed checkpoint begun is cut short (the assembler dropped it): this record may
    // start or be one of its own.
    try {
      state = assembler_.add(m.value);
    } catch (const Rejection& again) {
      if (again.reason == RejectReason::ChunkMissing) return std::nullopt;
      throw;
    }
    return finish(m, std::move(state), false);
  }
  return finish(m, std::move(state), was_pending);
}

std::optional<CheckpointReader::Checkpoint> CheckpointReader::finish(const ConsumedMessage& m,
                                                                     std::optional<FragmentState> state,
                                                                     bool continued) {
  if (!continued) {  // a whole checkpoint, or segment 0 of a streamed one
    first_ = LogPosition{m.topic, m.partition, m.offset};
    records_ = 0;
  }
  records_ += m.pieces;
  if (!state) return std::nullopt;
  return Checkpoint{.state = std::move(*state), .position = first_, .records = records_};
}

NewestCheckpoints::NewestCheckpoints(DecodeLimits limits, std::span<const uint32_t> fragments, bool let_go_early)
    : reader_(std::move(limits)), fragments_(fragments.begin(), fragments.end()) {
  if (!let_go_early) return;
  reader_.on_begin([this](const FragmentState& head) {
    auto it = newest_.find(head.fragment);
    if (it == newest_.end() || head.version < it->second.state.version) return;
    uint64_t& version = let_go_[head.fragment];
    version = std::max(version, it->second.state.version);
    newest_.erase(it);
  });
}

void NewestCheckpoints::add(const ConsumedMessage& m) {
  if (m.tombstone) return;
  try {
    auto read = reader_.add(m);
    if (!read || !fragments_.count(read->state.fragment)) return;
    auto it = newest_.find(read->state.fragment);
    if (it == newest_.end())
      newest_.emplace(read->state.fragment, std::move(*read));
    else if (read->state.version >= it->second.state.version)
      it->second = std::move(*read);
  } catch (const Rejection&) {
    ++rejected_;
  }
}

bool NewestCheckpoints::complete() const {
  for (const auto& [p, version] : let_go_) {
    const auto it = newest_.find(p);
    if (it == newest_.end() || it->second.state.version < version) return false;
  }
  return true;
}

namespace {

// Keeps the highest version of each fragment among the records read.
void scan_record(StateScan& scan, CheckpointReader& reader, const ConsumedMessage& m) {
  ++scan.records;
  if (m.tombstone) return;
  try {
    auto read = reader.add(m);
    if (!read) return;
    auto it = scan.latest.find(read->state.fragment);
    if (it == scan.latest.end() || read->state.version >= it->second.version) {
      scan.positions[read->state.fragment] = read->position;
      scan.latest[read->state.fragment] = std::move(read->state);
    }
  } catch (const Rejection&) {
    ++scan.rejected;
  }
}

}  // namespace

StateScan read_states(const KafkaOptions& kafka, const RunTopics& topics, const DecodeLimits& limits,
                      uint32_t fragments, int timeout_ms, StateParts parts) {
  StateScan scan;
  LogReader reader(kafka);
  // Fragment p's states are in partition p % partitions, and versions only go forward: the last
  // state of each fragment is near its partition's end. Read a window at the end, four times
  // longer each time until it holds every fragment of the partition or starts at the beginning.
  // Reading the whole history instead costs the run's length: on a 715 kbit/s link, a learner
  // joining a run whose merger checkpoints faster than the link carries never finished.
  const int partitions = reader.partition_count(topics.state(), timeout_ms);
  for (int32_t q = 0; q < partitions; ++q) {
    std::vector<uint32_t> expected;
    for (uint32_t p = static_cast<uint32_t>(q); p < fragments; p += static_cast<uint32_t>(partitions))
      expected.push_back(p);
    if (expected.empty()) continue;
    const auto [low, high] = reader.watermarks(topics.state(), q, timeout_ms);
    // Each state is one record and a transaction marker, more if chunked.
    int64_t window = 4 * static_cast<int64_t>(expected.size()) + 8;
    for (;;) {
      const int64_t start = std::max(low, high - window);
      StateScan part;
      CheckpointReader checkpoints(limits, parts);
      reader.read_to_end({{topics.state(), q, start}},
                         [&](const ConsumedMessage& m) { scan_record(part, checkpoints, m); }, timeout_ms, &limits);
      scan.records += part.records;
      scan.rejected += part.rejected;
      const bool all = std::all_of(expected.begin(), expected.end(), [&](uint32_t p) { return part.latest.count(p); });
      if (all || start == low) {
        for (auto& [p, state] : part.latest) {
          scan.positions[p] = part.positions[p];
          scan.latest[p] = std::move(state);
        }
        break;
      }
      window *= 4;
    }
  }
  return scan;
}

int64_t members_tail_offset(Consumer& consumer, const RunTopics& topics, double lookback_s, int timeout_ms) {
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch()).count();
  try {
    if (auto offset = consumer.offset_at_time(topics.members(), 0, now_ms - static_cast<int64_t>(lookback_s * 1000),
                                              timeout_ms))
      return *offset;
    return consumer.watermarks(topics.members(), 0, timeout_ms).second;
  } catch (const Unavailable&) {
    return -2;
  }
}

SentMessage produce_proposal(Producer& producer, const RunTopics& topics, int32_t partitions,
                             const GenesisProposal& proposal, uint64_t segment_bytes, uint64_t chunk_bytes,
                             uint64_t token, int timeout_ms) {
  const uint32_t p = proposal.fragment;
  const ChunkId id{proposal.run_id, proposal.learner_id, p, proposal.seq};
  const int32_t partition = static_cast<int32_t>(p % static_cast<uint32_t>(partitions));
  SentMessage sent;
  for_each_genesis_proposal_segment(
      proposal, segment_bytes, 1, [&](uint32_t, uint32_t count, std::span<const uint8_t> segment) {
        sent.bytes += segment.size();
        sent.segments = count;
        for_each_piece(segment, id, chunk_bytes, [&](uint32_t, uint32_t, std::span<const uint8_t> piece) {
          producer.produce({.topic = topics.genesis(), .partition = partition, .key = std::to_string(p), .value = piece},
                           token, timeout_ms);
        });
      });
  return sent;
}

}  // namespace diloco
