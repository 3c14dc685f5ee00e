// Internal to diloco-replay: reading an opened run's logs. Offset ranges of the delta topics,
// single messages, and per fragment its checkpoints and merge records, replayed through
// merger/recovery.h with the named deltas fetched a window at a time (for_each_with_deltas), all
// through the run's one LogReader.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/kafka/consumer.h"
#include "tools/replay/replay.h"

namespace diloco {

// Name -> partition count of every topic the cluster has (one metadata request; never creates a
// topic). Throws Unavailable when the broker does not answer.
std::map<std::string, int> topic_partitions(LogReader& reader, int timeout_ms);

// The committed message at a position; InvalidInput naming the partition's offsets when absent.
ConsumedMessage fetch_one(const ReplayRun& run, const LogPosition& position);

// ---- fragment histories ---------------------------------------------------------------------

struct CheckpointInfo {
  uint64_t version = 0;
  uint64_t checksum = 0;           // of params, as stored (and verified on decoding)
  uint64_t momentum_checksum = 0;  // checksum_fp32 of the stored momentum
  uint64_t outer_state_checksum = 0;  // checksum_fp32 of the stored outer_state (empty: of nothing)
  // checksum_fp32 of the stored downlink_residual: what quantization has not yet sent, which a
  // merger restarted from this checkpoint adds to its next update (empty with an fp32 downlink).
  uint64_t residual_checksum = 0;
  LogPosition position;
};

struct FragmentLog {
  FragmentState start;                     // the chosen checkpoint, or version 0 from its proposal
  std::optional<LogPosition> start_position;  // none: version 0 from the proposal (or nothing)
  std::optional<LoggedMerge> genesis;       // the record that made version 0
  std::vector<CheckpointInfo> checkpoints;  // every checkpoint read, in log order
  std::vector<LoggedMerge> merges;          // the fragment's records after `start`, in log order
  uint64_t latest_version = 0;             // the newest version the logs hold
};

// Which checkpoint a history starts from.
struct StartAt {
  bool earliest = false;                    // the lowest version (verify)
  uint64_t at_most = UINT64_MAX;            // otherwise the newest at or below this version
};

// Reads `state` and then `merges` of one partition (in that order, so every checkpoint read has
// its record read too) and builds each fragment's history. Undecodable checkpoints and records
// are passed to `rejected` and skipped.
std::map<uint32_t, FragmentLog> read_fragment_logs(const ReplayRun& run, int32_t partition, StartAt start,
                                                   const OnRejected& rejected);

// The proposal a genesis record names, assembled from its segments when streamed; none when the
// record is not a genesis record or the proposal is gone (retention). Throws InvalidInput when the
// position holds another proposal or its segments end early, Rejection when it does not decode.
std::optional<GenesisProposal> proposal_from_record(const ReplayRun& run, const LoggedMerge& merge);

// Version 0 of a fragment from that proposal (its parameters, zero momentum and outer state).
std::optional<FragmentState> genesis_from_record(const ReplayRun& run, const LoggedMerge& merge);

// Applies the records that continue `state` (apply_logged_merge: checksums checked) until it
// reaches version `until`, calling `applied` after each. Throws InvalidInput at the first record
// that does not rebuild.
void replay_records(const ReplayRun& run, FragmentState& state, std::span<const LoggedMerge> merges,
                    uint64_t until, const std::function<void(const FragmentState&, const LoggedMerge&)>& applied);

// ---- JSON helpers shared by list, show and the reports --------------------------------------

double l2_norm(std::span<const DenseTensor> tensors);
nlohmann::json tensor_summaries(std::span<const DenseTensor> tensors, std::span<const TensorSpec> layout,
                                int first_values);
nlohmann::json position_json(const LogPosition& p);
nlohmann::json fate_json(const DeltaFate& fate);
// {"fate": "rejected", "reason": <RejectReason name>, "detail": <what the decoder said>}.
nlohmann::json rejection_json(const Rejection& rejection);

}  // namespace diloco
