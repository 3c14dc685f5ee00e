// Reading a run's durable logs: the latest checkpoint of every fragment from the compacted
// `state` topic. Shared by learners (start-up), the merger (recovery) and replay. And writing a
// proposal of version 0, the one message learners write there besides deltas.
#pragma once

#include <map>
#include <set>
#include <span>

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
  // FragmentStateAssembler::on_begin: a streamed checkpoint begins (before its values are held).
  void on_begin(std::function<void(const FragmentState& head)> hook) { assembler_.on_begin(std::move(hook)); }

 private:
  std::optional<Checkpoint> finish(const ConsumedMessage& m, std::optional<FragmentState> state, bool continued);

  FragmentStateAssembler assembler_;
  LogPosition first_;
  uint32_t records_ = 0;
};

// The newest checkpoint of each of some fragments, from the `state` records of their partition
// in log order (the topic is compacted by key, but until the cleaner runs older checkpoints are
// still there). With `let_go_early`, when a streamed checkpoint of a fragment begins with a
// version at least the one held, the one held is let go before the new one's values are read, so
// that two checkpoints of a fragment (12 bytes a parameter each) are never held at once; should
// the new one then not complete (cut short, corrupt), complete() is false and the caller reads
// again without it. Records that fail strict decoding are counted and skipped (an older
// checkpoint plus the merge log rebuilds the same).
class NewestCheckpoints {
 public:
  NewestCheckpoints(DecodeLimits limits, std::span<const uint32_t> fragments, bool let_go_early);
  NewestCheckpoints(const NewestCheckpoints&) = delete;  // its reader calls back into it
  NewestCheckpoints& operator=(const NewestCheckpoints&) = delete;
  void add(const ConsumedMessage& m);
  // False when a checkpoint was let go of for a newer one that never completed.
  bool complete() const;
  // The newest checkpoint read of each fragment asked for (absent: none).
  std::map<uint32_t, CheckpointReader::Checkpoint>& newest() { return newest_; }
  uint64_t rejected() const { return rejected_; }

 private:
  CheckpointReader reader_;
  std::set<uint32_t> fragments_;
  std::map<uint32_t, CheckpointReader::Checkpoint> newest_;
  std::map<uint32_t, uint64_t> let_go_;  // fragment -> the newest version let go of
  uint64_t rejected_ = 0;
};

class Consumer;

// Where a process that follows `members` starts reading: the first record stamped at most
// `lookback_s` before now (every live process announced itself since; older records describe
// processes that left), or the partition's end when none is that recent. A run that ages keeps
// every heartbeat until compaction reaches it: reading from the beginning would cost its whole
// history. The beginning (-2) when the broker cannot say.
int64_t members_tail_offset(Consumer& consumer, const RunTopics& topics, double lookback_s, int timeout_ms);

}  // namespace diloco
