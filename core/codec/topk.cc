#include "core/codec/topk.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <functional>

#include "core/errors.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace diloco {
namespace {

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr int kShift = 20;   // 8 exponent bits and 3 mantissa bits per key
constexpr int kBuckets = 256;
constexpr size_t kChunk = 32;

// bucket[i] = the key of |x[i]| counted from the largest key down, kBuckets - 1 being the
// largest and 0 everything kBuckets - 1 or more keys below it.
void bucketize(const float* __restrict x, size_t n, uint32_t top, uint8_t* __restrict bucket) {
  const int32_t offset = static_cast<int32_t>(top) - (kBuckets - 1);
  size_t i = 0;
  for (; i + kChunk <= n; i += kChunk)
    for (size_t j = 0; j < kChunk; ++j) {
      const auto key = static_cast<int32_t>((std::bit_cast<uint32_t>(x[i + j]) & kAbsMask) >> kShift);
      const int32_t b = key - offset;
      bucket[i + j] = static_cast<uint8_t>(b > 0 ? b : 0);
    }
  for (; i < n; ++i) {
    const auto key = static_cast<int32_t>((std::bit_cast<uint32_t>(x[i]) & kAbsMask) >> kShift);
    const int32_t b = key - offset;
    bucket[i] = static_cast<uint8_t>(b > 0 ? b : 0);
  }
}

// Number of bucket bytes >= t.
size_t count_ge(const uint8_t* bucket, size_t n, uint8_t t) {
  size_t count = 0, i = 0;
#if defined(__SSE2__)
  const __m128i vt = _mm_set1_epi8(static_cast<char>(t));
  const __m128i zero = _mm_setzero_si128();
  while (i + 16 <= n) {
    // Byte counters, summed before they can wrap (255 rounds).
    __m128i acc = zero;
    const size_t end = i + std::min<size_t>((n - i) / 16, 255) * 16;
    for (; i < end; i += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bucket + i));
      acc = _mm_sub_epi8(acc, _mm_cmpeq_epi8(_mm_max_epu8(b, vt), b));
    }
    const __m128i sums = _mm_sad_epu8(acc, zero);
    count += static_cast<size_t>(_mm_cvtsi128_si32(sums)) +
             static_cast<size_t>(_mm_cvtsi128_si32(_mm_srli_si128(sums, 8)));
  }
#endif
  for (; i < n; ++i) count += bucket[i] >= t;
  return count;
}

// kOffsets[m]: the positions of the set bits of the byte m, ascending (then zeros).
struct Offsets {
  uint8_t at[256][8];
  constexpr Offsets() : at{} {
    for (int m = 0; m < 256; ++m)
      for (int bit = 0, c = 0; bit < 8; ++bit)
        if (m >> bit & 1) at[m][c++] = static_cast<uint8_t>(bit);
  }
};
constexpr Offsets kOffsets;

// Appends to out the positions i in [0, n) with bucket[i] >= t, ascending; returns how many.
// out needs room for 16 more than that (whole groups of 8 are written).
size_t positions_ge(const uint8_t* bucket, size_t n, uint8_t t, uint32_t* out) {
  size_t c = 0, i = 0;
#if defined(__SSE2__)
  const __m128i vt = _mm_set1_epi8(static_cast<char>(t));
  const __m128i zero = _mm_setzero_si128();
  // Branch-free: the set bits of 8 buckets at a time, through the table, 8 positions written.
  const auto put8 = [&](uint32_t bits8, size_t base) {
    const __m128i off = _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kOffsets.at[bits8])), zero);
    const __m128i vbase = _mm_set1_epi32(static_cast<int>(base));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c), _mm_add_epi32(_mm_unpacklo_epi16(off, zero), vbase));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c + 4), _mm_add_epi32(_mm_unpackhi_epi16(off, zero), vbase));
    c += static_cast<size_t>(std::popcount(bits8));
  };
  for (; i + 16 <= n; i += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bucket + i));
    const auto ge = static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_max_epu8(b, vt), b)));
    if (ge == 0) continue;
    put8(ge & 0xFFu, i);
    put8(ge >> 8, i + 8);
  }
#endif
  for (; i < n; ++i) {
    out[c] = static_cast<uint32_t>(i);
    c += bucket[i] >= t;
  }
  return c;
}

// The k-th largest of mag[0, n) (1 <= k <= n); `work` (n entries) is reordered. When every value
// shares its bits above kShift (one bucket but the lowest), a histogram of the next 8 bits first
// narrows the values to rank to those of one sub-bucket.
uint32_t kth_largest(const uint32_t* mag, size_t n, size_t k, bool one_key, uint32_t* work) {
  constexpr size_t kSmall = 32;
  if (one_key && n > kSmall) {
    constexpr int kSubShift = kShift - 8;
    uint32_t hist[kBuckets] = {};
    for (size_t j = 0; j < n; ++j) ++hist[(mag[j] >> kSubShift) & 0xFFu];
    size_t above = 0;
    uint32_t sub = kBuckets - 1;
    for (; above + hist[sub] < k; --sub) above += hist[sub];
    size_t m = 0;
    for (size_t j = 0; j < n; ++j) {
      const uint32_t v = mag[j];
      work[m] = v;
      m += ((v >> kSubShift) & 0xFFu) == sub;
    }
    n = m;
    k -= above;
  } else {
    std::copy(mag, mag + n, work);
  }
  std::nth_element(work, work + (k - 1), work + n, std::greater<>());
  return work[k - 1];
}

}  // namespace

void select_topk(const float* x, size_t n, size_t k, uint32_t* out, TopkScratch& s) {
  uint32_t top = 0;
  for (size_t i = 0; i < n; ++i) top = std::max(top, std::bit_cast<uint32_t>(x[i]) & kAbsMask);
  select_topk(x, n, k, out, s, top);
}

void select_topk(const float* x, size_t n, size_t k, uint32_t* out, TopkScratch& s, uint32_t max_magnitude) {
  DILOCO_ENFORCE(k > 0 && k < n && n <= UINT32_MAX, "select_topk: ", k, " of ", n, " values");
  s.bucket.resize(n);
  s.above.resize(n + 16);
  uint8_t* bucket = s.bucket.data();
  bucketize(x, n, max_magnitude >> kShift, bucket);

  // The boundary bucket: the largest t with at least k buckets >= t. Counting buckets >= t is a
  // vector pass over n bytes, so t is searched for, starting where the previous block's was
  // (blocks of one tensor look alike: usually 2 passes), then by bisection. The search path
  // does not change the result.
  size_t lo = 0, lo_count = n;         // count_ge(lo) >= k
  size_t hi = kBuckets, hi_count = 0;  // count_ge(hi) < k
  const auto probe = [&](size_t t) {
    const size_t c = count_ge(bucket, n, static_cast<uint8_t>(t));
    if (c >= k) {
      lo = t;
      lo_count = c;
    } else {
      hi = t;
      hi_count = c;
    }
  };
  const size_t guess = std::min<size_t>(s.guess, kBuckets - 1);
  probe(guess);
  if (lo == guess && guess + 1 < kBuckets) probe(guess + 1);
  else if (hi == guess && guess > 0) probe(guess - 1);
  while (hi - lo > 1) probe(lo + (hi - lo) / 2);
  s.guess = static_cast<uint32_t>(lo);
  const auto bb = static_cast<uint8_t>(lo);
  const size_t above = hi_count;            // in buckets above bb: all kept
  const size_t in_boundary = lo_count - hi_count;
  const size_t wanted = k - above;          // from bucket bb, 1..in_boundary

  // Positions in bucket bb or above, ascending.
  uint32_t* ge = s.above.data();
  const size_t m = positions_ge(bucket, n, bb, ge);
  DILOCO_ENFORCE(m == lo_count && wanted >= 1 && wanted <= in_boundary, "select_topk: counts do not agree");
  if (wanted == in_boundary) {
    std::memcpy(out, ge, k * sizeof(uint32_t));
    return;
  }
  // T = the wanted-th largest magnitude in bucket bb; kept: every magnitude above T, and the first
  // `ties` of those equal to it.
  s.candidates.resize(m + 1);
  uint32_t* __restrict mag = s.candidates.data();
  size_t nc = 0;
  for (size_t j = 0; j < m; ++j) {
    mag[nc] = std::bit_cast<uint32_t>(x[ge[j]]) & kAbsMask;
    nc += bucket[ge[j]] == bb;
  }
  s.keys.resize(m + 1);
  const uint32_t threshold = kth_largest(mag, nc, wanted, bb != 0, s.keys.data());
  size_t greater = 0;
  for (size_t j = 0; j < nc; ++j) greater += mag[j] > threshold;
  const size_t ties = wanted - greater;
  uint32_t* __restrict kept = s.keys.data();
  size_t c = 0, equal = 0;
  for (size_t j = 0; j < m; ++j) {
    const uint32_t a = std::bit_cast<uint32_t>(x[ge[j]]) & kAbsMask;
    kept[c] = ge[j];
    c += (a > threshold) | ((a == threshold) & (equal < ties));
    equal += a == threshold;
  }
  DILOCO_ENFORCE(c == k, "select_topk: kept ", c, " of ", k);
  std::memcpy(out, kept, k * sizeof(uint32_t));
}

}  // namespace diloco
