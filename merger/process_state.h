// The merger process's bookkeeping (merger/merger_process_impl.h) without its I/O: which fragments
// it owns, what it consumed and may commit, whether what it holds is the logs' state, and what a
// stop writes. Every transition is a plain method: no Kafka, no ZeroMQ, no clock (times are
// passed in), so the stop and failure paths can be driven directly, without timing a signal.
//
// The rule it holds: what is held is trusted only from a successful recovery to the next request
// for one (a new assignment, a merge or a version 0 that did not commit, a result that is not
// finite, a write Kafka refused). Untrusted state may hold a version the log never reached, or
// have lost the deltas a failed recovery dropped while their offsets stayed consumed: it is not
// announced, served or written. A stop then writes nothing at all (no record, no offsets), and
// the merger restarted under the same id, or the next owner, recovers from the logs and reads
// every delta held here again, as no committed offset passed them.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/codec/messages.h"
#include "core/kafka/chunk_assembler.h"
#include "core/kafka/consumer.h"
#include "core/kafka/options.h"
#include "merger/fragment_merger.h"

namespace diloco {

struct OwnedFragment {
  FragmentState state;    // the committed version (a merge writes the next one over it)
  std::unique_ptr<FragmentMerger> merger;
  std::vector<QuantizedTensor> change;  // merge_step's quantized change (quantized downlink)
};

// Who takes a decoded delta of a fragment, read in a partition of the delta topics.
enum class DeltaOwner : uint8_t {
  Owned,            // an owned fragment, in its own partition: offered to its FragmentMerger
  AwaitingGenesis,  // owned, but no learner's proposal of version 0 was committed: no_genesis
  WrongPartition,   // another partition's fragment, or one another merger owns: wrong_partition
  // A recovery is needed: the owned fragments are not the logs' (one may be missing, or hold a
  // version the log never reached), so the delta is neither refused nor offered: it is not
  // consumed, and is read again once the fragments are rebuilt.
  Unrecovered,
};

// What a clean stop writes, in one transaction.
struct StopWrites {
  // Per fragment holding deltas that no committed record accounts for: those deltas, for an
  // accounting-only record (pending ones as PendingAtStop, for a later owner to merge, and drops
  // not yet in a record). Fragments that hold none are absent.
  std::map<uint32_t, std::vector<DroppedDelta>> held;
  // The consumed offsets, each held back to its partition's first pending delta (the next owner
  // reads it again; a drop is accounted for by the record written with them).
  std::vector<TopicPartitionOffset> offsets;
  bool empty() const { return held.empty() && offsets.empty(); }
};

class ProcessState {
 public:
  // `stop`: set by a signal (or a test) to end the loop; `fragments`: the run's fragment count;
  // `limits`: what a chunked delta's pieces must be (tightened by set_limits once the run's
  // layout is known).
  ProcessState(const std::atomic<bool>& stop, uint32_t fragments, DecodeLimits limits);

  // The owned fragments, written in place by merges and recovery, and those owned that have no
  // version 0 yet.
  std::map<uint32_t, OwnedFragment> owned;
  std::set<uint32_t> awaiting_genesis;

  // --- Ownership -----------------------------------------------------------------------------
  // The delta topics' partition count (NP): fragment p is in partition p % NP.
  void set_partitions(int partitions) { partitions_ = partitions; }
  int partitions() const { return partitions_; }
  int32_t partition_of(uint32_t fragment) const {
    return static_cast<int32_t>(fragment % static_cast<uint32_t>(partitions_));
  }
  std::vector<uint32_t> fragments_of(int32_t partition) const;
  const std::set<int32_t>& assigned() const { return assigned_; }
  // The group gave this merger `partitions` (inside the consumer's poll). Nothing held belongs to
  // the new assignment, and the consumer starts at the group's committed offsets: a recovery is
  // needed, with no rewind.
  void assign(std::set<int32_t> partitions);
  // The group took the partitions away. Held deltas are not recorded: their offsets were not
  // committed, so the next owner reads them.
  void revoke();
  // Who takes a decoded delta of `fragment` read in `partition` (the rules of DeltaOwner, in its
  // order: a fragment awaiting its version 0 is said so whatever the partition).
  DeltaOwner owner_of(uint32_t fragment, int32_t partition) const;
  // Whether the delta at `at` is one a committed record of an owned fragment accounts for (read
  // again after a restart, a rebalance or a rewind): known by its position, before decoding.
  bool accounted(const LogPosition& at) const;

  // --- Recovery ------------------------------------------------------------------------------
  // A failure (or a write Kafka refused) asks for the owned fragments to be rebuilt from the logs
  // before another delta is handled; `rewind`: the consumer must also go back to the committed
  // offsets, so that every delta held in memory is read again.
  void request_recovery(bool rewind);
  bool recovery_needed() const { return recover_needed_; }
  bool rewind_needed() const { return rewind_needed_; }
  // Whether the loop rebuilds now: needed, and no stop requested (a stop leaves the state
  // untrusted, and the merger writes nothing on its way out).
  bool recovery_due() const { return recover_needed_ && !stop_; }
  // A recovery starts: what is held is dropped before the logs are read. Returns its number in
  // this process (1 for the first), which fault injection counts.
  int begin_recovery();
  // A failed recovery keeps nothing of what it read; it is still needed.
  void recovery_failed();
  // The rewind to the committed offsets starts (the consumer moves). Returns its number.
  int begin_rewind();
  // The consumer was rewound: what was consumed will be read again.
  void rewound();
  // The owned fragments are the logs' state again.
  void recovered() { recover_needed_ = false; }
  // Whether what is held is the logs' state: only then is it announced, served, drained into or
  // written at a stop.
  bool trusted() const { return !recover_needed_; }
  int recoveries() const { return recoveries_; }
  int rewinds() const { return rewinds_; }

  // --- Consumed deltas -----------------------------------------------------------------------
  // Whether a delta polled before the recovery that just ran (`rewound`: it rewound the
  // consumer) may be handled now: not while a recovery is still needed (a stop came first), and
  // not after a rewind (the consumer reads it again).
  bool handles_polled(bool rewound) const { return trusted() && !rewound; }
  // A record polled from the delta topics is consumed: its partition's next offset passes it, and
  // a piece of a chunked delta joins its message. Returns what the assembler makes of it (a whole
  // message, if this completes one or is no piece, and problems to reject). Nothing while a
  // recovery is needed: the record is not consumed (handles_polled said no).
  std::optional<ChunkAssembler::Result> consume(ConsumedMessage record, double now);
  // Chunked deltas with no new piece since `before` are given up (their first pieces no longer
  // hold the offsets back), and new bounds for pieces that arrive from now on.
  std::vector<ChunkProblem> expire_chunks(double before) { return chunks_.expire(before); }
  void set_limits(DecodeLimits limits);
  // A proposal of version 0 that consume() handed on from the genesis topic: a whole one, or a
  // segment of a streamed one (nullopt until its last segment; the proposals begun hold the
  // offsets back to their segment 0). Read against the layout it carries. Throws Rejection
  // (GenesisProposalAssembler::add).
  std::optional<GenesisProposal> read_proposal(const ConsumedMessage& message);
  // Where the proposal read_proposal() last returned began: the position its genesis record names.
  const LogPosition& proposal_head() const { return proposals_.head(); }
  // Where the streamed proposal that read_proposal()'s last rejection dropped began, if it had.
  const std::optional<LogPosition>& dropped_proposal_head() const { return proposals_.dropped_head(); }
  const ChunkAssembler& chunks() const { return chunks_; }
  // The next offset of each consumed partition.
  const std::map<std::pair<std::string, int32_t>, int64_t>& next_offsets() const { return next_offset_; }

  // --- Offsets -------------------------------------------------------------------------------
  // The offsets a merge commits: held back to every delta an owned fragment still holds (pending,
  // or dropped but not yet in a committed record; the merge's own inputs, taken, are in it).
  std::vector<TopicPartitionOffset> offsets_to_commit() const;
  // The consumed offsets of the assigned partitions, each held back to the lowest of `held` in
  // its partition, to an incomplete chunked delta's first piece and a streamed proposal's segment
  // 0, and out of every completed chunked delta (a restart would read only its tail).
  std::vector<TopicPartitionOffset> offsets_holding(const std::vector<LogPosition>& held) const;
  // `offsets` were committed: chunked deltas wholly below them can no longer hold them back.
  void committed(const std::vector<TopicPartitionOffset>& offsets);

  // --- Stop ----------------------------------------------------------------------------------
  bool stop_requested() const { return stop_; }
  // The writes of the way out. A trusted state stops every owned fragment's merger and records
  // what they held (StopWrites). An untrusted one writes nothing (nullopt): not even offsets, as
  // deltas that a failed recovery dropped, or that a merge that did not commit took, would be
  // passed by them and never read again.
  std::optional<StopWrites> stop_writes();

 private:
  void forget_consumed();  // the consumer moved: what was read is read again

  const std::atomic<bool>& stop_;
  const uint32_t fragments_;
  int partitions_ = 1;
  std::set<int32_t> assigned_;
  std::map<std::pair<std::string, int32_t>, int64_t> next_offset_;  // consumed delta partitions
  // Chunked deltas being put back together, and the first and last offsets of those completed
  // since the last commit: a committed offset must not fall inside one (a restart would read
  // only its tail), so it is held back to the first piece (offsets_holding).
  ChunkAssembler chunks_;
  std::map<std::pair<std::string, int32_t>, std::map<int64_t, int64_t>> spans_;
  // Streamed proposals being decoded, segment by segment (core/codec/messages.h).
  GenesisProposalAssembler proposals_;
  // Set by an assignment or a failure; the loop rebuilds the owned fragments before it handles
  // another delta. After a failure the consumer is also rewound to the committed offsets.
  bool recover_needed_ = false;
  bool rewind_needed_ = false;
  int recoveries_ = 0;  // recoveries attempted
  int rewinds_ = 0;     // rewinds attempted
};

}  // namespace diloco
