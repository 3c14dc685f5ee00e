// Internal to core/codec: what every message codec shares. Framing (FlatBuffer built in a reused
// per-thread builder, zstd around it; strict opening: size limit, bounded decompression,
// verifier, schema version, run id) and tensors (schemas/common.fbs Tensor and Codec), written
// straight into the builder and checked against the fragment layout before being decoded.
#pragma once

#include <flatbuffers/flatbuffers.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/codec/messages.h"
#include "schemas/common_generated.h"

namespace diloco::tensor_wire {

using TensorVector = flatbuffers::Vector<flatbuffers::Offset<wire::Tensor>>;

struct WireCodec {
  DType dtype = DType::F32;
  uint32_t block_size = 0;  // INT8/INT4 only, 0 otherwise
  bool byte_shuffle = false;
  uint32_t topk = 0;        // INT8/INT4 only, below block_size; 0: every value may be sent
  bool sparse = false;      // tensors in the sparse form (core/codec/sparse.h); topk > 0 only
};

inline constexpr uint32_t kMaxBlockSize = 1u << 20;

// ---- framing --------------------------------------------------------------------------------
// The calling thread's builder, cleared. It keeps its memory (the largest message built on this
// thread) so that steady-state encoding does not page-fault.
flatbuffers::FlatBufferBuilder& builder();
// zstd of the finished buffer.
std::vector<uint8_t> compress_finished(const flatbuffers::FlatBufferBuilder& fbb, int zstd_level);
// Frees the calling thread's decoding buffers (decompressed frame, staging) when a message has
// grown them above kKeptScratchBytes: a decoded checkpoint would otherwise keep its size resident
// in every thread that ever read one.
inline constexpr size_t kKeptScratchBytes = size_t{64} << 20;
void release_large_scratch();

// TooLarge, then bounded decompression into a per-thread buffer, then the verifier with the file
// identifier (BadFlatbuffer). The returned bytes stay valid until the thread's next open_frame.
std::span<const uint8_t> open_frame(std::span<const uint8_t> bytes, const DecodeLimits& limits,
                                    bool (*verify)(flatbuffers::Verifier&), const char* what);

// Root of an opened frame, with schema_version and run id checked.
template <typename Root>
const Root& open_root(std::span<const uint8_t> bytes, const DecodeLimits& limits,
                      bool (*verify)(flatbuffers::Verifier&), const char* what);

[[noreturn]] void reject(RejectReason reason, const std::string& detail);
void check_schema_version(uint16_t version, const char* what);
void check_run_id(const flatbuffers::String* run_id, const DecodeLimits& limits);
void check_fingerprint(uint64_t fingerprint, const DecodeLimits& limits);
// The layout's fragment list (FragmentOutOfRange when past its end).
const std::vector<TensorSpec>& fragment_specs(uint32_t fragment, const DecodeLimits& limits);
// A string field that must be present (MissingField otherwise).
std::string required(const flatbuffers::String* s, const char* field);
flatbuffers::Offset<wire::LogPosition> add_position(flatbuffers::FlatBufferBuilder& fbb,
                                                     const LogPosition& p);
// MissingField when the position or its topic is absent.
LogPosition read_position(const wire::LogPosition* p, const char* field);
// A copy of a vector's elements. The verifier only guarantees 4-byte alignment of vector data,
// so 8-byte elements of a hostile buffer may be misaligned: read them with memcpy.
template <typename T>
std::vector<T> copy_vector(const flatbuffers::Vector<T>* v) {
  std::vector<T> out;
  if (v && v->size() != 0) {
    out.resize(v->size());
    std::memcpy(out.data(), v->Data(), v->size() * sizeof(T));
  }
  return out;
}
// Versions and other monotone counters: anything above 2^48 is a corrupt or hostile value.
inline constexpr uint64_t kMaxCounter = 1ull << 48;
void check_counter(uint64_t value, const char* field);

template <typename Root>
const Root& open_root(std::span<const uint8_t> bytes, const DecodeLimits& limits,
                      bool (*verify)(flatbuffers::Verifier&), const char* what) {
  const auto buf = open_frame(bytes, limits, verify, what);
  const Root& root = *flatbuffers::GetRoot<Root>(buf.data());
  check_schema_version(root.schema_version(), what);
  check_run_id(root.run_id(), limits);
  return root;
}

// ---- model layouts --------------------------------------------------------------------------
flatbuffers::Offset<wire::ModelLayout> add_model_layout(flatbuffers::FlatBufferBuilder& fbb,
                                                        const FragmentLayout& layout);
// The layout a message carries (MissingField when absent), rebuilt with partition_tensors and
// checked to give `fingerprint` (BadLayout otherwise, or for an invalid tensor list).
std::shared_ptr<const FragmentLayout> read_model_layout(const wire::ModelLayout* layout, uint64_t fingerprint);
// The tensors of `fragment` in a message carrying its own layout: checked against limits.layout
// when the reader has one (the fingerprint must then be the reader's: WrongFingerprint), else
// against the message's layout, kept in `own`.
const std::vector<TensorSpec>& self_described_specs(const wire::ModelLayout* layout, uint64_t fingerprint,
                                                    uint32_t fragment, const DecodeLimits& limits,
                                                    std::shared_ptr<const FragmentLayout>& own);

// ---- tensors --------------------------------------------------------------------------------
// Validates options (InvalidInput: the caller's bug, not a hostile message). sparse = topk > 0:
// quantized tensors with a top-k bound travel in the sparse form.
WireCodec codec_of(const CodecOptions& options);
flatbuffers::Offset<wire::Codec> add_codec(flatbuffers::FlatBufferBuilder& fbb, const WireCodec& c);
// Dense tensors are quantized straight into the builder (no intermediate payload copy), in the
// dense form whatever codec.sparse says (no top-k selection is made here: the caller writes its
// codec with sparse false).
flatbuffers::Offset<TensorVector> add_dense(flatbuffers::FlatBufferBuilder& fbb,
                                            std::span<const DenseTensor> tensors,
                                            const WireCodec& codec);
// Each tensor must match the codec's dtype and block size (InvalidInput otherwise). With
// codec.sparse each block must hold at most codec.topk values that are not 0 (InvalidInput).
flatbuffers::Offset<TensorVector> add_quantized(flatbuffers::FlatBufferBuilder& fbb,
                                                std::span<const QuantizedTensor> tensors,
                                                const WireCodec& codec);

// MissingField when absent, BadCodec for an unknown dtype, a bad block size, or sparse without
// an INT8/INT4 top-k codec.
WireCodec check_codec(const wire::Codec* codec);
// Strict decoding against the layout: count (TensorCountMismatch), index and shape
// (ShapeMismatch), scale count and payload size (BadCodec), finite scales and values
// (NonFinite); a sparse form (BadCodec: a payload present, positions out of range, more than topk
// in a block, sizes that do not agree, a value 0). Every tensor is checked before any is decoded. `out` is resized and its vectors
// reused.
void decode_tensors(const TensorVector* tensors, const std::vector<TensorSpec>& specs,
                    const WireCodec& codec, const char* field, std::vector<DenseTensor>& out);
// The same checks for an INT8 or INT4 codec, keeping each tensor as it travelled (its payload
// bytes and scales copied, nothing dequantized): int8/int4 values are finite once their scales
// are, so nothing is left unchecked. `out` is resized and its vectors reused.
void decode_quantized(const TensorVector* tensors, const std::vector<TensorSpec>& specs,
                      const WireCodec& codec, const char* field, std::vector<QuantizedTensor>& out);

// ---- value ranges (streamed messages, core/codec/messages.h) ---------------------------------
// The values [first, first + count) of `tensors` (a fragment's tensors in layout order, their
// values counted one tensor after another) as slices: one Tensor per tensor the range touches,
// with the tensor's index and whole shape and `offset` the slice's first value in it. fp32 only.
flatbuffers::Offset<TensorVector> add_dense_range(flatbuffers::FlatBufferBuilder& fbb,
                                                  std::span<const DenseTensor> tensors, uint64_t first,
                                                  uint64_t count, const WireCodec& codec);
// Strict decoding of such slices into `out` (every tensor of the fragment, sized as the layout
// says, which the caller did): the slices must tile [first, first + count) in layout order
// (ShapeMismatch for an index, offset or shape that does not, or slices past the range), each
// payload exactly its slice (BadCodec), finite values (NonFinite). The caller has checked that
// the range lies within the fragment. Slices decoded before a rejection stay written.
void decode_dense_range(const TensorVector* tensors, const std::vector<TensorSpec>& specs,
                        const WireCodec& codec, const char* field, uint64_t first, uint64_t count,
                        std::vector<DenseTensor>& out);

}  // namespace diloco::tensor_wire
