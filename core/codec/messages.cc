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

std::vector<uint8_t> finish_fragment_params(flatbuffers::FlatBufferBuilder& fbb, const FragmentParams& msg,
                                            uint64_t checksum, const WireCodec& codec,
                                            flatbuffers::Offset<TensorVector> tensors, int zstd_level) {
  const auto codec_table = add_codec(fbb, codec);
  const auto run_id = fbb.CreateString(msg.run_id);
  const auto merger = fbb.CreateString(msg.merger_instance);
  const auto root = wire::CreateFragmentParams(fbb, kSchemaVersion, run_id, msg.fingerprint, msg.fragment,
                                               msg.version, checksum, merger, msg.epoch, codec_table, tensors,
                                               msg.update, msg.update ? msg.base_version : 0);
  wire::FinishFragmentParamsBuffer(fbb, root);
  return compress_finished(fbb, zstd_level);
}

}  // namespace

std::vector<uint8_t> encode_fragment_params(const FragmentParams& msg, int zstd_level) {
  DILOCO_ENFORCE(!msg.update, "encode_fragment_params writes snapshots; updates use encode_fragment_update");
  const WireCodec codec{.dtype = DType::F32, .block_size = 0, .byte_shuffle = true};
  auto& fbb = builder();
  const auto tensors = add_dense(fbb, msg.tensors, codec);
  const uint64_t checksum = msg.checksum ? msg.checksum : checksum_fp32(msg.tensors);
  return finish_fragment_params(fbb, msg, checksum, codec, tensors, zstd_level);
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
  const auto& m = open_root<wire::FragmentParams>(bytes, limits,
                                                  wire::VerifyFragmentParamsBuffer,
                                                  "FragmentParams");
  check_fingerprint(m.fingerprint(), limits);
  const auto& specs = fragment_specs(m.fragment(), limits);
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
  out.wire_bytes = bytes.size();
  if (out.update && out.base_version + 1 != out.version)
    reject(RejectReason::BadCounter, detail::concat("an update to version ", out.version, " from version ",
                                                    out.base_version, " (updates go one version at a time)"));
  if (!out.update && out.base_version != 0)
    reject(RejectReason::BadCounter, detail::concat("a snapshot with base_version ", out.base_version));
  decode_tensors(m.tensors(), specs, check_codec(m.codec()), "tensors", out.tensors);
  if (!out.update) check_checksum(out.checksum, out.tensors, "FragmentParams");
  return out;
}

FragmentParams apply_fragment_update(const FragmentParams& held, const FragmentParams& update) {
  if (!update.update || held.update || held.fragment != update.fragment || held.version != update.base_version ||
      held.tensors.size() != update.tensors.size())
    throw InvalidInput(detail::concat("an update of fragment ", update.fragment, " from version ",
                                      update.base_version, " does not apply to version ", held.version,
                                      " of fragment ", held.fragment));
  FragmentParams out = update;
  out.update = false;
  out.base_version = 0;
  for (size_t t = 0; t < out.tensors.size(); ++t) {
    if (held.tensors[t].shape != update.tensors[t].shape)
      throw InvalidInput(detail::concat("an update of fragment ", update.fragment, ": tensor ", t,
                                        " does not have the held tensor's shape"));
    apply_update(held.tensors[t].values, update.tensors[t].values, out.tensors[t].values);
  }
  const uint64_t actual = checksum_fp32(out.tensors);
  if (actual != update.checksum)
    reject(RejectReason::CorruptFrame,
           detail::concat("update of fragment ", update.fragment, " to version ", update.version,
                          ": the reconstruction has checksum ", actual, ", the merger's is ", update.checksum));
  return out;
}

// ---- FragmentState --------------------------------------------------------------------------

namespace {

// The checkpoint's tensor lists, in the order every segment carries them.
std::array<const std::vector<DenseTensor>*, 4> state_lists(const FragmentState& msg) {
  return {&msg.params, &msg.momentum, &msg.outer_state, &msg.downlink_residual};
}

uint64_t fragment_values(const std::vector<DenseTensor>& tensors) {
  uint64_t n = 0;
  for (const auto& t : tensors) n += t.values.size();
  return n;
}

// Bytes of values per value of params: 4 for every list the checkpoint has.
uint64_t state_bytes_per_value(const FragmentState& msg) {
  uint64_t lists = 0;
  for (const auto* list : state_lists(msg)) lists += list->empty() ? 0 : 1;
  return 4 * lists;
}

struct SegmentRange {
  uint32_t index = 0;
  uint32_t count = 1;
  uint64_t first = 0;
  uint64_t values = 0;
};

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

// The frame opened and checked as far as every FragmentState message goes: verifier, run id,
// and a schema version that says whole (1, no segment) or segment (2, with one).
const wire::FragmentState& open_state(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  const auto buf = open_frame(bytes, limits, wire::VerifyFragmentStateBuffer, "FragmentState");
  const auto& m = *flatbuffers::GetRoot<wire::FragmentState>(buf.data());
  const bool segment = m.segment() != nullptr;
  if (m.schema_version() != (segment ? kSegmentSchemaVersion : kSchemaVersion))
    reject(RejectReason::UnknownSchemaVersion,
           detail::concat("FragmentState: schema version ", m.schema_version(),
                          segment ? " for a segment (segments are version " : " (this build reads ",
                          segment ? kSegmentSchemaVersion : kSchemaVersion, ")"));
  check_run_id(m.run_id(), limits);
  return m;
}

}  // namespace

std::vector<uint8_t> encode_fragment_state(const FragmentState& msg, int zstd_level) {
  return build_fragment_state(msg, nullptr, zstd_level);
}

namespace {
FragmentState decode_whole_state(const wire::FragmentState& m, const DecodeLimits& limits, StateParts parts);
}  // namespace

FragmentState decode_fragment_state(std::span<const uint8_t> bytes, const DecodeLimits& limits, StateParts parts) {
  struct Release {
    ~Release() { release_large_scratch(); }
  } release;  // after the copy out, and on a rejection too
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
  if (segment_bytes == 0) throw InvalidInput("segment bytes must be positive");
  const uint64_t per_value = state_bytes_per_value(msg);
  const uint64_t total = fragment_values(msg.params);
  if (per_value == 0 || total == 0) return 1;
  const uint64_t values = std::max<uint64_t>(1, segment_bytes / per_value);
  const uint64_t count = (total + values - 1) / values;
  if (count > kMaxSegments)
    throw InvalidInput(detail::concat("a checkpoint of ", total * per_value, " bytes of values in segments of ",
                                      segment_bytes, " bytes takes ", count, " segments, above ", kMaxSegments));
  return static_cast<uint32_t>(count);
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
  const uint64_t per_segment = (total + count - 1) / count;
  SegmentRange range{.index = 0, .count = count};
  for (; range.index < count; ++range.index) {
    range.first = uint64_t{range.index} * per_segment;
    range.values = std::min(per_segment, total - range.first);
    emit(range.index, count, build_fragment_state(msg, &range, zstd_level));
  }
}

FragmentStateAssembler::FragmentStateAssembler(DecodeLimits limits, StateParts parts)
    : limits_(std::move(limits)), parts_(parts) {}

void FragmentStateAssembler::reset() {
  state_ = FragmentState{};
  next_ = 0;
  count_ = 0;
  next_value_ = 0;
  lists_ = {};
}

std::optional<FragmentState> FragmentStateAssembler::add(std::span<const uint8_t> bytes) {
  struct Release {
    ~Release() { release_large_scratch(); }
  } release;
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
    if (next_ != 0)
      reject(RejectReason::ChunkMissing,
             detail::concat("FragmentState: a whole checkpoint of fragment ", m.fragment(), " where segment ", next_,
                            " of ", count_, " of version ", state_.version, " was due"));
    return decode_whole_state(m, limits_, parts_);
  }
  if (segment->index() != next_) {
    if (next_ == 0)
      reject(RejectReason::ChunkMissing,
             detail::concat("FragmentState: segment ", segment->index(), " of ", segment->count(), " of fragment ",
                            m.fragment(), " version ", m.version(), " without its segment 0"));
    reject(RejectReason::ChunkMismatch,
           detail::concat("FragmentState: segment ", segment->index(), " where segment ", next_, " of ", count_,
                          " was due"));
  }
  if (next_ == 0) {
    if (segment->count() < 2 || segment->count() > kMaxSegments)
      reject(RejectReason::BadCounter, detail::concat("FragmentState: a streamed checkpoint of ", segment->count(),
                                                      " segments (2 to ", kMaxSegments, ")"));
    read_state_head(m, limits_, state_, specs_);
    count_ = segment->count();
    total_ = 0;
    for (const auto& spec : *specs_) total_ += static_cast<uint64_t>(spec.numel());
    const std::array<const TensorVector*, 4> lists{m.params(), m.momentum(), m.outer_state(), m.downlink_residual()};
    auto into = std::array<std::vector<DenseTensor>*, 4>{&state_.params, &state_.momentum, &state_.outer_state,
                                                         &state_.downlink_residual};
    for (size_t l = 0; l < lists.size(); ++l) {
      lists_[l] = has_tensors(lists[l]);
      if (!lists_[l] || (l > 0 && parts_ == StateParts::ParamsOnly)) continue;
      into[l]->resize(specs_->size());
      for (size_t k = 0; k < specs_->size(); ++k) {
        (*into[l])[k].index = static_cast<uint32_t>(k);
        (*into[l])[k].shape = (*specs_)[k].shape;
        (*into[l])[k].values.resize(static_cast<size_t>((*specs_)[k].numel()));
      }
    }
    if (!lists_[0]) reject(RejectReason::MissingField, "FragmentState: segment 0 without params");
  } else {
    if (segment->count() != count_ || m.fingerprint() != state_.fingerprint || m.fragment() != state_.fragment ||
        m.version() != state_.version || m.checksum() != state_.checksum)
      reject(RejectReason::ChunkMismatch,
             detail::concat("FragmentState: segment ", next_, " (fragment ", m.fragment(), ", version ", m.version(),
                            ", of ", segment->count(), ") does not continue fragment ", state_.fragment, " version ",
                            state_.version, " (of ", count_, ")"));
  }
  if (segment->first() != next_value_ || segment->values() == 0 || segment->values() > total_ - next_value_)
    reject(RejectReason::ChunkMismatch,
           detail::concat("FragmentState: segment ", next_, " holds values ", segment->first(), " + ",
                          segment->values(), ", the checkpoint's next value is ", next_value_, " of ", total_));
  const bool last = next_ + 1 == count_;
  if (last && segment->first() + segment->values() != total_)
    reject(RejectReason::ChunkMismatch,
           detail::concat("FragmentState: the last segment ends at value ", segment->first() + segment->values(),
                          ", the fragment holds ", total_));
  const std::array<const TensorVector*, 4> lists{m.params(), m.momentum(), m.outer_state(), m.downlink_residual()};
  const std::array<std::vector<DenseTensor>*, 4> into{&state_.params, &state_.momentum, &state_.outer_state,
                                                      &state_.downlink_residual};
  static constexpr std::array<const char*, 4> kNames{"params", "momentum", "outer_state", "downlink_residual"};
  for (size_t l = 0; l < lists.size(); ++l) {
    if (has_tensors(lists[l]) != lists_[l])
      reject(RejectReason::ChunkMismatch, detail::concat("FragmentState: segment ", next_, lists_[l] ? " lacks " : " has ",
                                                         kNames[l], ", segment 0 ", lists_[l] ? "has" : "had none"));
    if (lists_[l] && (l == 0 || parts_ == StateParts::All))
      decode_dense_range(lists[l], *specs_, kStateCodec, kNames[l], segment->first(), segment->values(), *into[l]);
  }
  next_value_ += segment->values();
  ++next_;
  if (!last) return std::nullopt;
  check_checksum(state_.checksum, state_.params, "FragmentState");
  FragmentState out = std::move(state_);
  reset();
  return out;
}

// ---- GenesisProposal --------------------------------------------------------------------------

std::vector<uint8_t> encode_genesis_proposal(const GenesisProposal& msg, int zstd_level) {
  DILOCO_ENFORCE(msg.layout != nullptr, "encode_genesis_proposal needs the model's layout");
  DILOCO_ENFORCE(msg.layout->fingerprint == msg.fingerprint, "a proposal's layout must give its fingerprint");
  auto& fbb = builder();
  const auto tensors = add_dense(fbb, msg.tensors, kGenesisCodec);
  const auto layout = add_model_layout(fbb, *msg.layout);
  const auto run_id = fbb.CreateString(msg.run_id);
  const auto learner_id = fbb.CreateString(msg.learner_id);
  const auto region = fbb.CreateString(msg.region);
  const uint64_t checksum = msg.checksum ? msg.checksum : checksum_fp32(msg.tensors);
  const auto root = wire::CreateGenesisProposal(fbb, kSchemaVersion, run_id, msg.fingerprint, learner_id, region,
                                                msg.fragment, msg.seq, msg.send_time_us, layout, checksum, tensors);
  wire::FinishGenesisProposalBuffer(fbb, root);
  return compress_finished(fbb, zstd_level);
}

GenesisProposal decode_genesis_proposal(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  const auto& m = open_root<wire::GenesisProposal>(bytes, limits, wire::VerifyGenesisProposalBuffer,
                                                   "GenesisProposal");
  GenesisProposal out;
  const auto& specs = self_described_specs(m.layout(), m.fingerprint(), m.fragment(), limits, out.layout);
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
  out.wire_bytes = bytes.size();
  decode_tensors(m.tensors(), specs, kGenesisCodec, "tensors", out.tensors);
  check_checksum(out.checksum, out.tensors, "GenesisProposal");
  return out;
}

}  // namespace diloco
