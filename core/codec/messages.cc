// Tensor-carrying messages (Delta, FragmentParams, FragmentState) and checksum_fp32. The other
// messages are in records.cc; what they share is in tensor_wire.h.
//
// Decoding order: size limit, bounded decompression, verifier and file identifier, schema
// version, run id, fingerprint, fragment range, then the cheap header fields (strings, counters)
// before any tensor is touched, then the tensors (count, index and shape, codec sizes, finite
// scales and values), then checksums.
#include "core/codec/messages.h"

#include <xxhash.h>

#include <array>
#include <cmath>
#include <memory>

#include "core/codec/tensor_wire.h"
#include "schemas/delta_generated.h"
#include "schemas/fragment_params_generated.h"
#include "schemas/fragment_state_generated.h"
#include "schemas/genesis_generated.h"

namespace diloco {

using namespace tensor_wire;

namespace {

// ---- Delta ----------------------------------------------------------------------------------

std::vector<uint8_t> finish_delta(flatbuffers::FlatBufferBuilder& fbb, const DeltaHeader& h,
                                  const WireCodec& codec,
                                  flatbuffers::Offset<TensorVector> tensors, int zstd_level) {
  const auto run_id = fbb.CreateString(h.run_id);
  const auto learner_id = fbb.CreateString(h.learner_id);
  const auto region = fbb.CreateString(h.region);
  const auto codec_table = add_codec(fbb, codec);
  const auto root = wire::CreateDelta(fbb, kSchemaVersion, run_id, h.fingerprint, learner_id,
                                      region, h.fragment, h.seq, h.base_version, h.inner_steps,
                                      h.tokens, h.learner_step, h.train_loss, h.send_time_us,
                                      codec_table, tensors);
  wire::FinishDeltaBuffer(fbb, root);
  return compress_finished(fbb, zstd_level);
}

// Everything but the tensors. The fragment range is checked when a layout is given (always, for
// decode_delta).
DeltaHeader read_delta_header(const wire::Delta& m, const DecodeLimits& limits) {
  check_fingerprint(m.fingerprint(), limits);
  if (limits.layout) fragment_specs(m.fragment(), limits);
  DeltaHeader h;
  h.run_id = m.run_id()->str();  // present: checked when the frame was opened
  h.fingerprint = m.fingerprint();
  h.learner_id = required(m.learner_id(), "learner_id");
  if (h.learner_id.empty()) reject(RejectReason::MissingField, "learner_id is empty");
  h.region = required(m.region(), "region");
  h.fragment = m.fragment();
  h.seq = m.seq();
  h.base_version = m.base_version();
  h.inner_steps = m.inner_steps();
  h.tokens = m.tokens();
  h.learner_step = m.learner_step();
  h.train_loss = m.train_loss();
  h.send_time_us = m.send_time_us();

  if (h.seq == 0) reject(RejectReason::BadCounter, "seq 0 (sequence numbers start at 1)");
  check_counter(h.seq, "seq");
  check_counter(h.base_version, "base_version");
  check_counter(h.learner_step, "learner_step");
  if (h.inner_steps == 0) reject(RejectReason::BadCounter, "a delta of 0 inner steps");
  if (h.tokens == 0)
    reject(RejectReason::BadCounter,
           detail::concat(h.inner_steps, " inner steps without a single token"));
  if (h.tokens / h.inner_steps > limits.max_tokens_per_step)
    reject(RejectReason::BadCounter,
           detail::concat(h.tokens, " tokens in ", h.inner_steps, " steps, above ",
                          limits.max_tokens_per_step, " per step"));
  if (!std::isfinite(h.train_loss))
    reject(RejectReason::NonFinite, detail::concat("train_loss ", h.train_loss));
  return h;
}

const wire::Delta& open_delta(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  return open_root<wire::Delta>(bytes, limits, wire::VerifyDeltaBuffer, "Delta");
}

// ---- FragmentState --------------------------------------------------------------------------

// Checkpoints are plain fp32: the schema has no codec table to say otherwise.
constexpr WireCodec kStateCodec{.dtype = DType::F32, .block_size = 0, .byte_shuffle = false};
// Proposals are fp32 in byte planes (initial values compress a little better shuffled).
constexpr WireCodec kGenesisCodec{.dtype = DType::F32, .block_size = 0, .byte_shuffle = true};

void check_checksum(uint64_t declared, std::span<const DenseTensor> tensors, const char* what) {
  const uint64_t actual = checksum_fp32(tensors);
  if (actual != declared)
    reject(RejectReason::CorruptFrame,
           detail::concat(what, ": checksum of the decoded values ", actual, ", message says ",
                          declared));
}

// ---- segments -------------------------------------------------------------------------------

struct SegmentRange {
  uint32_t index = 0;
  uint32_t count = 1;
  uint64_t first = 0;
  uint64_t values = 0;
};

uint64_t fragment_values(const std::vector<DenseTensor>& tensors) {
  uint64_t n = 0;
  for (const auto& t : tensors) n += t.values.size();
  return n;
}

// Segments of at most segment_bytes of values for `total` values of `per_value` bytes each.
uint32_t segments_for(uint64_t total, uint64_t per_value, uint64_t segment_bytes, const char* what) {
  if (segment_bytes == 0) throw InvalidInput("segment bytes must be positive");
  if (per_value == 0 || total == 0) return 1;
  const uint64_t values = std::max<uint64_t>(1, segment_bytes / per_value);
  const uint64_t count = (total + values - 1) / values;
  if (count > kMaxSegments)
    throw InvalidInput(detail::concat("a ", what, " of ", total * per_value, " bytes of values in segments of ",
                                      segment_bytes, " bytes takes ", count, " segments, above ", kMaxSegments));
  return static_cast<uint32_t>(count);
}

// The ranges of `count` segments tiling `total` values, each handed to `build` in order.
void for_each_range(uint64_t total, uint32_t count, const std::function<void(const SegmentRange&)>& build) {
  const uint64_t per_segment = (total + count - 1) / count;
  SegmentRange range{.index = 0, .count = count};
  for (; range.index < count; ++range.index) {
    range.first = uint64_t{range.index} * per_segment;
    range.values = std::min(per_segment, total - range.first);
    build(range);
  }
}

// A builder sized for a segment of `values` fp32 values in `tensors` slices and `extra` bytes
// more: a segment is the largest message its process makes, so the thread's scratch builder
// would grow in steps (holding the old and the new buffer at each) and keep that size for good.
flatbuffers::FlatBufferBuilder segment_builder(uint64_t values, size_t tensors, uint64_t extra = 0) {
  const uint64_t estimate = (1 << 16) + values * 4 + tensors * 256 + extra;
  return flatbuffers::FlatBufferBuilder(std::min<uint64_t>(estimate, FLATBUFFERS_MAX_BUFFER_SIZE));
}

// Checks that `s` is the segment due in `c` (none begun: a segment 0 with a count in
// [2, kMaxSegments]); `what` names the message type, `about` the message, for the reasons.
void check_segment_due(const SegmentCursor& c, const wire::Segment& s, const char* what, const std::string& about) {
  if (s.index() != c.next) {
    if (c.next == 0)
      reject(RejectReason::ChunkMissing, detail::concat(what, ": segment ", s.index(), " of ", s.count(), " of ",
                                                        about, " without its segment 0"));
    reject(RejectReason::ChunkMismatch,
           detail::concat(what, ": segment ", s.index(), " of ", about, " where segment ", c.next, " of ", c.count,
                          " was due"));
  }
  if (c.next == 0) {
    if (s.count() < 2 || s.count() > kMaxSegments)
      reject(RejectReason::BadCounter,
             detail::concat(what, ": a streamed message of ", s.count(), " segments (2 to ", kMaxSegments, ")"));
  } else if (s.count() != c.count) {
    reject(RejectReason::ChunkMismatch, detail::concat(what, ": segment ", s.index(), " of ", about, " says ",
                                                       s.count(), " segments, segment 0 said ", c.count));
  }
}

// At segment 0: the message's count and values.
void begin_segments(SegmentCursor& c, const wire::Segment& s, uint64_t total) {
  c = SegmentCursor{.next = 0, .count = s.count(), .next_value = 0, .total = total};
}

// Checks the range of values the due segment `s` holds: the next ones, at least one, within the
// fragment, and to its end for the last segment. True for the last segment.
bool check_segment_range(const SegmentCursor& c, const wire::Segment& s, const char* what) {
  if (s.first() != c.next_value || s.values() == 0 || s.values() > c.total - c.next_value)
    reject(RejectReason::ChunkMismatch,
           detail::concat(what, ": segment ", c.next, " holds values ", s.first(), " + ", s.values(),
                          ", the message's next value is ", c.next_value, " of ", c.total));
  const bool last = c.next + 1 == c.count;
  if (last && s.first() + s.values() != c.total)
    reject(RejectReason::ChunkMismatch, detail::concat(what, ": the last segment ends at value ",
                                                       s.first() + s.values(), ", the fragment holds ", c.total));
  return last;
}

void advance_segment(SegmentCursor& c, const wire::Segment& s) {
  c.next_value += s.values();
  ++c.next;
}

uint64_t specs_values(const std::vector<TensorSpec>& specs) {
  uint64_t n = 0;
  for (const auto& spec : specs) n += static_cast<uint64_t>(spec.numel());
  return n;
}

// Every tensor of the fragment, zero-filled and shaped as the layout says: what segments are
// decoded into.
void size_as_layout(const std::vector<TensorSpec>& specs, std::vector<DenseTensor>& out) {
  out.resize(specs.size());
  for (size_t k = 0; k < specs.size(); ++k) {
    out[k].index = static_cast<uint32_t>(k);
    out[k].shape = specs[k].shape;
    out[k].values.resize(static_cast<size_t>(specs[k].numel()));
  }
}

// Frees the thread's large decompression scratch on the way out (a copy out made, or a
// rejection thrown).
struct ReleaseScratch {
  ~ReleaseScratch() { release_large_scratch(); }
};

}  // namespace

uint64_t checksum_fp32(std::span<const DenseTensor> tensors) {
  std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)> state(XXH64_createState(),
                                                                   &XXH64_freeState);
  DILOCO_ENFORCE(state != nullptr, "XXH64_createState failed");
  XXH64_reset(state.get(), 0);
  for (const auto& t : tensors)
    if (!t.values.empty()) XXH64_update(state.get(), t.values.data(), t.values.size() * 4);
  return XXH64_digest(state.get());
}

std::string describe(const LogPosition& p) {
  return p.topic + "[" + std::to_string(p.partition) + "]@" + std::to_string(p.offset);
}

// ---- Delta ----------------------------------------------------------------------------------

std::vector<uint8_t> encode_delta(const DeltaHeader& header,
                                  std::span<const QuantizedTensor> tensors,
                                  const CodecOptions& options) {
  const WireCodec codec = codec_of(options);
  auto& fbb = builder();
  const auto tensor_vector = add_quantized(fbb, tensors, codec);
  return finish_delta(fbb, header, codec, tensor_vector, options.zstd_level);
}

std::vector<uint8_t> encode_delta(const DeltaHeader& header, std::span<const DenseTensor> tensors,
                                  const CodecOptions& options) {
  WireCodec codec = codec_of(options);
  codec.sparse = false;  // no top-k selection here: dense, topk declared
  auto& fbb = builder();
  const auto tensor_vector = add_dense(fbb, tensors, codec);
  return finish_delta(fbb, header, codec, tensor_vector, options.zstd_level);
}

Delta decode_delta(std::span<const uint8_t> bytes, const DecodeLimits& limits, DeltaValues values) {
  Delta out;
  decode_delta(bytes, limits, out, values);
  return out;
}

void decode_delta(std::span<const uint8_t> bytes, const DecodeLimits& limits, Delta& out, DeltaValues values) {
  DILOCO_ENFORCE(limits.layout != nullptr, "decode_delta needs DecodeLimits::layout");
  const wire::Delta& m = open_delta(bytes, limits);
  out.header = read_delta_header(m, limits);
  const WireCodec codec = check_codec(m.codec());
  const auto& specs = fragment_specs(m.fragment(), limits);
  if (values == DeltaValues::AsSent && (codec.dtype == DType::INT8 || codec.dtype == DType::INT4)) {
    decode_quantized(m.tensors(), specs, codec, "tensors", out.quantized);
    out.tensors.clear();
  } else {
    decode_tensors(m.tensors(), specs, codec, "tensors", out.tensors);
    out.quantized.clear();
  }
  out.dtype = codec.dtype;
  out.block_size = codec.block_size;
  out.topk = codec.topk;
  out.sparse = codec.sparse;
  out.byte_shuffle = codec.byte_shuffle;
  out.wire_bytes = bytes.size();
}

DeltaHeader peek_delta_header(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  return read_delta_header(open_delta(bytes, limits), limits);
}

// ---- FragmentParams -------------------------------------------------------------------------

namespace {

// Snapshots are fp32 in byte planes.
constexpr WireCodec kSnapshotCodec{.dtype = DType::F32, .block_size = 0, .byte_shuffle = true};

std::vector<uint8_t> finish_fragment_params(flatbuffers::FlatBufferBuilder& fbb, const FragmentParams& msg,
                                            uint64_t checksum, const WireCodec& codec,
                                            flatbuffers::Offset<TensorVector> tensors, int zstd_level,
                                            const SegmentRange* segment = nullptr) {
  const auto codec_table = add_codec(fbb, codec);
  const auto run_id = fbb.CreateString(msg.run_id);
  const auto merger = fbb.CreateString(msg.merger_instance);
  const auto segment_table =
      segment ? wire::CreateSegment(fbb, segment->index, segment->count, segment->first, segment->values) : 0;
  const auto root = wire::CreateFragmentParams(
      fbb, segment ? kSegmentSchemaVersion : kSchemaVersion, run_id, msg.fingerprint, msg.fragment, msg.version,
      checksum, merger, msg.epoch, codec_table, tensors, msg.update, msg.update ? msg.base_version : 0, segment_table);
  wire::FinishFragmentParamsBuffer(fbb, root);
  return compress_finished(fbb, zstd_level);
}

// The frame opened as far as every FragmentParams goes: verifier, run id, and a schema version
// that says whole (1, no segment) or segment (2, with one).
template <typename Root>
const Root& open_streamable(std::span<const uint8_t> bytes, const DecodeLimits& limits,
                            bool (*verify)(flatbuffers::Verifier&), const char* what) {
  const auto buf = open_frame(bytes, limits, verify, what);
  const auto& m = *flatbuffers::GetRoot<Root>(buf.data());
  const bool segment = m.segment() != nullptr;
  if (m.schema_version() != (segment ? kSegmentSchemaVersion : kSchemaVersion))
    reject(RejectReason::UnknownSchemaVersion,
           detail::concat(what, ": schema version ", m.schema_version(),
                          segment ? " for a segment (segments are version " : " (this build reads ",
                          segment ? kSegmentSchemaVersion : kSchemaVersion, ")"));
  check_run_id(m.run_id(), limits);
  return m;
}

// Everything of a FragmentParams but its tensors; the fragment range and fingerprint checked.
FragmentParams read_params_head(const wire::FragmentParams& m, const DecodeLimits& limits) {
  check_fingerprint(m.fingerprint(), limits);
  fragment_specs(m.fragment(), limits);
  FragmentParams out;
  out.run_id = m.run_id()->str();
  out.fingerprint = m.fingerprint();
  out.fragment = m.fragment();
  out.version = m.version();
  check_counter(out.version, "version");
  out.checksum = m.checksum();
  out.merger_instance = required(m.merger_instance(), "merger_instance");
  out.epoch = m.epoch();
  out.update = m.update();
  out.base_version = m.base_version();
  if (out.update && out.base_version + 1 != out.version)
    reject(RejectReason::BadCounter, detail::concat("an update to version ", out.version, " from version ",
                                                    out.base_version, " (updates go one version at a time)"));
  if (!out.update && out.base_version != 0)
    reject(RejectReason::BadCounter, detail::concat("a snapshot with base_version ", out.base_version));
  return out;
}

FragmentParams decode_whole_params(const wire::FragmentParams& m, const DecodeLimits& limits, size_t wire_bytes) {
  FragmentParams out = read_params_head(m, limits);
  out.wire_bytes = wire_bytes;
  decode_tensors(m.tensors(), fragment_specs(m.fragment(), limits), check_codec(m.codec()), "tensors", out.tensors);
  if (!out.update) check_checksum(out.checksum, out.tensors, "FragmentParams");
  return out;
}

const wire::FragmentParams& open_params(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  return open_streamable<wire::FragmentParams>(bytes, limits, wire::VerifyFragmentParamsBuffer, "FragmentParams");
}

std::string version_of(uint32_t fragment, uint64_t version) {
  return detail::concat("fragment ", fragment, " version ", version);
}

}  // namespace

namespace {

std::vector<uint8_t> encode_snapshot(const FragmentParams& header, std::span<const DenseTensor> values,
                                     int zstd_level) {
  DILOCO_ENFORCE(!header.update, "encode_fragment_params writes snapshots; updates use encode_fragment_update");
  auto& fbb = builder();
  const auto tensors = add_dense(fbb, values, kSnapshotCodec);
  const uint64_t checksum = header.checksum ? header.checksum : checksum_fp32(values);
  return finish_fragment_params(fbb, header, checksum, kSnapshotCodec, tensors, zstd_level);
}

}  // namespace

std::vector<uint8_t> encode_fragment_params(const FragmentParams& msg, int zstd_level) {
  return encode_snapshot(msg, msg.tensors, zstd_level);
}

std::vector<uint8_t> encode_fragment_update(const FragmentParams& msg,
                                            std::span<const QuantizedTensor> change,
                                            const CodecOptions& options) {
  DILOCO_ENFORCE(msg.update && msg.base_version + 1 == msg.version,
                 "encode_fragment_update needs an update of base_version = version - 1");
  const WireCodec codec = codec_of(options);
  auto& fbb = builder();
  const auto tensors = add_quantized(fbb, change, codec);
  return finish_fragment_params(fbb, msg, msg.checksum, codec, tensors, options.zstd_level);
}

FragmentParams decode_fragment_params(std::span<const uint8_t> bytes,
                                      const DecodeLimits& limits) {
  const auto& m = open_params(bytes, limits);
  if (m.segment())
    reject(RejectReason::ChunkMismatch,
           detail::concat("FragmentParams: segment ", m.segment()->index(), " of ", m.segment()->count(),
                          " of a streamed snapshot (read it with a FragmentParamsAssembler)"));
  return decode_whole_params(m, limits, bytes.size());
}

uint32_t fragment_params_segments(const FragmentParams& header, std::span<const DenseTensor> tensors,
                                  uint64_t segment_bytes) {
  if (header.update) throw InvalidInput("updates travel whole, never in segments");
  uint64_t values = 0;
  for (const auto& t : tensors) values += t.values.size();
  return segments_for(values, 4, segment_bytes, "snapshot");
}

void for_each_fragment_params_segment(const FragmentParams& header, std::span<const DenseTensor> tensors,
                                      uint64_t segment_bytes, int zstd_level, const SegmentSink& emit) {
  const uint32_t count = fragment_params_segments(header, tensors, segment_bytes);
  if (count == 1) {
    emit(0, 1, encode_snapshot(header, tensors, zstd_level));
    return;
  }
  const uint64_t checksum = header.checksum ? header.checksum : checksum_fp32(tensors);
  uint64_t total = 0;
  for (const auto& t : tensors) total += t.values.size();
  for_each_range(total, count, [&](const SegmentRange& range) {
    auto fbb = segment_builder(range.values, tensors.size());
    const auto slices = add_dense_range(fbb, tensors, range.first, range.values, kSnapshotCodec);
    emit(range.index, count, finish_fragment_params(fbb, header, checksum, kSnapshotCodec, slices, zstd_level, &range));
  });
}

FragmentParamsAssembler::FragmentParamsAssembler(DecodeLimits limits) : limits_(std::move(limits)) {}

std::optional<FragmentParams> FragmentParamsAssembler::add(std::span<const uint8_t> bytes) {
  ReleaseScratch release;
  const auto& m = open_params(bytes, limits_);
  if (!m.segment()) return decode_whole_params(m, limits_, bytes.size());
  check_fingerprint(m.fingerprint(), limits_);
  const auto& specs = fragment_specs(m.fragment(), limits_);
  const uint32_t p = m.fragment();
  const wire::Segment& s = *m.segment();
  if (s.index() == 0) open_.erase(p);  // a newer snapshot, or this one again: the one begun is dropped
  auto it = open_.try_emplace(p).first;
  try {
    Open& o = it->second;
    const std::string about = version_of(p, m.version());
    check_segment_due(o.cursor, s, "FragmentParams", about);
    const WireCodec codec = check_codec(m.codec());
    if (codec.dtype != DType::F32 || m.update())
      reject(RejectReason::BadCodec, "FragmentParams: a segment of an update or of a quantized message (only fp32 "
                                     "snapshots travel in segments)");
    if (o.cursor.next == 0) {
      o.params = read_params_head(m, limits_);
      o.shuffled = codec.byte_shuffle;
      size_as_layout(specs, o.params.tensors);
      begin_segments(o.cursor, s, specs_values(specs));
    } else if (m.version() != o.params.version || m.checksum() != o.params.checksum || m.epoch() != o.params.epoch ||
               required(m.merger_instance(), "merger_instance") != o.params.merger_instance ||
               codec.byte_shuffle != o.shuffled) {
      reject(RejectReason::ChunkMismatch,
             detail::concat("FragmentParams: segment ", s.index(), " (", about, ", epoch ", m.epoch(),
                            ") does not continue ", version_of(p, o.params.version), " of merger ",
                            o.params.merger_instance, " epoch ", o.params.epoch));
    }
    const bool last = check_segment_range(o.cursor, s, "FragmentParams");
    decode_dense_range(m.tensors(), specs, codec, "tensors", s.first(), s.values(), o.params.tensors);
    o.params.wire_bytes += bytes.size();
    advance_segment(o.cursor, s);
    if (!last) return std::nullopt;
    check_checksum(o.params.checksum, o.params.tensors, "FragmentParams");
    FragmentParams out = std::move(o.params);
    open_.erase(it);
    return out;
  } catch (...) {
    open_.erase(it);
    throw;
  }
}

FragmentParams apply_fragment_update(const FragmentParams& held, const FragmentParams& update) {
  return apply_fragment_update(held, FragmentParams(update));
}

FragmentParams apply_fragment_update(const FragmentParams& held, FragmentParams&& update) {
  if (!update.update || held.update || held.fragment != update.fragment || held.version != update.base_version ||
      held.tensors.size() != update.tensors.size())
    throw InvalidInput(detail::concat("an update of fragment ", update.fragment, " from version ",
                                      update.base_version, " does not apply to version ", held.version,
                                      " of fragment ", held.fragment));
  for (size_t t = 0; t < update.tensors.size(); ++t)
    if (held.tensors[t].shape != update.tensors[t].shape)
      throw InvalidInput(detail::concat("an update of fragment ", update.fragment, ": tensor ", t,
                                        " does not have the held tensor's shape"));
  // The change's values become the new version's, element by element (apply_update).
  FragmentParams out = std::move(update);
  for (size_t t = 0; t < out.tensors.size(); ++t)
    apply_update(held.tensors[t].values, out.tensors[t].values, out.tensors[t].values);
  out.update = false;
  out.base_version = 0;
  const uint64_t actual = checksum_fp32(out.tensors);
  if (actual != out.checksum)
    reject(RejectReason::CorruptFrame,
           detail::concat("update of fragment ", out.fragment, " to version ", out.version,
                          ": the reconstruction has checksum ", actual, ", the merger's is ", out.checksum));
  return out;
}

// ---- FragmentState --------------------------------------------------------------------------

namespace {

// The checkpoint's tensor lists, in the order every segment carries them.
std::array<const std::vector<DenseTensor>*, 4> state_lists(const FragmentState& msg) {
  return {&msg.params, &msg.momentum, &msg.outer_state, &msg.downlink_residual};
}

// Bytes of values per value of params: 4 for every list the checkpoint has.
uint64_t state_bytes_per_value(const FragmentState& msg) {
  uint64_t lists = 0;
  for (const auto* list : state_lists(msg)) lists += list->empty() ? 0 : 1;
  return 4 * lists;
}

// The whole checkpoint (segment null), or one segment of it: the tensor lists' range of values,
// and in segment 0 everything else the checkpoint has. Built in a builder of its own, sized up
// front: a checkpoint is the largest message (12 bytes per parameter and more), so the thread's
// scratch builder would grow in steps (holding the old and the new buffer at each) and then keep
// that size for good.
std::vector<uint8_t> build_fragment_state(const FragmentState& msg, const SegmentRange* segment, int zstd_level) {
  DILOCO_ENFORCE(msg.layout != nullptr, "encode_fragment_state needs the run's layout");
  DILOCO_ENFORCE(msg.layout->fingerprint == msg.fingerprint, "a checkpoint's layout must give its fingerprint");
  const bool head = segment == nullptr || segment->index == 0;
  uint64_t estimate = 1 << 16;
  if (segment)
    estimate += segment->values * state_bytes_per_value(msg) + 4096;
  else
    for (const auto* list : state_lists(msg))
      for (const auto& t : *list) estimate += t.values.size() * 4 + 256;
  if (head)
    estimate += (msg.consumed.size() + msg.recent.size()) * 96 + (msg.accounted.size() + msg.merged_bases.size()) * 96;
  flatbuffers::FlatBufferBuilder fbb(std::min<uint64_t>(estimate, FLATBUFFERS_MAX_BUFFER_SIZE));
  auto add_list = [&](const std::vector<DenseTensor>& list) {
    if (!segment) return add_dense(fbb, list, kStateCodec);
    if (list.empty()) return fbb.CreateVector(std::vector<flatbuffers::Offset<wire::Tensor>>{});
    return add_dense_range(fbb, list, segment->first, segment->values, kStateCodec);
  };
  const auto params = add_list(msg.params);
  const auto momentum = add_list(msg.momentum);
  const auto outer_state = add_list(msg.outer_state);
  const auto downlink_residual = add_list(msg.downlink_residual);
  flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::LogPosition>>> consumed_vector = 0;
  flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::LearnerSeq>>> accounted_vector = 0;
  flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::LearnerSeq>>> merged_bases_vector = 0;
  flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::LogPosition>>> recent_vector = 0;
  flatbuffers::Offset<wire::LogPosition> last_merge = 0;
  flatbuffers::Offset<wire::ModelLayout> layout = 0;
  if (head) {
    std::vector<flatbuffers::Offset<wire::LogPosition>> consumed;
    consumed.reserve(msg.consumed.size());
    for (const auto& p : msg.consumed) consumed.push_back(add_position(fbb, p));
    consumed_vector = fbb.CreateVector(consumed);
    if (msg.last_merge) last_merge = add_position(fbb, *msg.last_merge);
    auto learner_seqs = [&](const std::map<std::string, uint64_t>& by_learner) {
      std::vector<flatbuffers::Offset<wire::LearnerSeq>> out;
      out.reserve(by_learner.size());
      for (const auto& [learner, seq] : by_learner)
        out.push_back(wire::CreateLearnerSeq(fbb, fbb.CreateString(learner), seq));
      return fbb.CreateVector(out);
    };
    accounted_vector = learner_seqs(msg.accounted);
    merged_bases_vector = learner_seqs(msg.merged_bases);
    std::vector<flatbuffers::Offset<wire::LogPosition>> recent;
    recent.reserve(msg.recent.size());
    for (const auto& p : msg.recent) recent.push_back(add_position(fbb, p));
    recent_vector = fbb.CreateVector(recent);
    layout = add_model_layout(fbb, *msg.layout);
  }
  const auto segment_table =
      segment ? wire::CreateSegment(fbb, segment->index, segment->count, segment->first, segment->values) : 0;
  const auto run_id = fbb.CreateString(msg.run_id);
  const uint64_t checksum = msg.checksum ? msg.checksum : checksum_fp32(msg.params);
  const auto root = wire::CreateFragmentState(
      fbb, segment ? kSegmentSchemaVersion : kSchemaVersion, run_id, msg.fingerprint, msg.fragment, msg.version,
      params, momentum, consumed_vector, last_merge, checksum, accounted_vector, outer_state, merged_bases_vector,
      recent_vector, downlink_residual, layout,
      head && msg.optimizer ? flatbuffers::Optional<uint8_t>(static_cast<uint8_t>(*msg.optimizer))
                            : flatbuffers::nullopt,
      head ? msg.optimizer_since : 0, segment_table);
  wire::FinishFragmentStateBuffer(fbb, root);
  return compress_finished(fbb, zstd_level);
}

// Everything of a whole checkpoint or of a streamed one's segment 0 but the tensor lists: the
// header, the bookkeeping, the optimizer. `specs` is set to the fragment's tensors.
void read_state_head(const wire::FragmentState& m, const DecodeLimits& limits, FragmentState& out,
                     const std::vector<TensorSpec>*& specs) {
  specs = &self_described_specs(m.layout(), m.fingerprint(), m.fragment(), limits, out.layout);
  out.run_id = m.run_id()->str();
  out.fingerprint = m.fingerprint();
  out.fragment = m.fragment();
  out.version = m.version();
  check_counter(out.version, "version");
  out.checksum = m.checksum();
  if (m.consumed())
    for (const auto* p : *m.consumed()) out.consumed.push_back(read_position(p, "consumed"));
  if (m.last_merge()) out.last_merge = read_position(m.last_merge(), "last_merge");
  auto read_learner_seqs = [](const auto* list, const char* field, std::map<std::string, uint64_t>& into) {
    if (!list) return;
    for (const auto* a : *list) {
      if (!a->learner_id() || a->learner_id()->size() == 0)
        throw Rejection(RejectReason::MissingField,
                        detail::concat("FragmentState.", field, ": learner id missing"));
      check_counter(a->seq(), field);
      into[a->learner_id()->str()] = a->seq();
    }
  };
  read_learner_seqs(m.accounted(), "accounted", out.accounted);
  read_learner_seqs(m.merged_bases(), "merged_bases", out.merged_bases);
  if (m.recent())
    for (const auto* p : *m.recent()) out.recent.insert(read_position(p, "recent"));
  if (m.optimizer().has_value()) {
    if (*m.optimizer() > static_cast<uint8_t>(OuterOptimizerKind::Cgad))
      throw Rejection(RejectReason::BadFlatbuffer,
                      detail::concat("FragmentState.optimizer: unknown value ", int{*m.optimizer()}));
    out.optimizer = static_cast<OuterOptimizerKind>(*m.optimizer());
  }
  out.optimizer_since = m.optimizer_since();
  if (out.optimizer_since > out.version)
    throw Rejection(RejectReason::BadFlatbuffer, detail::concat("FragmentState.optimizer_since ", out.optimizer_since,
                                                                " is above its version ", out.version));
}

bool has_tensors(const TensorVector* list) { return list && list->size() != 0; }

const wire::FragmentState& open_state(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  return open_streamable<wire::FragmentState>(bytes, limits, wire::VerifyFragmentStateBuffer, "FragmentState");
}

}  // namespace

std::vector<uint8_t> encode_fragment_state(const FragmentState& msg, int zstd_level) {
  return build_fragment_state(msg, nullptr, zstd_level);
}

namespace {
FragmentState decode_whole_state(const wire::FragmentState& m, const DecodeLimits& limits, StateParts parts);
}  // namespace

FragmentState decode_fragment_state(std::span<const uint8_t> bytes, const DecodeLimits& limits, StateParts parts) {
  ReleaseScratch release;  // after the copy out, and on a rejection too
  const auto& m = open_state(bytes, limits);
  if (m.segment())
    reject(RejectReason::ChunkMismatch,
           detail::concat("FragmentState: segment ", m.segment()->index(), " of ", m.segment()->count(),
                          " of a streamed checkpoint (read it with a FragmentStateAssembler)"));
  return decode_whole_state(m, limits, parts);
}

namespace {

// A whole checkpoint from its opened frame (shared with FragmentStateAssembler, which has
// opened it already: the frame is decompressed once).
FragmentState decode_whole_state(const wire::FragmentState& m, const DecodeLimits& limits, StateParts parts) {
  FragmentState out;
  const std::vector<TensorSpec>* specs = nullptr;
  read_state_head(m, limits, out, specs);
  decode_tensors(m.params(), *specs, kStateCodec, "params", out.params);
  const bool all = parts == StateParts::All;
  // No momentum (an optimizer without one) is an empty list; otherwise it mirrors params.
  if (all && has_tensors(m.momentum())) decode_tensors(m.momentum(), *specs, kStateCodec, "momentum", out.momentum);
  // Absent in states of Nesterov and Sgd and in older checkpoints; otherwise it mirrors params.
  if (all && has_tensors(m.outer_state()))
    decode_tensors(m.outer_state(), *specs, kStateCodec, "outer_state", out.outer_state);
  // Absent with an fp32 downlink and in older checkpoints; otherwise it mirrors params.
  if (all && has_tensors(m.downlink_residual()))
    decode_tensors(m.downlink_residual(), *specs, kStateCodec, "downlink_residual", out.downlink_residual);
  check_checksum(out.checksum, out.params, "FragmentState");
  return out;
}

}  // namespace

// ---- streamed checkpoints -------------------------------------------------------------------

uint32_t fragment_state_segments(const FragmentState& msg, uint64_t segment_bytes) {
  return segments_for(fragment_values(msg.params), state_bytes_per_value(msg), segment_bytes, "checkpoint");
}

void for_each_fragment_state_segment(const FragmentState& msg, uint64_t segment_bytes, int zstd_level,
                                     const SegmentSink& emit) {
  const uint32_t count = fragment_state_segments(msg, segment_bytes);
  if (count == 1) {
    emit(0, 1, build_fragment_state(msg, nullptr, zstd_level));
    return;
  }
  const uint64_t total = fragment_values(msg.params);
  for (const auto* list : state_lists(msg))
    if (!list->empty() && fragment_values(*list) != total)
      throw InvalidInput("a checkpoint's tensor lists must hold as many values as its params");
  for_each_range(total, count, [&](const SegmentRange& range) {
    emit(range.index, count, build_fragment_state(msg, &range, zstd_level));
  });
}

FragmentStateAssembler::FragmentStateAssembler(DecodeLimits limits, StateParts parts)
    : limits_(std::move(limits)), parts_(parts) {}

void FragmentStateAssembler::reset() {
  state_ = FragmentState{};
  cursor_ = SegmentCursor{};
  lists_ = {};
}

std::optional<FragmentState> FragmentStateAssembler::add(std::span<const uint8_t> bytes) {
  ReleaseScratch release;
  try {
    return add_opened(bytes);
  } catch (...) {
    reset();
    throw;
  }
}

std::optional<FragmentState> FragmentStateAssembler::add_opened(std::span<const uint8_t> bytes) {
  const auto& m = open_state(bytes, limits_);
  const auto* segment = m.segment();
  if (!segment) {
    if (cursor_.next != 0)
      reject(RejectReason::ChunkMissing,
             detail::concat("FragmentState: a whole checkpoint of fragment ", m.fragment(), " where segment ",
                            cursor_.next, " of ", cursor_.count, " of version ", state_.version, " was due"));
    return decode_whole_state(m, limits_, parts_);
  }
  const wire::Segment& s = *segment;
  check_segment_due(cursor_, s, "FragmentState", version_of(m.fragment(), m.version()));
  const std::array<const TensorVector*, 4> lists{m.params(), m.momentum(), m.outer_state(), m.downlink_residual()};
  const std::array<std::vector<DenseTensor>*, 4> into{&state_.params, &state_.momentum, &state_.outer_state,
                                                      &state_.downlink_residual};
  if (cursor_.next == 0) {
    read_state_head(m, limits_, state_, specs_);
    begin_segments(cursor_, s, specs_values(*specs_));
    if (on_begin_) on_begin_(state_);
    for (size_t l = 0; l < lists.size(); ++l) {
      lists_[l] = has_tensors(lists[l]);
      if (lists_[l] && (l == 0 || parts_ == StateParts::All)) size_as_layout(*specs_, *into[l]);
    }
    if (!lists_[0]) reject(RejectReason::MissingField, "FragmentState: segment 0 without params");
  } else if (m.fingerprint() != state_.fingerprint || m.fragment() != state_.fragment ||
             m.version() != state_.version || m.checksum() != state_.checksum) {
    reject(RejectReason::ChunkMismatch,
           detail::concat("FragmentState: segment ", s.index(), " (", version_of(m.fragment(), m.version()),
                          ") does not continue ", version_of(state_.fragment, state_.version)));
  }
  const bool last = check_segment_range(cursor_, s, "FragmentState");
  static constexpr std::array<const char*, 4> kNames{"params", "momentum", "outer_state", "downlink_residual"};
  for (size_t l = 0; l < lists.size(); ++l) {
    if (has_tensors(lists[l]) != lists_[l])
      reject(RejectReason::ChunkMismatch, detail::concat("FragmentState: segment ", s.index(),
                                                         lists_[l] ? " lacks " : " has ", kNames[l], ", segment 0 ",
                                                         lists_[l] ? "has" : "had none"));
    if (lists_[l] && (l == 0 || parts_ == StateParts::All))
      decode_dense_range(lists[l], *specs_, kStateCodec, kNames[l], s.first(), s.values(), *into[l]);
  }
  advance_segment(cursor_, s);
  if (!last) return std::nullopt;
  check_checksum(state_.checksum, state_.params, "FragmentState");
  FragmentState out = std::move(state_);
  reset();
  return out;
}

// ---- GenesisProposal --------------------------------------------------------------------------

namespace {

std::vector<uint8_t> build_genesis_proposal(const GenesisProposal& msg, uint64_t checksum, const SegmentRange* segment,
                                            int zstd_level) {
  DILOCO_ENFORCE(msg.layout != nullptr, "encode_genesis_proposal needs the model's layout");
  DILOCO_ENFORCE(msg.layout->fingerprint == msg.fingerprint, "a proposal's layout must give its fingerprint");
  auto own = segment ? std::optional(segment_builder(segment->values, msg.tensors.size())) : std::nullopt;
  auto& fbb = own ? *own : builder();
  const auto tensors = segment ? add_dense_range(fbb, msg.tensors, segment->first, segment->values, kGenesisCodec)
                               : add_dense(fbb, msg.tensors, kGenesisCodec);
  const bool head = !segment || segment->index == 0;
  const auto layout = head ? add_model_layout(fbb, *msg.layout) : 0;
  const auto run_id = fbb.CreateString(msg.run_id);
  const auto learner_id = fbb.CreateString(msg.learner_id);
  const auto region = fbb.CreateString(msg.region);
  const auto segment_table =
      segment ? wire::CreateSegment(fbb, segment->index, segment->count, segment->first, segment->values) : 0;
  const auto root = wire::CreateGenesisProposal(fbb, segment ? kSegmentSchemaVersion : kSchemaVersion, run_id,
                                                msg.fingerprint, learner_id, region, msg.fragment, msg.seq,
                                                msg.send_time_us, layout, checksum, tensors, segment_table);
  wire::FinishGenesisProposalBuffer(fbb, root);
  return compress_finished(fbb, zstd_level);
}

const wire::GenesisProposal& open_proposal(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  return open_streamable<wire::GenesisProposal>(bytes, limits, wire::VerifyGenesisProposalBuffer, "GenesisProposal");
}

// Everything but the tensors (and the layout, which the caller reads).
void read_proposal_head(const wire::GenesisProposal& m, GenesisProposal& out) {
  out.run_id = m.run_id()->str();
  out.fingerprint = m.fingerprint();
  out.learner_id = required(m.learner_id(), "learner_id");
  if (out.learner_id.empty()) reject(RejectReason::MissingField, "learner_id is empty");
  out.region = required(m.region(), "region");
  out.fragment = m.fragment();
  out.seq = m.seq();
  if (out.seq == 0) reject(RejectReason::BadCounter, "seq 0 (sequence numbers start at 1)");
  check_counter(out.seq, "seq");
  out.send_time_us = m.send_time_us();
  out.checksum = m.checksum();
}

}  // namespace

std::vector<uint8_t> encode_genesis_proposal(const GenesisProposal& msg, int zstd_level) {
  return build_genesis_proposal(msg, msg.checksum ? msg.checksum : checksum_fp32(msg.tensors), nullptr, zstd_level);
}

namespace {

GenesisProposal decode_whole_proposal(const wire::GenesisProposal& m, const DecodeLimits& limits, size_t wire_bytes) {
  GenesisProposal out;
  const auto& specs = self_described_specs(m.layout(), m.fingerprint(), m.fragment(), limits, out.layout);
  read_proposal_head(m, out);
  out.wire_bytes = wire_bytes;
  decode_tensors(m.tensors(), specs, kGenesisCodec, "tensors", out.tensors);
  check_checksum(out.checksum, out.tensors, "GenesisProposal");
  return out;
}

}  // namespace

GenesisProposal decode_genesis_proposal(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  const auto& m = open_proposal(bytes, limits);
  if (m.segment())
    reject(RejectReason::ChunkMismatch,
           detail::concat("GenesisProposal: segment ", m.segment()->index(), " of ", m.segment()->count(),
                          " of a streamed proposal (read it with a GenesisProposalAssembler)"));
  return decode_whole_proposal(m, limits, bytes.size());
}

uint32_t genesis_proposal_segment(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  ReleaseScratch release;
  const auto& m = open_proposal(bytes, limits);
  return m.segment() ? m.segment()->index() : 0;
}

uint32_t genesis_proposal_segments(const GenesisProposal& msg, uint64_t segment_bytes) {
  return segments_for(fragment_values(msg.tensors), 4, segment_bytes, "proposal");
}

void for_each_genesis_proposal_segment(const GenesisProposal& msg, uint64_t segment_bytes, int zstd_level,
                                       const SegmentSink& emit) {
  const uint32_t count = genesis_proposal_segments(msg, segment_bytes);
  const uint64_t checksum = msg.checksum ? msg.checksum : checksum_fp32(msg.tensors);
  if (count == 1) {
    emit(0, 1, build_genesis_proposal(msg, checksum, nullptr, zstd_level));
    return;
  }
  for_each_range(fragment_values(msg.tensors), count, [&](const SegmentRange& range) {
    emit(range.index, count, build_genesis_proposal(msg, checksum, &range, zstd_level));
  });
}

GenesisProposalAssembler::GenesisProposalAssembler(DecodeLimits limits, size_t max_open)
    : limits_(std::move(limits)), max_open_(max_open) {}

std::vector<LogPosition> GenesisProposalAssembler::open_heads() const {
  std::vector<LogPosition> out;
  for (const auto& [key, o] : open_) out.push_back(o.head);
  return out;
}

std::optional<GenesisProposal> GenesisProposalAssembler::add(std::span<const uint8_t> bytes, const LogPosition& at) {
  ReleaseScratch release;
  dropped_head_.reset();
  const auto& m = open_proposal(bytes, limits_);
  if (only_ && (m.fragment() != std::get<1>(*only_) || m.seq() != std::get<2>(*only_) || !m.learner_id() ||
                m.learner_id()->string_view() != std::get<0>(*only_)))
    return std::nullopt;
  if (!m.segment()) {
    auto whole = decode_whole_proposal(m, limits_, bytes.size());
    head_ = at;
    return whole;
  }
  const wire::Segment& s = *m.segment();
  const Key key{required(m.learner_id(), "learner_id"), m.fragment(), m.seq()};
  const std::string about = detail::concat("learner ", std::get<0>(key), "'s proposal of fragment ", m.fragment(),
                                           " (seq ", m.seq(), ")");
  if (s.index() == 0) {
    open_.erase(key);  // the same proposal sent again: the one begun is dropped
    if (open_.size() >= max_open_)
      reject(RejectReason::TooLarge, detail::concat("GenesisProposal: segment 0 of ", about, " while ", open_.size(),
                                                    " streamed proposals are begun (at most ", max_open_, ")"));
  }
  auto it = open_.try_emplace(key).first;
  try {
    Open& o = it->second;
    check_segment_due(o.cursor, s, "GenesisProposal", about);
    if (o.cursor.next == 0) {
      o.specs = &self_described_specs(m.layout(), m.fingerprint(), m.fragment(), limits_, o.proposal.layout);
      read_proposal_head(m, o.proposal);
      o.head = at;
      size_as_layout(*o.specs, o.proposal.tensors);
      begin_segments(o.cursor, s, specs_values(*o.specs));
    } else if (m.fingerprint() != o.proposal.fingerprint || m.checksum() != o.proposal.checksum || m.layout()) {
      reject(RejectReason::ChunkMismatch,
             detail::concat("GenesisProposal: segment ", s.index(), " of ", about,
                            m.layout() ? " carries a layout (segment 0 alone does)"
                                       : " disagrees with its segment 0 (fingerprint or checksum)"));
    }
    const bool last = check_segment_range(o.cursor, s, "GenesisProposal");
    decode_dense_range(m.tensors(), *o.specs, kGenesisCodec, "tensors", s.first(), s.values(), o.proposal.tensors);
    o.proposal.wire_bytes += bytes.size();
    advance_segment(o.cursor, s);
    if (!last) return std::nullopt;
    check_checksum(o.proposal.checksum, o.proposal.tensors, "GenesisProposal");
    GenesisProposal out = std::move(o.proposal);
    head_ = o.head;
    open_.erase(it);
    return out;
  } catch (...) {
    if (it->second.cursor.next > 0) dropped_head_ = it->second.head;
    open_.erase(it);
    throw;
  }
}

}  // namespace diloco
