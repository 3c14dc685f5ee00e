#include "core/kafka/run_log.h"

#include <algorithm>
#include <chrono>

#include "core/errors.h"
#include "core/kafka/consumer.h"
#include "core/kafka/log_reader.h"

namespace diloco {

namespace {

// Keeps the highest version of each fragment among the records read.
void scan_record(StateScan& scan, const ConsumedMessage& m, const DecodeLimits& limits, StateParts parts) {
  ++scan.records;
  if (m.tombstone) return;
  try {
    FragmentState state = decode_fragment_state(m.value, limits, parts);
    auto it = scan.latest.find(state.fragment);
    if (it == scan.latest.end() || state.version >= it->second.version) {
      scan.positions[state.fragment] = LogPosition{m.topic, m.partition, m.offset};
      scan.latest[state.fragment] = std::move(state);
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
      reader.read_to_end({{topics.state(), q, start}},
                         [&](const ConsumedMessage& m) { scan_record(part, m, limits, parts); }, timeout_ms, &limits);
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

}  // namespace diloco
