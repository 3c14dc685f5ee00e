// Rebuilding fragments from the durable logs (ARCHITECTURE.md section 7): the state of fragment p
// at version v is its last checkpoint at or before v, then the merge records after it applied in
// order, each naming its input deltas by Kafka position. A merger taking over a partition after a
// rebalance, a restarted merger and diloco-replay all run this code.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "core/codec/messages.h"
#include "core/config/run_config.h"
#include "core/kafka/consumer.h"
#include "core/kafka/log_reader.h"
#include "core/kafka/options.h"
#include "core/kafka/topics.h"
#include "merger/merge_step.h"
#include "merger/outer_optimizer.h"

namespace diloco {

// The merge rule and optimizer named in a run config (merger section).
MergeRule merge_rule(const RunConfig& config);
OuterOptimizerKind outer_optimizer(const RunConfig& config);
OuterHyper outer_hyper(const RunConfig& config);
// merger.outer_momentum with its schedule (merger.momentum_*).
MomentumSchedule momentum_schedule(const RunConfig& config);
// codec.downlink_dtype and codec.downlink_block_size (block size 0 unless int8 or int4).
DownlinkCodec downlink_codec(const RunConfig& config);

// Version 0 of fragment p from a learner's initial values (a GenesisProposal): the parameters,
// zero outer momentum (and a zero outer_state when merger.optimizer keeps one), no consumed
// offsets. `layout` is the run's.
FragmentState genesis_state(const RunConfig& config, std::shared_ptr<const FragmentLayout> layout, uint32_t p,
                            std::vector<DenseTensor> params);

// The run's model layout, from the newest checkpoints in `state` (every one carries it): null
// when the run has none yet (no learner's proposal was committed). Throws InvalidInput when
// checkpoints of two models are there (the run's logs were mixed).
std::shared_ptr<const FragmentLayout> read_run_layout(const KafkaOptions& kafka, const RunTopics& topics,
                                                      const RunConfig& config, int timeout_ms);

struct LogContext {
  KafkaOptions kafka;
  RunTopics topics;
  const RunConfig* config = nullptr;
  // The run's fragment layout (every checkpoint and proposal of the run carries it).
  std::shared_ptr<const FragmentLayout> layout;
  DecodeLimits limits;
  int timeout_ms = 120000;
  // How long a new owner waits for transactions still open on its partitions of `state` and
  // `merges` (a predecessor's commit whose markers are not yet written, or a killed predecessor's
  // transaction until the broker aborts it after the transaction timeout).
  int stable_wait_ms = 30000;
  // Threads that share a rebuilt merge's arithmetic (merge_step.h); null: the caller's.
  WorkPool* pool = nullptr;
  // The one reader of every log read (a merger's, or a diloco-replay command's); null: each call
  // below makes its own for the time it runs.
  std::shared_ptr<LogReader> reader;
  // Deltas fetched at once when records are replayed: at most this many bytes (after the first
  // window, which takes kFirstWindowDeltas; sized from the largest delta seen so far), and never
  // more than kMaxWindowDeltas.
  uint64_t window_bytes = 256ull << 20;
};

inline constexpr size_t kFirstWindowDeltas = 16;
inline constexpr size_t kMaxWindowDeltas = 256;

// `ctx` with a reader: its own, or a new one.
LogContext with_reader(const LogContext& ctx);

// A merge record as read from `merges`, with where it was read.
struct LoggedMerge {
  MergeRecord record;
  LogPosition position;
};

// A merge record that changes the parameters (an accounting-only record, written at a clean stop,
// keeps the version and lists only dropped and pending deltas; a genesis record makes version 0
// from a proposal, which nothing merges).
inline bool is_merge(const MergeRecord& r) { return !r.genesis && !r.inputs.empty(); }

// Applies one logged merge to `state` (at version record.prev_version): fetches and decodes the
// input deltas, re-runs merge_step with the record's rule, optimizer and weights, and checks the
// result's checksum against the record. Updates `state` in place (version, params, momentum,
// checksum, last_merge, and the bookkeeping of account()), holding no second copy of it. Throws
// InvalidInput when a delta is missing or the checksum differs, naming the record's position;
// after a checksum that differs `state` holds the version it rebuilt, and is not to be used.
void apply_logged_merge(const LogContext& ctx, FragmentState& state, const LoggedMerge& merge);

// Fetched messages by Kafka position (topic, partition, offset); they must outlive the index.
using DeltaMessages = std::map<std::tuple<std::string, int32_t, int64_t>, const ConsumedMessage*>;
DeltaMessages index_by_position(const std::vector<ConsumedMessage>& messages);

// The delta `ref` names, decoded from `messages` (INT8 and INT4 tensors kept as they travelled:
// DeltaValues::AsSent) and checked to be that learner's seq. Throws
// InvalidInput naming the delta and the record at `named_by` when it is missing or another one.
Delta logged_delta(const LogContext& ctx, const DeltaMessages& messages, const DeltaRef& ref,
                   const LogPosition& named_by);

// Which deltas of a record to fetch before visiting it.
using NamedDeltas = std::function<std::vector<LogPosition>(const MergeRecord&)>;
std::vector<LogPosition> input_positions(const MergeRecord& record);

// Visits records in order with the deltas `named` picks already fetched, one read of ctx's
// reader per window of deltas (window_bytes) instead of one per record. `visit` returns false to
// stop.
void for_each_with_deltas(const LogContext& ctx, std::span<const LoggedMerge> merges, const NamedDeltas& named,
                          const std::function<bool(const LoggedMerge&, const DeltaMessages&)>& visit);

// apply_logged_merge with the input deltas already fetched (`messages` may hold more), so that a
// reader of many records fetches their deltas in one pass.
void apply_logged_merge(const LogContext& ctx, FragmentState& state, const LoggedMerge& merge,
                        const DeltaMessages& messages);

// Whether `merge` is the record that continues `state`: false for one `state` already contains
// (at or before its checkpoint's record, or older than its version), true for the next one.
// Throws InvalidInput when the record leaves a gap (it continues a version `state` never reached).
bool continues_state(const FragmentState& state, const LoggedMerge& merge);

// Updates the bookkeeping of `state` with what a committed record accounts for: the positions of
// its inputs and final drops join `recent` (PendingAtStop deltas stay out: a later owner merges
// them); inputs raise their learner's merged base and accounted seq; drops other than Invalid
// raise the accounted seq. A delta dropped as invalid changes no learner's bookkeeping, so a
// forged delta carrying a real learner's id cannot silence that learner. A genesis record's
// proposal joins `recent` only: its learner's deltas on version 0 are still to come.
void account(FragmentState& state, const MergeRecord& record);

// Forgets the `recent` positions a consumer starting at `committed` (next offsets to read, per
// delta partition) will not read again.
void prune_recent(FragmentState& state, std::span<const TopicPartitionOffset> committed);

struct RecoveredFragment {
  FragmentState state;          // the newest version the logs hold (empty while awaiting genesis)
  // No checkpoint and no merge record: no learner's proposal of version 0 was committed yet.
  bool awaiting_genesis = false;
  uint32_t state_pieces = 0;  // the pieces the checkpoint was read from (0: none read)
  std::vector<MergeRecord> replayed;  // records applied after the checkpoint, in order
};

// Rebuilds every fragment in `fragments` (all stored in state/merges partition `partition`).
// Each rebuilt state's `layout` is the run's (ctx.layout, required).
std::map<uint32_t, RecoveredFragment> recover_partition(const LogContext& ctx, int32_t partition,
                                                        std::span<const uint32_t> fragments);

// Every merge record of a partition from `from_offset` (-2: beginning), in log order; records
// that fail strict decoding are passed to `rejected` (position, reason) and skipped.
std::vector<LoggedMerge> read_merges(const LogContext& ctx, int32_t partition, int64_t from_offset,
                                     const std::function<void(const LogPosition&, const std::string&)>& rejected = {});

}  // namespace diloco
