// Reading a run's durable logs: the latest checkpoint of every fragment from the compacted
// `state` topic. Shared by learners (start-up), the merger (recovery) and replay. And writing a
// proposal of version 0, the one message learners write there besides deltas.
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

struct ConsumedMessage;
class Producer;

// What a sent message took on the wire: its bytes (every segment's) and its segments.
struct SentMessage {
  uint64_t bytes = 0;
  uint32_t segments = 0;
};

// Sends a proposal of version 0 to the `genesis` topic, in the fragment's partition (fragment
// mod `partitions`, key the fragment): in segments of at most segment_bytes of values, each
// encoded when the one before is in the producer's queue, each in pieces of chunk_bytes
// (ChunkId: run, learner, fragment, seq), every piece with `token`. Waits up to timeout_ms for
// queue space (Producer::produce); the caller flushes.
SentMessage produce_proposal(Producer& producer, const RunTopics& topics, int32_t partitions,
                             const GenesisProposal& proposal, uint64_t segment_bytes, uint64_t chunk_bytes,
                             uint64_t token, int timeout_ms);

// Checkpoints from the `state` topic's records in log order (chunks already put back together),
// whole or streamed (core/codec/messages.h FragmentStateAssembler): the checkpoint a record
// completes, with the position of its first record and the records it took.
class CheckpointReader {
 public:
  explicit CheckpointReader(DecodeLimits limits, StateParts parts = StateParts::All);
  struct Checkpoint {
    FragmentState state;
    LogPosition position;   // of its first record (a whole checkpoint's, or segment 0's)
    uint32_t records = 0;   // the records it went out in (every piece of every segment)
  };
  // Throws Rejection for a record that fails strict decoding. A segment whose checkpoint began
  // before the first record read (a read from the middle of the log) is skipped (nullopt); a
  // streamed checkpoint cut short by a record that starts another is given up for the newer one.
  std::optional<Checkpoint> add(const ConsumedMessage& m);

 private:
  std::optional<Checkpoint> finish(const ConsumedMessage& m, std::optional<FragmentState> state, bool continued);

  FragmentStateAssembler assembler_;
  LogPosition first_;
  uint32_t records_ = 0;
};

class Consumer;

// Where a process that follows `members` starts reading: the first record stamped at most
// `lookback_s` before now (every live process announced itself since; older records describe
// processes that left), or the partition's end when none is that recent. A run that ages keeps
// every heartbeat until compaction reaches it: reading from the beginning would cost its whole
// history. The beginning (-2) when the broker cannot say.
int64_t members_tail_offset(Consumer& consumer, const RunTopics& topics, double lookback_s, int timeout_ms);

}  // namespace diloco
