// Reading a run's durable logs: the latest checkpoint of every fragment from the compacted
// `state` topic. Shared by learners (start-up), the merger (recovery) and replay.
#pragma once

#include <chrono>
#include <functional>
#include <map>

#include "core/codec/messages.h"
#include "core/kafka/options.h"
#include "core/kafka/topics.h"

namespace diloco {

struct StateScan {
  std::map<uint32_t, FragmentState> latest;  // fragment -> highest version seen
  std::map<uint32_t, LogPosition> positions;  // where each latest state was read
  uint64_t rejected = 0;                      // records that failed strict decoding
  uint64_t records = 0;                       // records read (pieces of chunked ones count once)
};

// The newest state of every fragment of the layout (`limits.layout`, required) in `state`, read
// once: only a window at the end of each partition (widened until it holds every fragment of the
// partition), not the run's history. Invalid records are counted and skipped, never thrown.
StateScan read_states(const KafkaOptions& kafka, const RunTopics& topics, const DecodeLimits& limits,
                      int timeout_ms = 60000);

// Waits until every fragment of the layout has a state (genesis written by a merger), calling
// `waiting(missing count)` every few seconds while it waits; when that returns false (the process
// was asked to stop) it returns what it has. Throws Unavailable after `timeout`.
StateScan wait_for_states(const KafkaOptions& kafka, const RunTopics& topics, const DecodeLimits& limits,
                          std::chrono::seconds timeout, const std::function<bool(size_t missing)>& waiting);

}  // namespace diloco
