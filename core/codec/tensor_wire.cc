#include "core/codec/tensor_wire.h"

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "core/codec/compress.h"
#include "core/codec/shuffle.h"
#include "core/codec/sparse.h"
#include "core/fragments/partition.h"

namespace diloco::tensor_wire {
namespace {

// Verifier bounds: our deepest message is MergeRecord -> DroppedDelta -> DeltaRef -> LogPosition.
// The table budget leaves room for a fragment with many tensors (and for a hand-built message
// with 100000 empty tensors to reach the tensor count check), yet caps the work a buffer whose
// offsets all point at one table can cause.
constexpr flatbuffers::uoffset_t kMaxDepth = 16;
constexpr flatbuffers::uoffset_t kMaxTables = 1u << 18;
constexpr size_t kChunk = 32;

// Scratch buffers of the calling thread; they only grow (to the largest message seen).
struct Scratch {
  flatbuffers::FlatBufferBuilder fbb{1 << 16};
  std::vector<uint8_t> frame;   // decompressed message
  std::vector<uint8_t> bytes;   // byte-shuffle staging
  std::vector<float> scales;    // scales before they are copied into the builder
  std::vector<std::vector<uint8_t>> gaps;    // sparse forms before they are copied into the builder
  std::vector<std::vector<uint8_t>> values;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

size_t elem_size(DType dtype) {
  switch (dtype) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    default: return 1;
  }
}

bool shuffled(const WireCodec& c) { return c.byte_shuffle && elem_size(c.dtype) > 1; }

// True when no value is Inf or NaN (exponent bits all ones), without a branch per value.
bool all_finite(const float* __restrict v, size_t n) {
  constexpr uint32_t kExp = 0x7f800000u;
  uint32_t bad[kChunk] = {};
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk)
    for (size_t j = 0; j < kChunk; ++j)
      bad[j] |= static_cast<uint32_t>((std::bit_cast<uint32_t>(v[i + j]) & kExp) == kExp);
  uint32_t any = 0;
  for (size_t j = 0; j < kChunk; ++j) any |= bad[j];
  for (; i < n; ++i) any |= static_cast<uint32_t>((std::bit_cast<uint32_t>(v[i]) & kExp) == kExp);
  return any == 0;
}

std::string hex(uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string tensor_name(const std::vector<TensorSpec>& specs, size_t k) {
  return detail::concat("tensor ", k, " (", specs[k].name, ")");
}

// In place, for elements of at most 4 bytes (vector data is 4-byte aligned; see copy_vector).
template <typename T>
std::span<const T> span_of(const flatbuffers::Vector<T>* v) {
  static_assert(sizeof(T) <= 4);
  if (!v) return {};
  return {v->data(), v->size()};
}

// Scales are what make int8/int4 values finite: |q| <= 128, so a scale above FLT_MAX / 128
// could still overflow into Inf.
void check_scales(std::span<const float> scales, const std::string& what) {
  constexpr float kMaxScale = FLT_MAX / 128.0f;
  for (size_t i = 0; i < scales.size(); ++i) {
    const float s = scales[i];
    if (!std::isfinite(s))
      reject(RejectReason::NonFinite, detail::concat(what, ": scale ", i, " is ", s));
    // -0 too: no encoder writes it, and a value a sparse delta leaves out would read +0 when
    // dequantized sparse but 0 * -0 = -0 once unpacked.
    if (std::signbit(s)) reject(RejectReason::BadCodec, detail::concat(what, ": negative scale ", s));
    if (s > kMaxScale)
      reject(RejectReason::NonFinite, detail::concat(what, ": scale ", s, " overflows values"));
  }
}

// The tensor's shape against the layout's tensor k (ShapeMismatch).
void check_shape(const wire::Tensor& t, size_t k, const std::vector<TensorSpec>& specs) {
  const TensorSpec& spec = specs[k];
  const size_t rank = t.shape() ? t.shape()->size() : 0;
  if (rank != spec.shape.size())  // before copying: a hostile shape can be huge
    reject(RejectReason::ShapeMismatch, detail::concat(tensor_name(specs, k), ": rank ", rank,
                                                       ", layout says ", spec.shape.size()));
  const auto shape = copy_vector(t.shape());
  if (shape != spec.shape) {
    std::string got;
    for (auto d : shape) got += detail::concat(got.empty() ? "" : ",", d);
    std::string want;
    for (auto d : spec.shape) want += detail::concat(want.empty() ? "" : ",", d);
    reject(RejectReason::ShapeMismatch,
           tensor_name(specs, k) + ": shape [" + got + "], layout says [" + want + "]");
  }
}

void check_tensor(const wire::Tensor& t, size_t k, const std::vector<TensorSpec>& specs,
                  const WireCodec& codec) {
  if (t.index() != k)
    reject(RejectReason::ShapeMismatch,
           detail::concat("tensor at position ", k, " has index ", t.index()));
  check_shape(t, k, specs);
  if (t.offset() != 0)
    reject(RejectReason::ShapeMismatch,
           detail::concat(tensor_name(specs, k), ": offset ", t.offset(), " in a whole message"));
  const int64_t n = specs[k].numel();
  const size_t scales = t.scales() ? t.scales()->size() : 0;
  const size_t want_scales = num_blocks(codec.dtype, codec.block_size, n);
  if (scales != want_scales)
    reject(RejectReason::BadCodec, detail::concat(tensor_name(specs, k), ": ", scales,
                                                  " scales, expected ", want_scales));
  const size_t payload = t.payload() ? t.payload()->size() : 0;
  const size_t want_payload = codec.sparse ? 0 : payload_bytes(codec.dtype, n);
  if (payload != want_payload || (codec.sparse && t.payload()))
    reject(RejectReason::BadCodec, detail::concat(tensor_name(specs, k), ": payload of ", payload,
                                                  " bytes, expected ", want_payload,
                                                  codec.sparse ? " (sparse: no payload)" : ""));
  if (codec.sparse) {
    if (!t.gaps() || !t.values())
      reject(RejectReason::BadCodec, tensor_name(specs, k) + ": sparse without gaps or values");
    try {
      sparse_check(codec.dtype, codec.block_size, codec.topk, static_cast<size_t>(n), span_of(t.gaps()),
                   span_of(t.values()));
    } catch (const InvalidInput& e) {
      reject(RejectReason::BadCodec, tensor_name(specs, k) + ": " + e.what());
    }
  } else if (t.gaps() || t.values()) {
    reject(RejectReason::BadCodec, tensor_name(specs, k) + ": gaps or values without a sparse codec");
  }
  check_scales(span_of(t.scales()), tensor_name(specs, k));
}

void decode_tensor(const wire::Tensor& t, const WireCodec& codec, DenseTensor& out) {
  auto payload = span_of(t.payload());
  const auto scales = span_of(t.scales());
  if (codec.sparse) {
    sparse_dequantize(codec.dtype, codec.block_size, scales, span_of(t.gaps()), span_of(t.values()), out.values);
    return;
  }
  auto* out_bytes = reinterpret_cast<uint8_t*>(out.values.data());
  if (shuffled(codec) && codec.dtype == DType::F32) {
    byte_unshuffle(payload, {out_bytes, payload.size()}, 4);
    return;
  }
  if (shuffled(codec)) {
    auto& staging = scratch().bytes;
    staging.resize(payload.size());
    byte_unshuffle(payload, staging, elem_size(codec.dtype));
    payload = staging;
  }
  dequantize_into(codec.dtype, codec.block_size, scales, payload, out.values);
}

// The caller's tensor holds as many values as its shape says (InvalidInput otherwise).
void check_values_fit_shape(const DenseTensor& t) {
  int64_t numel = 1;
  for (auto d : t.shape)
    if (d < 0 || __builtin_mul_overflow(numel, d, &numel))
      throw InvalidInput(detail::concat("tensor ", t.index, ": bad dimension ", d));
  if (static_cast<size_t>(numel) != t.values.size())
    throw InvalidInput(detail::concat("tensor ", t.index, ": shape holds ", numel, " values, got ",
                                      t.values.size()));
}

}  // namespace

// ---- framing --------------------------------------------------------------------------------

flatbuffers::FlatBufferBuilder& builder() {
  auto& fbb = scratch().fbb;
  fbb.Clear();
  return fbb;
}

std::vector<uint8_t> compress_finished(const flatbuffers::FlatBufferBuilder& fbb,
                                       int zstd_level) {
  return zstd_compress({fbb.GetBufferPointer(), fbb.GetSize()}, zstd_level);
}

void release_large_scratch() {
  auto& s = scratch();
  if (s.frame.capacity() > kKeptScratchBytes) std::vector<uint8_t>().swap(s.frame);
  if (s.bytes.capacity() > kKeptScratchBytes) std::vector<uint8_t>().swap(s.bytes);
}

void reject(RejectReason reason, const std::string& detail) { throw Rejection(reason, detail); }

std::span<const uint8_t> open_frame(std::span<const uint8_t> bytes, const DecodeLimits& limits,
                                    bool (*verify)(flatbuffers::Verifier&), const char* what) {
  if (bytes.size() > limits.max_message_bytes)
    reject(RejectReason::TooLarge, detail::concat(what, ": ", bytes.size(), " bytes, limit ",
                                                  limits.max_message_bytes));
  // FlatBuffers cannot address more than 2 GiB, whatever the configured limit.
  const uint64_t max_bytes =
      std::min<uint64_t>(limits.max_decompressed_bytes, FLATBUFFERS_MAX_BUFFER_SIZE - 1);
  auto& frame = scratch().frame;
  zstd_decompress_bounded_into(bytes, max_bytes, frame);
  flatbuffers::Verifier::Options options;
  options.max_depth = kMaxDepth;
  options.max_tables = kMaxTables;
  flatbuffers::Verifier verifier(frame.data(), frame.size(), options);
  if (!verify(verifier))
    reject(RejectReason::BadFlatbuffer,
           detail::concat(what, ": FlatBuffers verification failed (", frame.size(),
                          " bytes; wrong file identifier, or a malformed or truncated buffer)"));
  return frame;
}

void check_schema_version(uint16_t version, const char* what) {
  if (version != kSchemaVersion)
    reject(RejectReason::UnknownSchemaVersion,
           detail::concat(what, ": schema version ", version, ", this build reads ",
                          kSchemaVersion));
}

void check_run_id(const flatbuffers::String* run_id, const DecodeLimits& limits) {
  const std::string got = required(run_id, "run_id");
  if (got != limits.run_id)
    reject(RejectReason::WrongRunId, "run id '" + got + "', expected '" + limits.run_id + "'");
}

void check_fingerprint(uint64_t fingerprint, const DecodeLimits& limits) {
  if (fingerprint != limits.fingerprint)
    reject(RejectReason::WrongFingerprint,
           "fingerprint " + hex(fingerprint) + ", expected " + hex(limits.fingerprint));
}

const std::vector<TensorSpec>& fragment_specs(uint32_t fragment, const DecodeLimits& limits) {
  DILOCO_ENFORCE(limits.layout != nullptr, "decoding tensors needs DecodeLimits::layout");
  if (fragment >= limits.layout->num_fragments())
    reject(RejectReason::FragmentOutOfRange,
           detail::concat("fragment ", fragment, ", layout has ", limits.layout->num_fragments()));
  return limits.layout->fragments[fragment];
}

std::string required(const flatbuffers::String* s, const char* field) {
  if (!s) reject(RejectReason::MissingField, std::string(field) + " is missing");
  return s->str();
}

flatbuffers::Offset<wire::LogPosition> add_position(flatbuffers::FlatBufferBuilder& fbb,
                                                     const LogPosition& p) {
  const auto topic = fbb.CreateString(p.topic);
  return wire::CreateLogPosition(fbb, topic, p.partition, p.offset);
}

LogPosition read_position(const wire::LogPosition* p, const char* field) {
  if (!p) reject(RejectReason::MissingField, std::string(field) + " is missing");
  return {required(p->topic(), "topic"), p->partition(), p->offset()};
}

void check_counter(uint64_t value, const char* field) {
  if (value > kMaxCounter)
    reject(RejectReason::BadCounter, detail::concat(field, " ", value, " is absurd"));
}

// ---- model layouts --------------------------------------------------------------------------

flatbuffers::Offset<wire::ModelLayout> add_model_layout(flatbuffers::FlatBufferBuilder& fbb,
                                                        const FragmentLayout& layout) {
  std::vector<flatbuffers::Offset<wire::TensorSpec>> tensors;
  tensors.reserve(layout.tensors.size());
  for (const auto& t : layout.tensors)
    tensors.push_back(wire::CreateTensorSpec(fbb, fbb.CreateString(t.name), fbb.CreateVector(t.shape)));
  return wire::CreateModelLayout(fbb, layout.num_fragments(), fbb.CreateVector(tensors));
}

std::shared_ptr<const FragmentLayout> read_model_layout(const wire::ModelLayout* layout, uint64_t fingerprint) {
  if (!layout || !layout->tensors()) reject(RejectReason::MissingField, "layout is missing");
  if (layout->tensors()->size() > kMaxTensors)
    reject(RejectReason::BadLayout, detail::concat(layout->tensors()->size(), " tensors, at most ", kMaxTensors));
  std::vector<TensorSpec> specs;
  specs.reserve(layout->tensors()->size());
  for (const auto* t : *layout->tensors()) {
    if (!t->name()) reject(RejectReason::MissingField, "layout: a tensor without a name");
    if (t->shape() && t->shape()->size() > kMaxTensorDims)
      reject(RejectReason::BadLayout, detail::concat("layout: tensor '", t->name()->str().substr(0, 64), "' has ",
                                                     t->shape()->size(), " dimensions"));
    specs.push_back(TensorSpec{t->name()->str(), copy_vector(t->shape())});
  }
  std::shared_ptr<FragmentLayout> out;
  try {
    out = std::make_shared<FragmentLayout>(partition_tensors(specs, layout->fragments()));
  } catch (const InvalidInput& e) {
    reject(RejectReason::BadLayout, std::string("layout: ") + e.what());
  }
  if (out->fingerprint != fingerprint)
    reject(RejectReason::BadLayout, "the layout gives fingerprint " + hex(out->fingerprint) + ", the message says " +
                                        hex(fingerprint));
  return out;
}

const std::vector<TensorSpec>& self_described_specs(const wire::ModelLayout* layout, uint64_t fingerprint,
                                                    uint32_t fragment, const DecodeLimits& limits,
                                                    std::shared_ptr<const FragmentLayout>& own) {
  if (limits.layout) {
    check_fingerprint(fingerprint, limits);
    if (!layout) reject(RejectReason::MissingField, "layout is missing");
    own.reset();
    return fragment_specs(fragment, limits);
  }
  own = read_model_layout(layout, fingerprint);
  if (fragment >= own->num_fragments())
    reject(RejectReason::FragmentOutOfRange, detail::concat("fragment ", fragment, ", its layout has ",
                                                            own->num_fragments()));
  return own->fragments[fragment];
}

// ---- tensors: encoding ----------------------------------------------------------------------

WireCodec codec_of(const CodecOptions& options) {
  WireCodec c;
  c.dtype = options.dtype;
  c.byte_shuffle = options.byte_shuffle;
  switch (options.dtype) {
    case DType::F32:
    case DType::BF16: break;
    case DType::INT8:
    case DType::INT4:
      if (options.block_size < 1 || options.block_size > kMaxBlockSize)
        throw InvalidInput(detail::concat("codec: block size ", options.block_size,
                                          " not in [1, ", kMaxBlockSize, "]"));
      c.block_size = options.block_size;
      check_topk(options.dtype, options.block_size, options.topk, "codec: topk");
      c.topk = options.topk;
      c.sparse = options.topk > 0;
      break;
    default:
      throw InvalidInput(detail::concat("codec: unknown dtype ", static_cast<int>(options.dtype)));
  }
  return c;
}

flatbuffers::Offset<wire::Codec> add_codec(flatbuffers::FlatBufferBuilder& fbb,
                                           const WireCodec& c) {
  return wire::CreateCodec(fbb, static_cast<wire::DType>(c.dtype), c.block_size, c.byte_shuffle, c.topk, c.sparse);
}

flatbuffers::Offset<TensorVector> add_dense(flatbuffers::FlatBufferBuilder& fbb,
                                            std::span<const DenseTensor> tensors,
                                            const WireCodec& codec) {
  auto& s = scratch();
  std::vector<flatbuffers::Offset<wire::Tensor>> offsets;
  offsets.reserve(tensors.size());
  for (const auto& t : tensors) {
    check_values_fit_shape(t);
    const size_t n = t.values.size();
    const size_t bytes = payload_bytes(codec.dtype, static_cast<int64_t>(n));
    if (bytes + (fbb.GetSize() + (64 << 10)) >= FLATBUFFERS_MAX_BUFFER_SIZE)
      throw InvalidInput("message above the 2 GiB FlatBuffers limit");
    s.scales.resize(num_blocks(codec.dtype, codec.block_size, static_cast<int64_t>(n)));
    // The payload pointer is only valid until the builder grows again: fill it right away.
    uint8_t* payload_ptr = nullptr;
    const auto payload = fbb.CreateUninitializedVector(bytes, &payload_ptr);
    const std::span<uint8_t> out(payload_ptr, bytes);
    if (!shuffled(codec)) {
      quantize_into(t.values, codec.dtype, codec.block_size, s.scales, out);
    } else if (codec.dtype == DType::F32) {
      byte_shuffle({reinterpret_cast<const uint8_t*>(t.values.data()), bytes}, out, 4);
    } else {
      s.bytes.resize(bytes);
      quantize_into(t.values, codec.dtype, codec.block_size, s.scales, s.bytes);
      byte_shuffle(s.bytes, out, elem_size(codec.dtype));
    }
    const auto scales = s.scales.empty() ? 0 : fbb.CreateVector(s.scales);
    const auto shape = fbb.CreateVector(t.shape);
    offsets.push_back(wire::CreateTensor(fbb, t.index, shape, scales, payload));
  }
  return fbb.CreateVector(offsets);
}

flatbuffers::Offset<TensorVector> add_quantized(flatbuffers::FlatBufferBuilder& fbb,
                                                std::span<const QuantizedTensor> tensors,
                                                const WireCodec& codec) {
  for (const auto& t : tensors) {  // all checks first: never half-build a message
    if (t.dtype != codec.dtype)
      throw InvalidInput(detail::concat("tensor ", t.index, ": dtype ", dtype_name(t.dtype),
                                        ", codec says ", dtype_name(codec.dtype)));
    if (codec.block_size != 0 && t.block_size != codec.block_size)
      throw InvalidInput(detail::concat("tensor ", t.index, ": block size ", t.block_size,
                                        ", codec says ", codec.block_size));
    const int64_t n = t.numel();
    if (t.scales.size() != num_blocks(codec.dtype, codec.block_size, n) ||
        t.payload.size() != payload_bytes(codec.dtype, n))
      throw InvalidInput(detail::concat("tensor ", t.index, ": ", t.scales.size(), " scales and ",
                                        t.payload.size(), " payload bytes for ", n, " values"));
  }
  std::vector<flatbuffers::Offset<wire::Tensor>> offsets;
  offsets.reserve(tensors.size());
  if (codec.sparse) {
    auto& s = scratch();
    if (s.gaps.size() < tensors.size()) {
      s.gaps.resize(tensors.size());
      s.values.resize(tensors.size());
    }
    for (size_t k = 0; k < tensors.size(); ++k)  // every tensor packed (and checked) before the builder is touched
      sparse_pack(codec.dtype, codec.block_size, codec.topk, static_cast<size_t>(tensors[k].numel()),
                  tensors[k].payload, s.gaps[k], s.values[k]);
    for (size_t k = 0; k < tensors.size(); ++k) {
      const auto& t = tensors[k];
      if (s.gaps[k].size() + s.values[k].size() + (fbb.GetSize() + (64 << 10)) >= FLATBUFFERS_MAX_BUFFER_SIZE)
        throw InvalidInput("message above the 2 GiB FlatBuffers limit");
      const auto values = fbb.CreateVector(s.values[k]);
      const auto gaps = fbb.CreateVector(s.gaps[k]);
      const auto scales = t.scales.empty() ? 0 : fbb.CreateVector(t.scales);
      const auto shape = fbb.CreateVector(t.shape);
      offsets.push_back(wire::CreateTensor(fbb, t.index, shape, scales, 0, gaps, values));
    }
    return fbb.CreateVector(offsets);
  }
  for (const auto& t : tensors) {
    if (t.payload.size() + (fbb.GetSize() + (64 << 10)) >= FLATBUFFERS_MAX_BUFFER_SIZE)
      throw InvalidInput("message above the 2 GiB FlatBuffers limit");
    uint8_t* payload_ptr = nullptr;
    const auto payload = fbb.CreateUninitializedVector(t.payload.size(), &payload_ptr);
    const std::span<uint8_t> out(payload_ptr, t.payload.size());
    if (shuffled(codec)) byte_shuffle(t.payload, out, elem_size(codec.dtype));
    else if (!t.payload.empty()) std::memcpy(payload_ptr, t.payload.data(), t.payload.size());
    const auto scales = t.scales.empty() ? 0 : fbb.CreateVector(t.scales);
    const auto shape = fbb.CreateVector(t.shape);
    offsets.push_back(wire::CreateTensor(fbb, t.index, shape, scales, payload));
  }
  return fbb.CreateVector(offsets);
}

// ---- tensors: decoding ----------------------------------------------------------------------

WireCodec check_codec(const wire::Codec* codec) {
  if (!codec) reject(RejectReason::MissingField, "codec is missing");
  WireCodec c;
  const auto raw = static_cast<uint8_t>(codec->dtype());
  if (raw > static_cast<uint8_t>(DType::INT4))
    reject(RejectReason::BadCodec, detail::concat("unknown dtype ", static_cast<int>(raw)));
  c.dtype = static_cast<DType>(raw);
  c.byte_shuffle = codec->byte_shuffle();
  const uint32_t block = codec->block_size();
  if (c.dtype == DType::INT8 || c.dtype == DType::INT4) {
    if (block < 1 || block > kMaxBlockSize)
      reject(RejectReason::BadCodec, detail::concat(dtype_name(c.dtype), ": block size ", block,
                                                    " not in [1, ", kMaxBlockSize, "]"));
    c.block_size = block;
  } else if (block != 0) {
    reject(RejectReason::BadCodec,
           detail::concat(dtype_name(c.dtype), ": block size ", block, ", expected 0"));
  }
  c.topk = codec->topk();
  if (c.topk != 0 && c.topk >= c.block_size)  // also rejects topk with F32 and BF16 (block size 0)
    reject(RejectReason::BadCodec, detail::concat(dtype_name(c.dtype), ": topk ", c.topk, " with block size ",
                                                  c.block_size, " (it must be below the block size, or 0)"));
  c.sparse = codec->sparse();
  if (c.sparse && c.topk == 0)  // topk > 0 implies INT8 or INT4 (above)
    reject(RejectReason::BadCodec, detail::concat(dtype_name(c.dtype), ": sparse tensors need topk > 0"));
  return c;
}

namespace {

// Every check of decode_tensors that needs no decoding: the count, then each tensor's index,
// shape, scales and payload size.
void check_tensors(const TensorVector* tensors, const std::vector<TensorSpec>& specs, const WireCodec& codec,
                   const char* field) {
  if (!tensors) reject(RejectReason::MissingField, std::string(field) + " is missing");
  if (tensors->size() != specs.size())
    reject(RejectReason::TensorCountMismatch, detail::concat(field, ": ", tensors->size(),
                                                             " tensors, layout has ",
                                                             specs.size()));
  for (size_t k = 0; k < specs.size(); ++k) check_tensor(*tensors->Get(k), k, specs, codec);
}

}  // namespace

void decode_tensors(const TensorVector* tensors, const std::vector<TensorSpec>& specs,
                    const WireCodec& codec, const char* field, std::vector<DenseTensor>& out) {
  check_tensors(tensors, specs, codec, field);
  out.resize(specs.size());
  for (size_t k = 0; k < specs.size(); ++k) {
    DenseTensor& t = out[k];
    t.index = static_cast<uint32_t>(k);
    t.shape = specs[k].shape;
    t.values.resize(static_cast<size_t>(specs[k].numel()));
    decode_tensor(*tensors->Get(k), codec, t);
    // int8/int4 values are finite by construction once their scales are (checked above).
    if ((codec.dtype == DType::F32 || codec.dtype == DType::BF16) &&
        !all_finite(t.values.data(), t.values.size()))
      reject(RejectReason::NonFinite, tensor_name(specs, k) + ": NaN or Inf in values");
  }
}

void decode_quantized(const TensorVector* tensors, const std::vector<TensorSpec>& specs,
                      const WireCodec& codec, const char* field, std::vector<QuantizedTensor>& out) {
  DILOCO_ENFORCE(codec.dtype == DType::INT8 || codec.dtype == DType::INT4,
                 "decode_quantized keeps INT8 and INT4 tensors only, not ", dtype_name(codec.dtype));
  check_tensors(tensors, specs, codec, field);  // elements of one byte: nothing to unshuffle
  out.resize(specs.size());
  for (size_t k = 0; k < specs.size(); ++k) {
    const wire::Tensor& t = *tensors->Get(k);
    QuantizedTensor& q = out[k];
    q.index = static_cast<uint32_t>(k);
    q.shape = specs[k].shape;
    q.dtype = codec.dtype;
    q.block_size = codec.block_size;
    const auto scales = span_of(t.scales());
    q.scales.assign(scales.begin(), scales.end());
    if (codec.sparse) {
      q.payload.resize(payload_bytes(codec.dtype, specs[k].numel()));
      sparse_unpack(codec.dtype, static_cast<size_t>(specs[k].numel()), span_of(t.gaps()), span_of(t.values()),
                    q.payload);
      continue;
    }
    const auto payload = span_of(t.payload());
    q.payload.assign(payload.begin(), payload.end());
  }
}

// ---- value ranges (streamed messages) ---------------------------------------------------------

flatbuffers::Offset<TensorVector> add_dense_range(flatbuffers::FlatBufferBuilder& fbb,
                                                  std::span<const DenseTensor> tensors, uint64_t first,
                                                  uint64_t count, const WireCodec& codec) {
  DILOCO_ENFORCE(codec.dtype == DType::F32, "value ranges are written as fp32, not ", dtype_name(codec.dtype));
  std::vector<flatbuffers::Offset<wire::Tensor>> offsets;
  const uint64_t end = first + count;
  uint64_t start = 0;  // of tensor t, counted over the tensors before it
  for (const auto& t : tensors) {
    check_values_fit_shape(t);
    const uint64_t n = t.values.size();
    const uint64_t lo = std::max(first, start);
    const uint64_t hi = std::min(end, start + n);
    if (lo < hi) {
      const size_t bytes = (hi - lo) * 4;
      if (bytes + (fbb.GetSize() + (64 << 10)) >= FLATBUFFERS_MAX_BUFFER_SIZE)
        throw InvalidInput("a segment above the 2 GiB FlatBuffers limit (segment bytes too large)");
      uint8_t* payload_ptr = nullptr;
      const auto payload = fbb.CreateUninitializedVector(bytes, &payload_ptr);
      const auto* from = reinterpret_cast<const uint8_t*>(t.values.data() + (lo - start));
      if (shuffled(codec))
        byte_shuffle({from, bytes}, {payload_ptr, bytes}, 4);
      else
        std::memcpy(payload_ptr, from, bytes);
      const auto shape = fbb.CreateVector(t.shape);
      offsets.push_back(wire::CreateTensor(fbb, t.index, shape, 0, payload, 0, 0, lo - start));
    }
    start += n;
  }
  DILOCO_ENFORCE(end <= start, "values ", first, " to ", end, " of tensors holding ", start);
  return fbb.CreateVector(offsets);
}

void decode_dense_range(const TensorVector* tensors, const std::vector<TensorSpec>& specs,
                        const WireCodec& codec, const char* field, uint64_t first, uint64_t count,
                        std::vector<DenseTensor>& out) {
  DILOCO_ENFORCE(codec.dtype == DType::F32, "value ranges are read as fp32, not ", dtype_name(codec.dtype));
  DILOCO_ENFORCE(out.size() == specs.size(), "decode_dense_range writes into tensors sized as the layout");
  if (!tensors) reject(RejectReason::MissingField, std::string(field) + " is missing");
  const uint64_t end = first + count;
  uint64_t pos = first;  // the next value the slices must hold
  size_t k = 0;          // the tensor holding `pos`, which starts at value `start`
  uint64_t start = 0;
  for (size_t j = 0; j < tensors->size(); ++j) {
    if (pos >= end)
      reject(RejectReason::ShapeMismatch,
             detail::concat(field, ": ", tensors->size(), " slices, the segment's values end at slice ", j));
    while (k < specs.size() && start + static_cast<uint64_t>(specs[k].numel()) <= pos)
      start += static_cast<uint64_t>(specs[k++].numel());
    DILOCO_ENFORCE(k < specs.size(), "a segment's range beyond its fragment's values (the caller checks it)");
    const wire::Tensor& t = *tensors->Get(static_cast<flatbuffers::uoffset_t>(j));
    if (t.index() != k || t.offset() != pos - start)
      reject(RejectReason::ShapeMismatch,
             detail::concat(field, ": slice ", j, " starts at value ", t.offset(), " of tensor ", t.index(),
                            ", the segment's next value is ", pos - start, " of tensor ", k));
    check_shape(t, k, specs);
    const uint64_t len = std::min<uint64_t>(end, start + static_cast<uint64_t>(specs[k].numel())) - pos;
    const size_t payload = t.payload() ? t.payload()->size() : 0;
    if (payload != len * 4 || (t.scales() && t.scales()->size() != 0) || t.gaps() || t.values())
      reject(RejectReason::BadCodec, detail::concat(tensor_name(specs, k), ": a slice of ", payload,
                                                    " payload bytes (and scales or sparse fields: none expected), expected ",
                                                    len * 4));
    float* into = out[k].values.data() + (pos - start);
    const std::span<uint8_t> into_bytes(reinterpret_cast<uint8_t*>(into), len * 4);
    if (shuffled(codec))
      byte_unshuffle(span_of(t.payload()), into_bytes, 4);
    else if (len != 0)
      std::memcpy(into_bytes.data(), t.payload()->Data(), len * 4);
    if (!all_finite(into, len))
      reject(RejectReason::NonFinite, tensor_name(specs, k) + ": NaN or Inf in values");
    pos += len;
  }
  if (pos != end)
    reject(RejectReason::ShapeMismatch,
           detail::concat(field, ": the slices end at value ", pos, ", the segment's at ", end));
}

}  // namespace diloco::tensor_wire
