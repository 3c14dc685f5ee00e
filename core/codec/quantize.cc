// Blockwise quantization kernels.
//
// Speed: every hot loop runs over fixed-size chunks (kChunk values) with __restrict pointers and
// no branches or calls per element, then a scalar tail. GCC vectorizes such loops at -O3 and also
// at -O2, whose cost model only vectorizes loops with a trip count that is a known multiple of the
// vector width; plain SSE2 is enough.
//
// Rounding: adding kRoundMagic (1.5 * 2^23) to x with |x| < 2^22 leaves round-half-even(x) in the
// low mantissa bits in two's complement, so the quantized byte or nibble is a truncation of the
// float's bits: no float->int conversion, no per-element branch. No clamp is needed: x = v * inv
// with |v| <= absmax and inv = levels / absmax, so |x| <= levels * (1 + 2^-22), which rounds to at
// most `levels`. (A clamp also made GCC emit branches instead of vector code.) A NaN gives some
// byte, deterministically, and no undefined float->int conversion; its block's scale is NaN.
#include "core/codec/quantize.h"

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "core/codec/topk.h"
#include "core/errors.h"

static_assert(std::endian::native == std::endian::little,
              "the wire format is little endian and the codec copies host floats as they are");

namespace diloco {
namespace {

constexpr size_t kChunk = 32;
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr float kRoundMagic = 12582912.0f;
constexpr float kInt8Levels = 127.0f;
constexpr float kInt4Levels = 7.0f;

// Largest |v| of a block, as float bits. Integer compare of the magnitude bits orders finite
// values, then Inf, then NaN, so a block holding a NaN gets a NaN scale (the decoder rejects it).
uint32_t absmax_bits(const float* __restrict v, size_t n) {
  int32_t acc[kChunk] = {};
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk)
    for (size_t j = 0; j < kChunk; ++j) {
      const auto a = static_cast<int32_t>(std::bit_cast<uint32_t>(v[i + j]) & kAbsMask);
      acc[j] = a > acc[j] ? a : acc[j];
    }
  int32_t m = 0;
  for (size_t j = 0; j < kChunk; ++j) m = acc[j] > m ? acc[j] : m;
  for (; i < n; ++i) {
    const auto a = static_cast<int32_t>(std::bit_cast<uint32_t>(v[i]) & kAbsMask);
    m = a > m ? a : m;
  }
  return static_cast<uint32_t>(m);
}

struct BlockScale {
  float scale;
  float inv;  // levels / absmax, or 0 when every q of the block must be 0
};

// scale = absmax / levels. A block whose scale would be subnormal (absmax < levels * FLT_MIN)
// is flushed to zero: its inverse would overflow. A non-finite absmax gives a
// non-finite scale, which the decoder rejects.
BlockScale scale_of(uint32_t amax_bits, float levels) {
  const float amax = std::bit_cast<float>(amax_bits);
  const float scale = amax / levels;
  if (scale >= FLT_MIN && scale <= FLT_MAX) return {scale, levels / amax};
  if (std::isfinite(scale)) return {0.0f, 0.0f};
  return {scale, 0.0f};
}

BlockScale block_scale(const float* v, size_t n, float levels) { return scale_of(absmax_bits(v, n), levels); }

inline uint32_t quant_bits(float v, float inv) {
  return std::bit_cast<uint32_t>(v * inv + kRoundMagic);
}

void quantize_run_int8(const float* __restrict v, size_t n, float inv, uint8_t* __restrict out) {
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk)
    for (size_t j = 0; j < kChunk; ++j)
      out[i + j] = static_cast<uint8_t>(quant_bits(v[i + j], inv));
  for (; i < n; ++i) out[i] = static_cast<uint8_t>(quant_bits(v[i], inv));
}

inline uint8_t int4_pair(float lo, float hi, float inv) {
  return static_cast<uint8_t>((quant_bits(lo, inv) & 0xFu) |
                              (quant_bits(hi, inv) & 0xFu) << 4);
}

// n values starting at an even position; out[k] holds values 2k and 2k+1.
void quantize_run_int4(const float* __restrict v, size_t n, float inv, uint8_t* __restrict out) {
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk)
    for (size_t j = 0; j < kChunk / 2; ++j)
      out[i / 2 + j] = int4_pair(v[i + 2 * j], v[i + 2 * j + 1], inv);
  for (; i + 2 <= n; i += 2) out[i / 2] = int4_pair(v[i], v[i + 1], inv);
  if (i < n) out[i / 2] = static_cast<uint8_t>(quant_bits(v[i], inv) & 0xFu);
}

void dequantize_run_int8(const uint8_t* __restrict q, size_t n, float scale,
                         float* __restrict out) {
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk)
    for (size_t j = 0; j < kChunk; ++j)
      out[i + j] = static_cast<float>(static_cast<int8_t>(q[i + j])) * scale;
  for (; i < n; ++i) out[i] = static_cast<float>(static_cast<int8_t>(q[i])) * scale;
}

// Sign-extended nibbles of a byte.
inline float low_nibble(uint8_t b) {
  return static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(b << 4)) >> 4);
}
inline float high_nibble(uint8_t b) { return static_cast<float>(static_cast<int8_t>(b) >> 4); }

void dequantize_run_int4(const uint8_t* __restrict q, size_t n, float scale,
                         float* __restrict out) {
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk)
    for (size_t j = 0; j < kChunk / 2; ++j) {
      const uint8_t b = q[i / 2 + j];
      out[i + 2 * j] = low_nibble(b) * scale;
      out[i + 2 * j + 1] = high_nibble(b) * scale;
    }
  for (; i + 2 <= n; i += 2) {
    out[i] = low_nibble(q[i / 2]) * scale;
    out[i + 1] = high_nibble(q[i / 2]) * scale;
  }
  if (i < n) out[i] = low_nibble(q[i / 2]) * scale;
}

void quantize_int8(const float* v, size_t n, size_t block, float* scales, uint8_t* out) {
  for (size_t b = 0, k = 0; b < n; b += block, ++k) {
    const size_t len = std::min(block, n - b);
    const BlockScale s = block_scale(v + b, len, kInt8Levels);
    scales[k] = s.scale;
    quantize_run_int8(v + b, len, s.inv, out + b);
  }
}

void dequantize_int8(const uint8_t* q, size_t n, size_t block, const float* scales, float* out) {
  for (size_t b = 0, k = 0; b < n; b += block, ++k)
    dequantize_run_int8(q + b, std::min(block, n - b), scales[k], out + b);
}

void quantize_int4(const float* v, size_t n, size_t block, float* scales, uint8_t* out) {
  if (block % 2 == 0) {  // every block starts on a byte boundary
    for (size_t b = 0, k = 0; b < n; b += block, ++k) {
      const size_t len = std::min(block, n - b);
      const BlockScale s = block_scale(v + b, len, kInt4Levels);
      scales[k] = s.scale;
      quantize_run_int4(v + b, len, s.inv, out + b / 2);
    }
    return;
  }
  // Odd block sizes straddle bytes: a plain loop, correct rather than fast.
  std::memset(out, 0, (n + 1) / 2);
  for (size_t b = 0, k = 0; b < n; b += block, ++k) {
    const size_t len = std::min(block, n - b);
    const BlockScale s = block_scale(v + b, len, kInt4Levels);
    scales[k] = s.scale;
    for (size_t i = b; i < b + len; ++i)
      out[i / 2] |= static_cast<uint8_t>((quant_bits(v[i], s.inv) & 0xFu)
                                         << (4 * (i % 2)));
  }
}

void dequantize_int4(const uint8_t* q, size_t n, size_t block, const float* scales, float* out) {
  if (block % 2 == 0) {
    for (size_t b = 0, k = 0; b < n; b += block, ++k)
      dequantize_run_int4(q + b / 2, std::min(block, n - b), scales[k], out + b);
    return;
  }
  for (size_t b = 0, k = 0; b < n; b += block, ++k) {
    const size_t end = std::min(b + block, n);
    for (size_t i = b; i < end; ++i)
      out[i] = (i % 2 ? high_nibble(q[i / 2]) : low_nibble(q[i / 2])) * scales[k];
  }
}

// bf16 = upper half of the fp32 bits, rounded to nearest even; NaN stays NaN (quiet bit set,
// sign kept) instead of rounding into Inf.
inline uint16_t to_bf16(float f) {
  const uint32_t b = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  const uint32_t nan = (b >> 16) | 0x40u;
  // A mask rather than `is_nan ? nan : rounded`, which GCC compiles to a branch.
  const uint32_t is_nan =
      0u - static_cast<uint32_t>(static_cast<int32_t>(b & kAbsMask) > 0x7f800000);
  return static_cast<uint16_t>((nan & is_nan) | (rounded & ~is_nan));
}

void encode_bf16(const float* __restrict v, size_t n, uint8_t* __restrict out) {
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    uint16_t h[kChunk];
    for (size_t j = 0; j < kChunk; ++j) h[j] = to_bf16(v[i + j]);
    std::memcpy(out + 2 * i, h, sizeof h);
  }
  for (; i < n; ++i) {
    const uint16_t h = to_bf16(v[i]);
    std::memcpy(out + 2 * i, &h, sizeof h);
  }
}

void decode_bf16(const uint8_t* __restrict in, size_t n, float* __restrict out) {
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    uint16_t h[kChunk];
    uint32_t w[kChunk];
    std::memcpy(h, in + 2 * i, sizeof h);
    for (size_t j = 0; j < kChunk; ++j) w[j] = static_cast<uint32_t>(h[j]) << 16;
    std::memcpy(out + i, w, sizeof w);
  }
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, in + 2 * i, sizeof h);
    out[i] = std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
  }
}

int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n))
      throw InvalidInput(detail::concat("bad tensor dimension ", d));
  }
  return n;
}

void check_sizes(DType dtype, uint32_t block_size, size_t n, size_t scales, size_t payload) {
  const auto values = static_cast<int64_t>(n);
  if (scales != num_blocks(dtype, block_size, values))
    throw InvalidInput(detail::concat(dtype_name(dtype), ": ", scales, " scales for ", n,
                                      " values in blocks of ", block_size));
  if (payload != payload_bytes(dtype, values))
    throw InvalidInput(detail::concat(dtype_name(dtype), ": ", payload, " payload bytes for ", n,
                                      " values"));
}

// out[i] = a[i] + b[i], chunked like the kernels above.
void add(const float* __restrict a, const float* __restrict b, size_t n, float* __restrict out) {
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk)
    for (size_t j = 0; j < kChunk; ++j) out[i + j] = a[i + j] + b[i + j];
  for (; i < n; ++i) out[i] = a[i] + b[i];
}

// inout[i] = a[i] + inout[i] (a and inout do not overlap); returns absmax_bits of the result.
uint32_t add_into(const float* __restrict a, size_t n, float* __restrict inout) {
  int32_t acc[kChunk] = {};
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk)
    for (size_t j = 0; j < kChunk; ++j) {
      const float x = a[i + j] + inout[i + j];
      inout[i + j] = x;
      const auto m = static_cast<int32_t>(std::bit_cast<uint32_t>(x) & kAbsMask);
      acc[j] = m > acc[j] ? m : acc[j];
    }
  int32_t m = 0;
  for (size_t j = 0; j < kChunk; ++j) m = acc[j] > m ? acc[j] : m;
  for (; i < n; ++i) {
    inout[i] = a[i] + inout[i];
    const auto v = static_cast<int32_t>(std::bit_cast<uint32_t>(inout[i]) & kAbsMask);
    m = v > m ? v : m;
  }
  return static_cast<uint32_t>(m);
}

// inout[i] = a[i] - inout[i].
void subtract_from(const float* __restrict a, size_t n, float* __restrict inout) {
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk)
    for (size_t j = 0; j < kChunk; ++j) inout[i + j] = a[i + j] - inout[i + j];
  for (; i < n; ++i) inout[i] = a[i] - inout[i];
}

// Zeroes all but the `keep` values of largest magnitude of x[0, n) (keep < n), in place. Magnitudes
// are compared as float bits without the sign, a total order in which NaN is largest (its block
// then gets a NaN scale, as without top-k). Of equal magnitudes the first ones are kept.
void keep_largest(float* x, size_t n, size_t keep, std::vector<uint32_t>& bits) {
  bits.resize(n);
  for (size_t i = 0; i < n; ++i) bits[i] = std::bit_cast<uint32_t>(x[i]) & kAbsMask;
  std::nth_element(bits.begin(), bits.begin() + static_cast<std::ptrdiff_t>(n - keep), bits.end());
  const uint32_t threshold = bits[n - keep];  // the keep-th largest magnitude
  size_t above = 0;
  for (size_t i = 0; i < n; ++i) above += (std::bit_cast<uint32_t>(x[i]) & kAbsMask) > threshold;
  size_t ties = keep - above;  // values equal to the threshold that are kept, first ones first
  for (size_t i = 0; i < n; ++i) {
    const uint32_t a = std::bit_cast<uint32_t>(x[i]) & kAbsMask;
    if (a > threshold) continue;
    if (a == threshold && ties > 0) {
      --ties;
      continue;
    }
    x[i] = 0.0f;
  }
}

// The quantized code of a kept value at position i of a segment's payload (the segment starts on
// a byte), and its dequantized value: the same operations as quantize_run_* and dequantize_run_*.
inline float put_code(DType dtype, float v, float inv, float scale, size_t i, uint8_t* payload) {
  const uint32_t q = quant_bits(v, inv);
  if (dtype == DType::INT8) {
    payload[i] = static_cast<uint8_t>(q);
    return static_cast<float>(static_cast<int8_t>(q)) * scale;
  }
  const auto code = static_cast<uint8_t>(q & 0xFu);
  payload[i >> 1] = static_cast<uint8_t>(payload[i >> 1] | code << ((i & 1) << 2));
  return low_nibble(code) * scale;
}

// One block whose scale is not finite (a NaN or Inf in it), element by element as the dense
// path does it: keep_largest on a copy, then every value quantized with the block's inverse.
void topk_block_reference(DType dtype, float* x, float* sent, size_t m, size_t topk, BlockScale sc,
                          size_t first, uint8_t* payload, std::vector<float>& copy, std::vector<uint32_t>& bits) {
  copy.assign(x, x + m);
  if (m > topk) keep_largest(copy.data(), m, topk, bits);
  for (size_t i = 0; i < m; ++i) {
    const float deq = put_code(dtype, copy[i], sc.inv, sc.scale, first + i, payload);
    if (sent) sent[i] = deq;
    x[i] = x[i] - deq;
  }
}

// feedback_range's top-k path on one segment of whole blocks starting on a byte: x = delta +
// residual is formed in `residual`; per block only the kept values are quantized (the others are
// 0, which dequantizes to +0, so their residual stays x and what is sent is +0), which gives the
// bits of quantizing the whole block with the others zeroed. The block's scale is that of its
// largest magnitude, which top-k always keeps.
void topk_segment(DType dtype, size_t block, size_t topk, const float* __restrict delta, float* residual,
                  float* sent, size_t len, float* scales, uint8_t* payload, size_t payload_len) {
  std::memset(payload, 0, payload_len);
  if (sent) std::fill(sent, sent + len, 0.0f);
  const float levels = dtype == DType::INT8 ? kInt8Levels : kInt4Levels;
  thread_local TopkScratch select;
  thread_local std::vector<uint32_t> kept;
  thread_local std::vector<float> copy;
  thread_local std::vector<uint32_t> bits;
  for (size_t b = 0, k = 0; b < len; b += block, ++k) {
    const size_t m = std::min(block, len - b);
    float* x = residual + b;
    const uint32_t amax = add_into(delta + b, m, x);
    const BlockScale sc = scale_of(amax, levels);
    scales[k] = sc.scale;
    if (!std::isfinite(sc.scale)) {
      topk_block_reference(dtype, x, sent ? sent + b : nullptr, m, topk, sc, b, payload, copy, bits);
      continue;
    }
    if (sc.inv == 0.0f) continue;  // every value quantizes to 0: nothing sent, x stays
    size_t count = m;
    kept.resize(m);
    if (m > topk) {
      select_topk(x, m, topk, kept.data(), select, amax);
      count = topk;
    } else {
      for (size_t i = 0; i < m; ++i) kept[i] = static_cast<uint32_t>(i);
    }
    for (size_t j = 0; j < count; ++j) {
      const size_t p = kept[j];
      const float deq = put_code(dtype, x[p], sc.inv, sc.scale, b + p, payload);
      x[p] = x[p] - deq;
      if (sent) sent[b + p] = deq;
    }
  }
}

}  // namespace

void check_topk(DType dtype, uint32_t block_size, uint32_t topk, const char* what) {
  if (topk == 0) return;
  if (dtype != DType::INT8 && dtype != DType::INT4)
    throw InvalidInput(detail::concat(what, " = ", topk, " needs an int8 or int4 codec, not ", dtype_name(dtype),
                                      " (0 sends every value)"));
  if (topk >= block_size)
    throw InvalidInput(detail::concat(what, " = ", topk, " keeps that many values of each block of ", block_size,
                                      ": it must be below the block size (0 sends every value)"));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "fp32";
    case DType::BF16: return "bf16";
    case DType::INT8: return "int8";
    case DType::INT4: return "int4";
  }
  return "unknown";
}

DType parse_dtype(const std::string& name) {
  if (name == "fp32" || name == "f32") return DType::F32;
  if (name == "bf16") return DType::BF16;
  if (name == "int8") return DType::INT8;
  if (name == "int4") return DType::INT4;
  throw InvalidInput("unknown dtype '" + name + "' (expected fp32, bf16, int8 or int4)");
}

int64_t QuantizedTensor::numel() const { return checked_numel(shape); }

size_t payload_bytes(DType dtype, int64_t n) {
  if (n < 0) throw InvalidInput(detail::concat("negative value count ", n));
  const auto count = static_cast<size_t>(n);
  switch (dtype) {
    case DType::F32: return 4 * count;
    case DType::BF16: return 2 * count;
    case DType::INT8: return count;
    case DType::INT4: return count / 2 + count % 2;
  }
  throw InvalidInput(detail::concat("unknown dtype ", static_cast<int>(dtype)));
}

size_t num_blocks(DType dtype, uint32_t block_size, int64_t n) {
  if (n < 0) throw InvalidInput(detail::concat("negative value count ", n));
  switch (dtype) {
    case DType::F32:
    case DType::BF16: return 0;
    case DType::INT8:
    case DType::INT4: {
      if (block_size == 0) throw InvalidInput(detail::concat(dtype_name(dtype), ": block size 0"));
      const auto count = static_cast<size_t>(n);
      return count / block_size + (count % block_size != 0);
    }
  }
  throw InvalidInput(detail::concat("unknown dtype ", static_cast<int>(dtype)));
}

void quantize_into(std::span<const float> values, DType dtype, uint32_t block_size,
                   std::span<float> scales, std::span<uint8_t> payload) {
  const size_t n = values.size();
  check_sizes(dtype, block_size, n, scales.size(), payload.size());
  switch (dtype) {
    case DType::F32:
      if (n) std::memcpy(payload.data(), values.data(), 4 * n);
      return;
    case DType::BF16: encode_bf16(values.data(), n, payload.data()); return;
    case DType::INT8:
      quantize_int8(values.data(), n, block_size, scales.data(), payload.data());
      return;
    case DType::INT4:
      quantize_int4(values.data(), n, block_size, scales.data(), payload.data());
      return;
  }
}

void dequantize_into(DType dtype, uint32_t block_size, std::span<const float> scales,
                     std::span<const uint8_t> payload, std::span<float> out) {
  const size_t n = out.size();
  check_sizes(dtype, block_size, n, scales.size(), payload.size());
  switch (dtype) {
    case DType::F32:
      if (n) std::memcpy(out.data(), payload.data(), 4 * n);
      return;
    case DType::BF16: decode_bf16(payload.data(), n, out.data()); return;
    case DType::INT8:
      dequantize_int8(payload.data(), n, block_size, scales.data(), out.data());
      return;
    case DType::INT4:
      dequantize_int4(payload.data(), n, block_size, scales.data(), out.data());
      return;
  }
}

QuantizedTensor quantize(uint32_t index, std::vector<int64_t> shape, std::span<const float> values,
                         DType dtype, uint32_t block_size) {
  const int64_t n = checked_numel(shape);
  if (static_cast<size_t>(n) != values.size())
    throw InvalidInput(detail::concat("quantize: shape holds ", n, " values, got ", values.size()));
  QuantizedTensor q = feedback_result(index, std::move(shape), dtype, block_size);
  quantize_into(values, dtype, block_size, q.scales, q.payload);
  return q;
}

void dequantize(const QuantizedTensor& q, std::span<float> out) {
  const int64_t n = q.numel();
  if (static_cast<size_t>(n) != out.size())
    throw InvalidInput(detail::concat("dequantize: tensor holds ", n, " values, out has ",
                                      out.size()));
  dequantize_into(q.dtype, q.block_size, q.scales, q.payload, out);
}

QuantizedTensor feedback_result(uint32_t index, std::vector<int64_t> shape, DType dtype, uint32_t block_size) {
  const int64_t n = checked_numel(shape);
  QuantizedTensor q;
  q.index = index;
  q.shape = std::move(shape);
  q.dtype = dtype;
  q.block_size = (dtype == DType::INT8 || dtype == DType::INT4) ? block_size : 0;
  q.scales.resize(num_blocks(dtype, block_size, n));
  q.payload.resize(payload_bytes(dtype, n));
  return q;
}

size_t feedback_alignment(DType dtype, uint32_t block_size) {
  const bool blocks = dtype == DType::INT8 || dtype == DType::INT4;
  return 2 * static_cast<size_t>(blocks ? block_size : 1);
}

void feedback_range(QuantizedTensor& q, std::span<const float> delta, std::span<float> residual_all,
                    std::span<float> sent, size_t begin, size_t end, std::vector<float>& scratch,
                    uint32_t topk) {
  const size_t n = static_cast<size_t>(q.numel());
  const size_t align = feedback_alignment(q.dtype, q.block_size);
  auto whole_or_range = [&](size_t size) { return size == n || size == end - begin; };
  DILOCO_ENFORCE(begin % align == 0 && begin <= end && end <= n && whole_or_range(delta.size()) &&
                     whole_or_range(residual_all.size()) && (sent.empty() || whole_or_range(sent.size())),
                 "feedback_range [", begin, ", ", end, ") of ", n, " values does not fit");
  // Each of delta, residual and sent holds the whole tensor, or this range alone (from its start).
  auto first_of = [&](size_t size) { return size == n ? 0 : begin; };
  const size_t delta_base = first_of(delta.size());
  const size_t residual_base = first_of(residual_all.size());
  const size_t sent_base = first_of(sent.size());
  check_topk(q.dtype, q.block_size, topk, "top-k");
  // Cache-sized segments of whole blocks (an even number of them, so that an INT4 segment starts
  // on a byte): x = delta + residual, send quantize(x) (of its top-k per block), keep
  // x - dequantize(sent).
  const size_t block = q.block_size ? q.block_size : 1;
  const size_t segment = std::max<size_t>(1, 8192 / (2 * block)) * 2 * block;
  const size_t scratch_len = std::min(segment, end - begin);
  scratch.resize(topk ? 0 : scratch_len);
  for (size_t s = begin; s < end; s += segment) {
    const size_t len = std::min(segment, end - s);
    const size_t first_block = q.block_size ? s / block : 0;
    const size_t blocks = num_blocks(q.dtype, q.block_size, static_cast<int64_t>(len));
    const size_t first_byte = payload_bytes(q.dtype, static_cast<int64_t>(s));
    const size_t bytes = payload_bytes(q.dtype, static_cast<int64_t>(len));
    const std::span<float> scales(q.scales.data() + first_block, blocks);
    const std::span<uint8_t> payload(q.payload.data() + first_byte, bytes);
    const std::span<float> residual(residual_all.data() + (s - residual_base), len);
    const float* d = delta.data() + (s - delta_base);
    if (topk) {
      topk_segment(q.dtype, block, topk, d, residual.data(),
                   sent.empty() ? nullptr : sent.data() + (s - sent_base),
                   len, scales.data(), payload.data(), payload.size());
      continue;
    }
    const std::span<float> x(scratch.data(), len);
    add(d, residual.data(), len, x.data());
    quantize_into(x, q.dtype, q.block_size, scales, payload);
    dequantize_into(q.dtype, q.block_size, scales, payload, residual);
    if (!sent.empty())
      std::copy(residual.begin(), residual.end(), sent.begin() + static_cast<std::ptrdiff_t>(s - sent_base));
    subtract_from(x.data(), len, residual.data());
  }
}

QuantizedTensor quantize_with_feedback(uint32_t index, std::vector<int64_t> shape,
                                       std::span<const float> delta, std::span<float> residual,
                                       DType dtype, uint32_t block_size, std::vector<float>& scratch,
                                       std::span<float> sent, uint32_t topk) {
  const size_t n = delta.size();
  if (static_cast<size_t>(checked_numel(shape)) != n)
    throw InvalidInput(detail::concat("error feedback: shape does not hold ", n, " values"));
  if (residual.size() != n)
    throw InvalidInput(detail::concat("error feedback: delta of ", n, " values, residual of ",
                                      residual.size()));
  if (!sent.empty() && sent.size() != n)
    throw InvalidInput(detail::concat("error feedback: delta of ", n, " values, output of ",
                                      sent.size()));
  QuantizedTensor q = feedback_result(index, std::move(shape), dtype, block_size);
  feedback_range(q, delta, residual, sent, 0, n, scratch, topk);
  return q;
}

QuantizedTensor ErrorFeedback::push(uint32_t index, std::vector<int64_t> shape,
                                    std::span<const float> delta, DType dtype,
                                    uint32_t block_size, uint32_t topk) {
  if (residual_.empty()) residual_.assign(delta.size(), 0.0f);
  return quantize_with_feedback(index, std::move(shape), delta, residual_, dtype, block_size, scratch_, {}, topk);
}

void apply_update(std::span<const float> base, std::span<const float> update, std::span<float> out) {
  if (base.size() != update.size() || out.size() != base.size())
    throw InvalidInput(detail::concat("apply_update: base of ", base.size(), " values, update of ",
                                      update.size(), ", output of ", out.size()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = base[i] + update[i];
}

}  // namespace diloco
