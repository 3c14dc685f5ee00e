// Reading a run's durable logs: the latest checkpoint of every fragment from the compacted
// `state` topic. Shared by learners (start-up), the merger (recovery) and replay.
#pragma once

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

// The newest state of each of fragments 0 .. fragments-1 in `state`, read once: only a window at
// the end of each partition (widened until it holds every fragment of the partition), not the
// run's history. Decoded with `limits`; with limits.layout null every state of the run is taken
// whatever its fingerprint (each carries its layout), so that a learner can tell how its model
// differs from the run's. Invalid records are counted and skipped, never thrown. `parts`: what
// each state keeps (decode_fragment_state); a learner takes the parameters only.
StateScan read_states(const KafkaOptions& kafka, const RunTopics& topics, const DecodeLimits& limits,
                      uint32_t fragments, int timeout_ms = 60000, StateParts parts = StateParts::All);

class Consumer;

// Where a process that follows `members` starts reading: the first record stamped at most
// `lookback_s` before now (every live process announced itself since; older records describe
// processes that left), or the partition's end when none is that recent. A run that ages keeps
// every heartbeat until compaction reaches it: reading from the beginning would cost its whole
// history. The beginning (-2) when the broker cannot say.
int64_t members_tail_offset(Consumer& consumer, const RunTopics& topics, double lookback_s, int timeout_ms);

}  // namespace diloco
