// Blockwise quantization of fp32 tensors (one scale per block) and the learner-side error
// feedback that makes low-bit deltas lossless over time. Pure functions, no I/O.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace diloco {

enum class DType : uint8_t { F32 = 0, BF16 = 1, INT8 = 2, INT4 = 3 };

const char* dtype_name(DType);
DType parse_dtype(const std::string&);  // "fp32"|"f32", "bf16", "int8", "int4"; throws InvalidInput

// A tensor as it travels: payload bytes (+ scales for INT8/INT4), not yet byte-shuffled.
struct QuantizedTensor {
  uint32_t index = 0;             // position in its fragment
  std::vector<int64_t> shape;
  DType dtype = DType::F32;
  uint32_t block_size = 0;        // INT8/INT4 only
  std::vector<float> scales;      // one per block (INT8/INT4), empty otherwise
  std::vector<uint8_t> payload;   // F32: 4 B/value, BF16: 2 B/value, INT8: 1 B/value,
                                  // INT4: 2 values per byte (low nibble first), ceil(n/2) bytes
  int64_t numel() const;
};

// Exact payload size in bytes for n values of dtype (scales not included).
size_t payload_bytes(DType dtype, int64_t n);
// Number of scale blocks for n values.
size_t num_blocks(DType dtype, uint32_t block_size, int64_t n);

// Quantize `values` (numel must match shape). INT8: q = round(v / s), s = absmax/127 per block;
// INT4: s = absmax/7; BF16: round to nearest even. A block of zeros gets scale 0 (so does a block
// whose scale would be subnormal: absmax below 127 resp. 7 times FLT_MIN); a block holding NaN or
// Inf gets a non-finite scale, which decoders reject.
QuantizedTensor quantize(uint32_t index, std::vector<int64_t> shape, std::span<const float> values,
                         DType dtype, uint32_t block_size);

// Inverse of quantize; `out.size()` must equal the tensor's numel.
void dequantize(const QuantizedTensor& q, std::span<float> out);

// The same two operations on caller-owned memory (the message codec quantizes straight into the
// FlatBuffer and dequantizes straight out of it). `payload` holds the little-endian wire bytes,
// not byte-shuffled; scales.size() == num_blocks(...), payload.size() == payload_bytes(...), and
// values/out have n elements. INT4 nibbles are two's complement (q & 0xF), low nibble first; an
// odd count leaves the last high nibble 0. Throws InvalidInput on inconsistent sizes.
void quantize_into(std::span<const float> values, DType dtype, uint32_t block_size,
                   std::span<float> scales, std::span<uint8_t> payload);
void dequantize_into(DType dtype, uint32_t block_size, std::span<const float> scales,
                     std::span<const uint8_t> payload, std::span<float> out);

// Error feedback on caller-owned memory: quantizes x = delta + residual, leaves
// x - dequantize(result) in `residual` and, when `sent` is not empty (n values), dequantize(result)
// in `sent`. `scratch` is reused between calls. ErrorFeedback::push is this on its own residual.
//
// Top-k: with topk > 0 (INT8/INT4 only, below block_size) only the topk values of largest
// magnitude in each block are quantized; the others are sent as 0 and stay whole in the residual
// until they grow large enough to be sent (SparseLoCo, arXiv 2508.15706). The result is an
// ordinary dense tensor (the message codec sends it in the sparse form of core/codec/sparse.h).
// Ties are broken by position (the first ones are kept), so the result is deterministic; the
// selection is select_topk (core/codec/topk.h), and the bits are those of quantizing the block
// with every value but the kept ones set to 0. See check_topk.
QuantizedTensor quantize_with_feedback(uint32_t index, std::vector<int64_t> shape,
                                       std::span<const float> delta, std::span<float> residual,
                                       DType dtype, uint32_t block_size, std::vector<float>& scratch,
                                       std::span<float> sent = {}, uint32_t topk = 0);

// Throws InvalidInput naming `what` unless topk is 0, or dtype is INT8/INT4 and 0 < topk < block_size.
void check_topk(DType dtype, uint32_t block_size, uint32_t topk, const char* what);

// quantize_with_feedback in pieces, for callers that share one tensor between threads:
// feedback_result sizes the result (scales and payload, no values yet); feedback_range fills
// values [begin, end) of it and touches only that range of residual and sent. delta, residual and
// sent (which may also be empty) each hold the whole tensor's n values, or the range's
// end - begin alone, from its start (a caller may compute a tensor's delta a range at a time). begin must be a
// multiple of feedback_alignment (whole blocks, whole INT4 bytes). Any division into ranges gives
// the bits of one quantize_with_feedback call. Throws InternalError on a range that does not fit.
QuantizedTensor feedback_result(uint32_t index, std::vector<int64_t> shape, DType dtype, uint32_t block_size);
size_t feedback_alignment(DType dtype, uint32_t block_size);
void feedback_range(QuantizedTensor& q, std::span<const float> delta, std::span<float> residual,
                    std::span<float> sent, size_t begin, size_t end, std::vector<float>& scratch,
                    uint32_t topk = 0);

// out = base + update, element by element in fp32 (out may be base). The one definition of how a
// parameter update is applied: the merger computes a new version with it and every subscriber
// reconstructs that version with it, so both hold the same bits (the project compiles with
// -ffp-contract=off, so no fused multiply-add makes them depend on the CPU).
void apply_update(std::span<const float> base, std::span<const float> update, std::span<float> out);

// Error feedback for one tensor: the part of a delta that quantization lost is carried into the
// next delta of the same tensor, so the sum of what was sent tracks the sum of the true deltas.
class ErrorFeedback {
 public:
  ErrorFeedback() = default;
  explicit ErrorFeedback(int64_t numel) : residual_(static_cast<size_t>(numel), 0.0f) {}
  // Continues from a residual kept earlier (a learner's saved state).
  explicit ErrorFeedback(std::vector<float> residual) : residual_(std::move(residual)) {}

  // Quantizes delta + residual (its topk largest values per block, when topk > 0) and keeps
  // (delta + residual) - dequantize(result) as residual.
  QuantizedTensor push(uint32_t index, std::vector<int64_t> shape, std::span<const float> delta,
                       DType dtype, uint32_t block_size, uint32_t topk = 0);
  std::span<const float> residual() const { return residual_; }
  void reset() { std::fill(residual_.begin(), residual_.end(), 0.0f); }

 private:
  std::vector<float> residual_;
  std::vector<float> scratch_;
};

}  // namespace diloco
