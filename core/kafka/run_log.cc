#include "core/kafka/run_log.h"

#include <thread>

#include "core/kafka/consumer.h"
#include "core/kafka/log_reader.h"

namespace diloco {

StateScan read_states(const KafkaOptions& kafka, const RunTopics& topics, const DecodeLimits& limits,
                      int timeout_ms) {
  StateScan scan;
  read_to_end(
      kafka, {topics.state()},
      [&](const ConsumedMessage& m) {
        if (m.tombstone) return;
        try {
          FragmentState state = decode_fragment_state(m.value, limits);
          auto it = scan.latest.find(state.fragment);
          if (it == scan.latest.end() || state.version >= it->second.version) {
            scan.positions[state.fragment] = LogPosition{m.topic, m.partition, m.offset};
            scan.latest[state.fragment] = std::move(state);
          }
        } catch (const Rejection&) {
          ++scan.rejected;
        }
      },
      timeout_ms, &limits);
  return scan;
}

StateScan wait_for_states(const KafkaOptions& kafka, const RunTopics& topics, const DecodeLimits& limits,
                          std::chrono::seconds timeout, const std::function<bool(size_t missing)>& waiting) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  size_t expected = limits.layout ? limits.layout->num_fragments() : 0;
  for (;;) {
    StateScan scan = read_states(kafka, topics, limits);
    if (scan.latest.size() >= expected) return scan;
    if (std::chrono::steady_clock::now() > deadline)
      throw Unavailable("no state for " + std::to_string(expected - scan.latest.size()) + " of " +
                        std::to_string(expected) + " fragments in " + topics.state() + " after " +
                        std::to_string(timeout.count()) + " s: start a merger (it writes version 0 of every fragment)");
    if (waiting && !waiting(expected - scan.latest.size())) return scan;
    std::this_thread::sleep_for(std::chrono::seconds(2));
  }
}

}  // namespace diloco
