#include "core/codec/sparse.h"

#include <algorithm>
#include <bit>
#include <cstring>

#include "core/errors.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace diloco {
namespace {

constexpr uint8_t kRun = 255;

bool sparse_dtype(DType dtype) { return dtype == DType::INT8 || dtype == DType::INT4; }

// Quantized value at `pos` of a dense payload, as its byte (INT8) or nibble (INT4).
inline uint8_t code_at(DType dtype, const uint8_t* payload, size_t pos) {
  if (dtype == DType::INT8) return payload[pos];
  return static_cast<uint8_t>((payload[pos >> 1] >> ((pos & 1) << 2)) & 0xFu);
}

inline uint8_t value_at(DType dtype, const uint8_t* values, size_t e) {
  if (dtype == DType::INT8) return values[e];
  return static_cast<uint8_t>((values[e >> 1] >> ((e & 1) << 2)) & 0xFu);
}

inline float dequantized(DType dtype, uint8_t code, float scale) {
  if (dtype == DType::INT8) return static_cast<float>(static_cast<int8_t>(code)) * scale;
  // The nibble sign-extended, as dequantize_into does.
  return static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(code << 4)) >> 4) * scale;
}

// Calls f(entry, position) for each value of a checked sparse form.
template <typename F>
void for_each_position(std::span<const uint8_t> gaps, F&& f) {
  size_t next = 0;  // previous position + 1
  size_t run = 0;
  size_t entry = 0;
  for (const uint8_t g : gaps) {
    run += g;
    if (g == kRun) continue;
    const size_t pos = next + run;
    f(entry++, pos);
    next = pos + 1;
    run = 0;
  }
}

}  // namespace

void sparse_pack(DType dtype, uint32_t block_size, uint32_t topk, size_t n, std::span<const uint8_t> payload,
                 std::vector<uint8_t>& gaps, std::vector<uint8_t>& values) {
  if (!sparse_dtype(dtype) || block_size == 0)
    throw InvalidInput(detail::concat("sparse form of ", dtype_name(dtype), " in blocks of ", block_size));
  if (payload.size() != payload_bytes(dtype, static_cast<int64_t>(n)))
    throw InvalidInput(detail::concat("sparse form: ", payload.size(), " payload bytes for ", n, " values"));
  const size_t block = block_size;
  const size_t blocks = n / block + (n % block != 0);
  // At most topk per block: bounds for both outputs.
  const size_t most = std::min(n, blocks * size_t{topk});
  gaps.resize(most + n / kRun + 1);
  values.resize(dtype == DType::INT8 ? most : most / 2 + 1);
  thread_local std::vector<uint32_t> positions;
  positions.resize(block + 1);
  uint32_t* __restrict pos = positions.data();
  uint8_t* g = gaps.data();
  uint8_t* v = values.data();
  size_t count = 0, next = 0;
  const uint8_t* p = payload.data();
  for (size_t b = 0; b < n; b += block) {
    const size_t end = std::min(n, b + block);
    size_t c = 0;
    size_t i = b;
#if defined(__SSE2__)
    // 16 payload bytes at a time: most are 0.
    const __m128i zero = _mm_setzero_si128();
    if (dtype == DType::INT8) {
      for (; i + 16 <= end; i += 16) {
        const __m128i v16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
        for (auto m = ~static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(v16, zero))) & 0xFFFFu; m; m &= m - 1)
          pos[c++] = static_cast<uint32_t>(i - b) + std::countr_zero(m);
      }
    } else {
      if (i % 2 && i < end) {  // an odd block size: start on a byte
        pos[c] = 0;
        c += code_at(dtype, p, i) != 0;
        ++i;
      }
      for (; i + 32 <= end; i += 32) {
        const uint8_t* bytes = p + i / 2;
        const __m128i v16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
        for (auto m = ~static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(v16, zero))) & 0xFFFFu; m; m &= m - 1) {
          const int t = std::countr_zero(m);
          const uint8_t byte = bytes[t];
          const auto at = static_cast<uint32_t>(i - b + 2 * static_cast<size_t>(t));
          pos[c] = at;
          c += (byte & 0xFu) != 0;
          pos[c] = at + 1;
          c += (byte >> 4) != 0;
        }
      }
    }
#endif
    for (; i < end; ++i) {
      pos[c] = static_cast<uint32_t>(i - b);
      c += code_at(dtype, p, i) != 0;
    }
    if (c > topk)
      throw InvalidInput(detail::concat("sparse form: block ", b / block, " holds ", c, " values that are not 0, topk is ",
                                        topk));
    for (size_t j = 0; j < c; ++j) {
      const size_t at = b + pos[j];
      size_t d = at - next;
      for (; d >= kRun; d -= kRun) *g++ = kRun;
      *g++ = static_cast<uint8_t>(d);
      next = at + 1;
      const uint8_t code = code_at(dtype, p, at);
      if (dtype == DType::INT8) v[count] = code;
      else if (count & 1) v[count >> 1] = static_cast<uint8_t>(v[count >> 1] | code << 4);
      else v[count >> 1] = code;
      ++count;
    }
  }
  gaps.resize(static_cast<size_t>(g - gaps.data()));
  values.resize(dtype == DType::INT8 ? count : count / 2 + count % 2);
}

size_t sparse_check(DType dtype, uint32_t block_size, uint32_t topk, size_t n, std::span<const uint8_t> gaps,
                    std::span<const uint8_t> values) {
  if (!sparse_dtype(dtype) || block_size == 0)
    throw InvalidInput(detail::concat("sparse form of ", dtype_name(dtype), " in blocks of ", block_size));
  size_t next = 0, run = 0, count = 0;
  size_t block_end = block_size, in_block = 0;
  for (size_t i = 0; i < gaps.size(); ++i) {
    const uint8_t g = gaps[i];
    run += g;
    if (next + run >= n)  // also stops a long run of 255 early
      throw InvalidInput(detail::concat("sparse form: gap byte ", i, " points at or past position ", n));
    if (g == kRun) continue;
    const size_t pos = next + run;
    if (pos >= block_end) {
      block_end = (pos / block_size + 1) * block_size;
      in_block = 0;
    }
    if (++in_block > topk)
      throw InvalidInput(detail::concat("sparse form: block ", pos / block_size, " holds more than topk = ", topk,
                                        " values"));
    ++count;
    next = pos + 1;
    run = 0;
  }
  if (run != 0) throw InvalidInput("sparse form: the gaps end inside a run of 255");
  const size_t want = dtype == DType::INT8 ? count : count / 2 + count % 2;
  if (values.size() != want)
    throw InvalidInput(detail::concat("sparse form: ", values.size(), " value bytes for ", count, " values"));
  for (size_t e = 0; e < count; ++e)
    if (value_at(dtype, values.data(), e) == 0)
      throw InvalidInput(detail::concat("sparse form: value ", e, " is 0 (zeros are not sent)"));
  if (dtype == DType::INT4 && count % 2 && (values.back() >> 4) != 0)
    throw InvalidInput("sparse form: the padding nibble of an odd count is not 0");
  return count;
}

void sparse_unpack(DType dtype, size_t n, std::span<const uint8_t> gaps, std::span<const uint8_t> values,
                   std::span<uint8_t> payload) {
  DILOCO_ENFORCE(payload.size() == payload_bytes(dtype, static_cast<int64_t>(n)), "sparse_unpack: payload size");
  if (!payload.empty()) std::memset(payload.data(), 0, payload.size());
  uint8_t* p = payload.data();
  for_each_position(gaps, [&](size_t e, size_t pos) {
    DILOCO_ENFORCE(pos < n, "sparse_unpack: an unchecked sparse form");
    const uint8_t code = value_at(dtype, values.data(), e);
    if (dtype == DType::INT8) p[pos] = code;
    else p[pos >> 1] = static_cast<uint8_t>(p[pos >> 1] | code << ((pos & 1) << 2));
  });
}

void sparse_dequantize(DType dtype, uint32_t block_size, std::span<const float> scales,
                       std::span<const uint8_t> gaps, std::span<const uint8_t> values, std::span<float> out) {
  const size_t n = out.size();
  DILOCO_ENFORCE(block_size > 0 && scales.size() == num_blocks(dtype, block_size, static_cast<int64_t>(n)),
                 "sparse_dequantize: scales for ", n, " values");
  std::fill(out.begin(), out.end(), 0.0f);
  float* o = out.data();
  size_t block = 0, block_end = block_size;  // no division per value
  for_each_position(gaps, [&](size_t e, size_t pos) {
    DILOCO_ENFORCE(pos < n, "sparse_dequantize: an unchecked sparse form");
    for (; pos >= block_end; block_end += block_size) ++block;
    o[pos] = dequantized(dtype, value_at(dtype, values.data(), e), scales[block]);
  });
}

}  // namespace diloco
