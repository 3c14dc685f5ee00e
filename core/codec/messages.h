// The wire contract in C++ (schemas/*.fbs): plain structs for every message, encode to
// zstd(FlatBuffer) bytes, and strict decoding. Decoding verifies the buffer, bounds the
// decompressed size before decompressing, and checks run id, fingerprint, fragment range, tensor
// shapes against the layout, finite values and sane counters; any failure throws Rejection.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "core/codec/quantize.h"
#include "core/codec/reject.h"
#include "core/fragments/layout.h"

namespace diloco {

inline constexpr uint16_t kSchemaVersion = 1;

struct CodecOptions {
  DType dtype = DType::INT4;
  uint32_t block_size = 128;  // values per scale for INT8/INT4
  uint32_t topk = 0;          // INT8/INT4: the tensors keep at most this many values per block (0: all)
  bool byte_shuffle = true;
  int zstd_level = 1;
};

// What a reader expects; anything else is rejected.
struct DecodeLimits {
  std::string run_id;
  uint64_t fingerprint = 0;
  const FragmentLayout* layout = nullptr;   // required for tensor-carrying messages
  uint64_t max_message_bytes = 64ull << 20; // compressed
  uint64_t max_decompressed_bytes = 256ull << 20;
  uint64_t max_tokens_per_step = 1ull << 24;  // Delta: tokens / inner_steps above this is absurd
};

// A dense fp32 tensor of one fragment, in layout order.
struct DenseTensor {
  uint32_t index = 0;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

struct LogPosition {
  std::string topic;
  int32_t partition = -1;
  int64_t offset = -1;
  bool operator==(const LogPosition&) const = default;
  auto operator<=>(const LogPosition&) const = default;
};

// "topic[partition]@offset", as every message about a position writes it.
std::string describe(const LogPosition& position);

// ---- Delta ----------------------------------------------------------------------------------
struct DeltaHeader {
  std::string run_id;
  uint64_t fingerprint = 0;
  std::string learner_id;
  std::string region;
  uint32_t fragment = 0;
  uint64_t seq = 0;
  uint64_t base_version = 0;
  uint32_t inner_steps = 0;
  uint64_t tokens = 0;
  uint64_t learner_step = 0;
  float train_loss = 0;
  int64_t send_time_us = 0;
};

struct Delta {
  DeltaHeader header;
  DType dtype = DType::F32;
  uint32_t block_size = 0;
  uint32_t topk = 0;  // as the sender declared it (CodecOptions::topk); enforced on sparse tensors only
  bool sparse = false;  // the tensors travelled in the sparse form (core/codec/sparse.h)
  bool byte_shuffle = false;
  std::vector<DenseTensor> tensors;  // dequantized to fp32 (empty when `quantized` holds them)
  // DeltaValues::AsSent and an INT8 or INT4 delta: the tensors as they travelled (payload and
  // scales, 1 or 0.5 bytes per value), `tensors` empty. Empty otherwise.
  std::vector<QuantizedTensor> quantized;
  size_t wire_bytes = 0;             // size of the compressed message it came from
};

// How decode_delta hands out tensors: all dequantized to fp32, or INT8 and INT4 ones kept as
// they travelled (for a reader that holds many deltas; merger/delta_tensors.h reads them).
enum class DeltaValues : uint8_t { Dense, AsSent };

// Tensors must already be quantized (the learner quantizes through ErrorFeedback). With
// options.topk > 0 they travel in the sparse form (core/codec/sparse.h) and each block must hold at
// most topk values that are not 0 (InvalidInput otherwise), as ErrorFeedback::push with that topk
// makes them.
std::vector<uint8_t> encode_delta(const DeltaHeader& header, std::span<const QuantizedTensor> tensors,
                                  const CodecOptions& options);
// Convenience: quantize dense tensors (no error feedback, no top-k selection) and encode, always
// in the dense form (options.topk is only declared).
std::vector<uint8_t> encode_delta(const DeltaHeader& header, std::span<const DenseTensor> tensors,
                                  const CodecOptions& options);
Delta decode_delta(std::span<const uint8_t> bytes, const DecodeLimits& limits,
                   DeltaValues values = DeltaValues::Dense);
// Same, into `out`, reusing its tensors' memory: a reader decoding delta after delta of the same
// fragment then neither allocates nor page-faults. On Rejection `out` holds garbage.
void decode_delta(std::span<const uint8_t> bytes, const DecodeLimits& limits, Delta& out,
                  DeltaValues values = DeltaValues::Dense);
// Header only (no tensor decoding): for routing and inspection; still verifies the buffer.
DeltaHeader peek_delta_header(std::span<const uint8_t> bytes, const DecodeLimits& limits);

// ---- FragmentParams -------------------------------------------------------------------------
// A version of a fragment: a snapshot (the parameters) or an update (the change from
// base_version = version - 1, which a holder of base_version applies with apply_update).
struct FragmentParams {
  std::string run_id;
  uint64_t fingerprint = 0;
  uint32_t fragment = 0;
  uint64_t version = 0;
  uint64_t checksum = 0;  // checksum_fp32 of the version's parameters, in layout order
  std::string merger_instance;
  uint64_t epoch = 0;
  bool update = false;
  uint64_t base_version = 0;        // update only
  std::vector<DenseTensor> tensors;  // snapshot: the parameters; update: the change, dequantized
  size_t wire_bytes = 0;             // size of the message it was decoded from
};

// A snapshot, sent as fp32 (byte-shuffled); `checksum` is filled in by the encoder when it is 0.
std::vector<uint8_t> encode_fragment_params(const FragmentParams& msg, int zstd_level = 1);
// An update: msg's header (update, base_version, checksum of the result) with the quantized
// change (the tensors must match `codec`'s dtype and block size; msg.tensors is not read). With
// codec.topk > 0 the change travels in the sparse form, as encode_delta's quantized tensors do.
std::vector<uint8_t> encode_fragment_update(const FragmentParams& msg,
                                            std::span<const QuantizedTensor> change,
                                            const CodecOptions& codec);
// A snapshot's checksum is verified against the decoded values (CorruptFrame otherwise); an
// update's names the result and is verified by apply_fragment_update. An update must have
// base_version = version - 1 (BadCounter).
FragmentParams decode_fragment_params(std::span<const uint8_t> bytes, const DecodeLimits& limits);
// The version `update` makes from `held` (a snapshot of update.base_version, same fragment): held's
// parameters plus the change, checked against the update's checksum. Throws Rejection
// (CorruptFrame) when the result does not match, InvalidInput when held is not its base.
FragmentParams apply_fragment_update(const FragmentParams& held, const FragmentParams& update);
// The same, the new version written over the update's own values: no third copy of the fragment
// (a subscriber holds the version it has and the update it decoded, 8 bytes per parameter, not 12).
FragmentParams apply_fragment_update(const FragmentParams& held, FragmentParams&& update);

// ---- Streamed messages (schemas/common.fbs Segment) ------------------------------------------
// A message too large for one FlatBuffer (2 GiB) or for one piece of a process's memory travels
// as segments: each a whole, strictly decoded message of its type with schema version 2 holding
// one range of the fragment's values (counted over its tensors in layout order) and repeating the
// header. A sender holds one encoded segment at a time, a reader decodes each into place: neither
// ever holds the encoded message whole. Checkpoints (FragmentState), snapshots (FragmentParams)
// and proposals (GenesisProposal) stream; deltas and updates are quantized (at most 4.5 bits a
// value with int4) and travel whole.
inline constexpr uint16_t kSegmentSchemaVersion = 2;
inline constexpr uint32_t kMaxSegments = 1u << 20;

// Called with each segment in order: its index, the count, and its bytes (valid during the call).
using SegmentSink = std::function<void(uint32_t index, uint32_t count, std::span<const uint8_t> bytes)>;

// A message as the parts it travels in: a streamed message's segments in order, or one part.
using MessageParts = std::vector<std::vector<uint8_t>>;

// Where a reader stands in one streamed message: the segment due and the values read so far.
struct SegmentCursor {
  uint32_t next = 0;        // the segment due (0: none begun)
  uint32_t count = 0;       // segments of the message begun
  uint64_t next_value = 0;  // the first value the due segment must hold
  uint64_t total = 0;       // values of the fragment
};

// ---- Streamed snapshots -----------------------------------------------------------------------
// How many segments a snapshot of `tensors` takes with at most `segment_bytes` of values (4
// bytes each) in each: 1 when they fit, and it then travels as one whole message. InvalidInput
// for a segment_bytes of 0, an update, or more than kMaxSegments segments.
uint32_t fragment_params_segments(const FragmentParams& header, std::span<const DenseTensor> tensors,
                                  uint64_t segment_bytes);
// Encodes the snapshot of `tensors` with `header` (its own tensors are not read: a merger sends
// the parameters it holds without copying them) as fragment_params_segments() segments, emitting
// each as soon as it is built (one segment: the whole message, as encode_fragment_params writes
// it). Every segment carries the header and the checksum of the whole version.
void for_each_fragment_params_segment(const FragmentParams& header, std::span<const DenseTensor> tensors,
                                      uint64_t segment_bytes, int zstd_level, const SegmentSink& emit);

// Reads FragmentParams as one publisher sent them. A whole message (snapshot or update) comes back
// at once, as decode_fragment_params gives it; a segment is decoded into place and the snapshot
// comes back with its last segment, its checksum verified, `wire_bytes` the segments' bytes.
// Segments of different fragments may interleave (one snapshot begun per fragment); whole
// messages pass by a snapshot begun, and a segment 0 of a fragment drops the one begun (a newer
// snapshot, or the same one sent again after a segment was lost). Memory: the snapshots begun,
// decoded (4 bytes a parameter), and one segment.
class FragmentParamsAssembler {
 public:
  explicit FragmentParamsAssembler(DecodeLimits limits);
  // Throws Rejection for a message that fails strict decoding (its own reason), a segment other
  // than the next one of its fragment's snapshot (ChunkMissing: a segment past 0 with none begun;
  // ChunkMismatch otherwise), a segmented update (BadCodec), or one that disagrees with segment 0
  // (ChunkMismatch: version, checksum, merger, epoch, codec, count or its range of values). The
  // fragment's snapshot begun is dropped then.
  std::optional<FragmentParams> add(std::span<const uint8_t> bytes);
  // Snapshots begun and not complete.
  size_t pending() const { return open_.size(); }
  void reset() { open_.clear(); }

 private:
  struct Open {
    FragmentParams params;
    SegmentCursor cursor;
    bool shuffled = true;
  };
  DecodeLimits limits_;
  std::map<uint32_t, Open> open_;
};

// How a merger's new versions travel to subscribers (MergeRecord.downlink).
struct DownlinkCodec {
  DType dtype = DType::F32;  // F32: snapshots only; otherwise updates quantized this way
  uint32_t block_size = 0;   // INT8 / INT4 only
  uint32_t topk = 0;         // values sent per block, the largest (0: all; quantize_with_feedback)
  bool operator==(const DownlinkCodec&) const = default;
};

// ---- MergeRecord ----------------------------------------------------------------------------
enum class DropReason : uint8_t { None = 0, Superseded = 1, TooStale = 2, Invalid = 3, PendingAtStop = 4 };
enum class MergeRule : uint8_t { RadialDirectional = 0, WeightedAverage = 1 };
// The merger's outer optimizer (merger/outer_optimizer.h); DelayedNesterov and Cgad keep a second
// state buffer (FragmentState::outer_state).
enum class OuterOptimizerKind : uint8_t { Nesterov = 0, Sgd = 1, DelayedNesterov = 2, Cgad = 3 };
const char* drop_reason_name(DropReason);
// "nesterov" | "sgd" | "dn" | "cgad": the names merger.optimizer and remerge --optimizer take.
const char* outer_optimizer_name(OuterOptimizerKind);
std::optional<OuterOptimizerKind> parse_outer_optimizer(std::string_view name);
// The valid names, comma separated, for error messages.
std::string outer_optimizer_names();
// Whether the optimizer keeps FragmentState::outer_state.
bool has_outer_state(OuterOptimizerKind);

struct DeltaRef {
  LogPosition position;
  std::string learner_id;
  uint64_t seq = 0;
  uint64_t base_version = 0;
  uint64_t staleness = 0;
  uint32_t inner_steps = 0;
  uint64_t tokens = 0;
  double weight = 0;
};

struct DroppedDelta {
  DeltaRef delta;
  DropReason reason = DropReason::None;
  std::string detail;
};

struct OuterHyper {
  float lr = 0.7f;
  float momentum = 0.9f;
  float staleness_alpha = 0.0f;
  uint32_t max_staleness = 0;
  uint32_t quorum = 1;
  // Delayed Nesterov: the momentum is folded every dn_period-th version, dn_activation (c) of it
  // applied in between.
  uint32_t dn_period = 2;
  float dn_activation = 0.0f;
  // CGAD: age factor exp(-cgad_decay * s) with a cosine gate reaching 0 at staleness
  // cgad_cutoff; then Adam with beta1 = momentum, beta2 = adam_beta2, epsilon adam_epsilon.
  float cgad_decay = 0.1f;
  uint32_t cgad_cutoff = 16;
  float adam_beta2 = 0.99f;
  float adam_epsilon = 1e-8f;
};

struct MergeRecord {
  std::string run_id;
  uint64_t fingerprint = 0;
  uint32_t fragment = 0;
  uint64_t version = 0;
  uint64_t prev_version = 0;
  std::vector<DeltaRef> inputs;
  std::vector<DroppedDelta> dropped;
  MergeRule rule = MergeRule::RadialDirectional;
  OuterOptimizerKind optimizer = OuterOptimizerKind::Nesterov;
  OuterHyper hyper;
  uint64_t checksum = 0;
  std::string merger_instance;
  uint64_t epoch = 0;
  int64_t merge_time_us = 0;
  float share = 1.0f;  // in (0, 1]: the outer update was scaled by it (see merge_step.h)
  // In (0, 1]: the part of `share` that is the inputs' staleness scale (weighting.h).
  float staleness_scale = 1.0f;
  DownlinkCodec downlink;  // how the new version was quantized for subscribers (merge_step.h)
  // How norms were summed (merge_step.h): per range of this many elements, 0 = per whole tensor.
  // 0 or a power of two in [kMinNormBlock, kMaxNormBlock].
  uint32_t norm_block = 0;
  // Version 0: the one input is the GenesisProposal whose tensors are the parameters.
  bool genesis = false;
};
inline constexpr uint32_t kMinNormBlock = 1u << 10;
inline constexpr uint32_t kMaxNormBlock = 1u << 26;
inline bool valid_norm_block(uint32_t b) {
  return b == 0 || (b >= kMinNormBlock && b <= kMaxNormBlock && (b & (b - 1)) == 0);
}

std::vector<uint8_t> encode_merge_record(const MergeRecord& msg, int zstd_level = 3);
MergeRecord decode_merge_record(std::span<const uint8_t> bytes, const DecodeLimits& limits);

// ---- FragmentState --------------------------------------------------------------------------
struct FragmentState {
  std::string run_id;
  uint64_t fingerprint = 0;
  uint32_t fragment = 0;
  uint64_t version = 0;
  std::vector<DenseTensor> params;
  std::vector<DenseTensor> momentum;
  // The optimizer's second buffer, same layout as params (Delayed Nesterov: the gradients
  // accumulated since the last fold; CGAD: Adam's second moment); empty for Nesterov and Sgd.
  std::vector<DenseTensor> outer_state;
  std::vector<LogPosition> consumed;
  // In a checkpoint: a merge record at or before the one that produced `version` (see
  // schemas/fragment_state.fbs); in a state rebuilt by recovery or replay: that record itself.
  std::optional<LogPosition> last_merge;
  uint64_t checksum = 0;  // checksum_fp32 of params; filled in by the encoder when 0
  // learner id -> newest delta seq accounted for by a committed merge record (merged, or dropped
  // for a reason other than being invalid). Informational: re-reads are found by position.
  std::map<std::string, uint64_t> accounted;
  // learner id -> newest base version merged from that learner (a newer delta of it on such a
  // base repeats merged progress and is superseded).
  std::map<std::string, uint64_t> merged_bases;
  // Positions of deltas that committed records account for and that a consumer starting at the
  // committed offsets would read again (at or after them): they are skipped as re-reads.
  std::set<LogPosition> recent;
  // With a quantized downlink: the part of the outer updates not yet sent (error feedback, same
  // layout as params); empty for an fp32 downlink.
  std::vector<DenseTensor> downlink_residual;
  // The run's model layout (every tensor of the run, not only this fragment's). Required to
  // encode. Decoded: the layout the message carries when the reader gave none
  // (DecodeLimits::layout null), else null (the reader's layout, which the fingerprint matched).
  std::shared_ptr<const FragmentLayout> layout;
  // The outer optimizer that last stepped momentum and outer_state, and the version its use
  // began at (schemas/fragment_state.fbs): merge_step starts another optimizer's buffers from zero.
  // Unset in checkpoints of older binaries.
  std::optional<OuterOptimizerKind> optimizer;
  uint64_t optimizer_since = 0;
};

std::vector<uint8_t> encode_fragment_state(const FragmentState& msg, int zstd_level = 1);
// What decode_fragment_state takes out of a checkpoint: everything (a merger recovering, replay),
// or the parameters and the bookkeeping without the optimizer's buffers and the downlink's
// residual (a learner joining the run, which never reads them: 4 to 12 bytes per parameter it
// does not hold; those lists are left empty and their values unchecked).
enum class StateParts { All, ParamsOnly };
// Verifies the checksum of params. With limits.layout null, any fingerprint is accepted whose
// layout the message carries (BadLayout otherwise), and the tensors are checked against it.
FragmentState decode_fragment_state(std::span<const uint8_t> bytes, const DecodeLimits& limits,
                                    StateParts parts = StateParts::All);

// ---- Streamed checkpoints --------------------------------------------------------------------
// A checkpoint too large for one FlatBuffer (about 170M parameters with Nesterov and a quantized
// downlink) travels as segments (above): each FragmentState segment holds a range of the values
// of every tensor list; segment 0 also carries the bookkeeping and the layout.
// How many segments `msg` takes with at most `segment_bytes` of values in each (its tensor lists
// counted together, 4 bytes a value): 1 when they fit, and it then travels as one whole message.
// InvalidInput for a segment_bytes of 0 or more than kMaxSegments segments.
uint32_t fragment_state_segments(const FragmentState& msg, uint64_t segment_bytes);
// Encodes `msg` as fragment_state_segments(msg, segment_bytes) segments, emitting each as soon as
// it is built (one segment: the whole message, as encode_fragment_state writes it).
void for_each_fragment_state_segment(const FragmentState& msg, uint64_t segment_bytes, int zstd_level,
                                     const SegmentSink& emit);

// Reads a checkpoint's messages in the order they were written. A whole checkpoint comes back at
// once (decode_fragment_state); a segment is decoded into place and the checkpoint comes back with
// its last segment, its params' checksum verified. One checkpoint at a time: the reader's memory
// is the decoded checkpoint (only params with StateParts::ParamsOnly) and one segment.
class FragmentStateAssembler {
 public:
  explicit FragmentStateAssembler(DecodeLimits limits, StateParts parts = StateParts::All);
  // Throws Rejection for a message that fails strict decoding (its own reason), a segment other
  // than the next one of the checkpoint begun or a whole checkpoint in its middle (ChunkMismatch,
  // ChunkMissing: a segment past 0 with none begun), or one that disagrees with segment 0
  // (ChunkMismatch: fragment, version, checksum, count, its range of values or its lists). The
  // checkpoint begun is dropped then: the next one starts at a segment 0 or a whole message.
  std::optional<FragmentState> add(std::span<const uint8_t> bytes);
  // Whether a streamed checkpoint is begun and not complete.
  bool pending() const { return cursor_.next != 0; }
  // Drops the checkpoint begun.
  void reset();
  // Called at segment 0 of a streamed checkpoint, with its bookkeeping read (fragment, version,
  // ...; no tensors), before any of its values are held: a reader keeping the newest checkpoint
  // of a fragment can let go of an older one first, so that the two are never held at once.
  void on_begin(std::function<void(const FragmentState& head)> hook) { on_begin_ = std::move(hook); }

 private:
  std::optional<FragmentState> add_opened(std::span<const uint8_t> bytes);

  DecodeLimits limits_;
  StateParts parts_;
  std::function<void(const FragmentState&)> on_begin_;
  FragmentState state_;
  const std::vector<TensorSpec>* specs_ = nullptr;
  SegmentCursor cursor_;
  std::array<bool, 4> lists_{};  // params, momentum, outer_state, downlink_residual present
};

// ---- GenesisProposal --------------------------------------------------------------------------
// A learner's initial values of one fragment, proposed as its version 0 (schemas/genesis.fbs).
struct GenesisProposal {
  std::string run_id;
  uint64_t fingerprint = 0;
  std::string learner_id;
  std::string region;
  uint32_t fragment = 0;
  uint64_t seq = 0;
  int64_t send_time_us = 0;
  // Required to encode (its fingerprint is written); decoded as for FragmentState::layout.
  std::shared_ptr<const FragmentLayout> layout;
  uint64_t checksum = 0;  // checksum_fp32 of tensors; filled in by the encoder when 0
  std::vector<DenseTensor> tensors;
  size_t wire_bytes = 0;
};

std::vector<uint8_t> encode_genesis_proposal(const GenesisProposal& msg, int zstd_level = 1);
// Strict decoding as for a FragmentState (checksum verified, finite values, the fragment's shapes
// against the reader's layout or the one the message carries).
GenesisProposal decode_genesis_proposal(std::span<const uint8_t> bytes, const DecodeLimits& limits);

// Streamed proposals, as snapshots stream: segment 0 also carries the layout.
uint32_t genesis_proposal_segments(const GenesisProposal& msg, uint64_t segment_bytes);
// Which segment of a streamed proposal `bytes` is (0 for a whole proposal), from its header alone
// (no tensor decoded): a proposal counts once, at its segment 0. Throws Rejection for a message
// that does not open as a proposal of the run.
uint32_t genesis_proposal_segment(std::span<const uint8_t> bytes, const DecodeLimits& limits);
void for_each_genesis_proposal_segment(const GenesisProposal& msg, uint64_t segment_bytes, int zstd_level,
                                       const SegmentSink& emit);

// Reads proposals in log order. A whole one comes back at once (decode_genesis_proposal); a
// segment is decoded into place and the proposal comes back with its last segment, its checksum
// verified, `wire_bytes` the segments' bytes. Segments of different proposals (learner,
// fragment, seq) may interleave, several learners writing one partition; those of one proposal
// come in order. At most `max_open` proposals are begun at once.
class GenesisProposalAssembler {
 public:
  explicit GenesisProposalAssembler(DecodeLimits limits, size_t max_open = 16);
  // Rejection as FragmentParamsAssembler::add (TooLarge: a segment 0 beyond max_open proposals
  // begun); the proposal begun that a segment belonged to is dropped then. `at`: where the
  // message was read (a log reader's position, kept for head() and open_heads()).
  std::optional<GenesisProposal> add(std::span<const uint8_t> bytes, const LogPosition& at = {});
  // Where the proposal add() last returned began: its segment 0's `at` (a whole one's own).
  const LogPosition& head() const { return head_; }
  // Where the proposal that add()'s last rejection dropped began, when it had begun (a segment
  // past 0 that did not continue it): its reader rejects the proposal there, where it counts it.
  const std::optional<LogPosition>& dropped_head() const { return dropped_head_; }
  // Where the proposals begun began: a reader of a log must not commit its offset past them, or
  // a restart would read only their tails.
  std::vector<LogPosition> open_heads() const;
  size_t pending() const { return open_.size(); }
  void reset() { open_.clear(); }
  // New bounds for the messages that arrive from now on; proposals begun are kept.
  void set_limits(DecodeLimits limits) { limits_ = std::move(limits); }
  // Collects only the proposal of this learner, fragment and seq: other proposals' messages are
  // passed over (nullopt) once their header is read. For a reader after one proposal (replay).
  void only(std::string learner_id, uint32_t fragment, uint64_t seq) {
    only_ = Key{std::move(learner_id), fragment, seq};
  }

 private:
  using Key = std::tuple<std::string, uint32_t, uint64_t>;  // learner id, fragment, seq
  struct Open {
    GenesisProposal proposal;
    const std::vector<TensorSpec>* specs = nullptr;
    SegmentCursor cursor;
    LogPosition head;
  };
  DecodeLimits limits_;
  size_t max_open_;
  LogPosition head_;
  std::optional<LogPosition> dropped_head_;
  std::optional<Key> only_;
  std::map<Key, Open> open_;
};

// ---- Member ---------------------------------------------------------------------------------
enum class Role : uint8_t { Learner = 0, Merger = 1, Evaluator = 2 };
const char* role_name(Role);

struct Member {
  std::string run_id;
  std::string instance_id;
  Role role = Role::Learner;
  std::string region;
  std::string endpoint;
  uint64_t epoch = 0;
  std::vector<uint32_t> owned_fragments;
  std::vector<uint64_t> fragment_versions;
  std::vector<uint64_t> fragment_checksums;  // mergers: parallel to owned_fragments, or empty
  int64_t time_us = 0;
  uint64_t step = 0;
  float step_time_s = 0;
  float tokens_per_s = 0;
  float loss = 0;
  uint64_t tokens = 0;
  uint64_t bytes_sent = 0;      // learners: delta bytes delivered (uplink)
  uint64_t bytes_received = 0;  // learners: parameter bytes received from mergers (downlink)
  float announce_interval_s = 0;  // mergers: seconds between announcements (0: not given)
  uint64_t incarnation = 0;  // drawn by each process at start (0 from older binaries)
  bool leaving = false;      // the last announcement of a clean stop
  // Learners: sequences per inner step and tokens per sequence, as declared (0: not declared).
  uint32_t batch = 0;
  uint32_t context = 0;
};

std::vector<uint8_t> encode_member(const Member& msg);
// Checks run id (not fingerprint: membership is model-independent).
Member decode_member(std::span<const uint8_t> bytes, const DecodeLimits& limits);

// ---- Rejected -------------------------------------------------------------------------------
struct RejectedInput {
  std::string run_id;
  LogPosition source;
  std::string reason;
  std::string detail;
  std::string rejected_by;
  int64_t time_us = 0;
  uint64_t payload_size = 0;
  std::vector<uint8_t> payload_head;  // at most 256 bytes of the rejected payload
  std::string sender;  // the learner id the input names (empty: none could be read)
};

std::vector<uint8_t> encode_rejected(const RejectedInput& msg);
RejectedInput decode_rejected(std::span<const uint8_t> bytes, const DecodeLimits& limits);

// xxh64 over the fp32 bytes of the tensors, in order (what FragmentParams, MergeRecord and
// FragmentState call `checksum`).
uint64_t checksum_fp32(std::span<const DenseTensor> tensors);

}  // namespace diloco

namespace diloco {

// ---- RoundOpen (ZeroMQ, advisory) ---------------------------------------------------------------
struct RoundOpen {
  std::string run_id;
  uint64_t fingerprint = 0;
  uint32_t fragment = 0;
  uint64_t version = 0;
  uint32_t pending = 0;
  uint32_t grace_ms = 0;
  std::string merger_instance;
  uint64_t epoch = 0;
  int64_t time_us = 0;
};

std::vector<uint8_t> encode_round_open(const RoundOpen& msg);
// Checks run id, fingerprint and (with a layout) the fragment range.
RoundOpen decode_round_open(std::span<const uint8_t> bytes, const DecodeLimits& limits);

}  // namespace diloco
