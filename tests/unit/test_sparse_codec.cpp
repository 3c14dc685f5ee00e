// Top-k selection (core/codec/topk.h), the sparse wire form (core/codec/sparse.h) and the top-k
// error feedback built on them. Expected values come from a plain reference (sort by magnitude,
// then position; the dense quantize_into/dequantize_into on the kept values) or by hand.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "core/codec/quantize.h"
#include "core/codec/sparse.h"
#include "core/codec/topk.h"
#include "core/errors.h"

using namespace diloco;

namespace {

uint32_t magnitude(float f) { return std::bit_cast<uint32_t>(f) & 0x7fffffffu; }

// The k largest magnitudes, ties by position (first kept), as ascending positions: a full sort.
std::vector<uint32_t> reference_topk(const float* x, size_t n, size_t k) {
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return magnitude(x[a]) > magnitude(x[b]); });
  order.resize(k);
  std::sort(order.begin(), order.end());
  return order;
}

enum class Kind { Gaussian, FewLevels, MostlyZero, WideRange, Constant, Subnormal, WithInf };

std::vector<float> make_block(Kind kind, size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> g(0.0f, 1e-3f);
  std::uniform_int_distribution<int> level(-3, 3);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-140, 60);
  std::vector<float> v(n);
  for (auto& x : v) {
    switch (kind) {
      case Kind::Gaussian: x = g(rng); break;
      case Kind::FewLevels: x = 0.25f * static_cast<float>(level(rng)); break;  // many ties, +-0
      case Kind::MostlyZero: x = u(rng) < 0.9f ? (u(rng) < 0.5f ? 0.0f : -0.0f) : g(rng); break;
      case Kind::WideRange: x = std::ldexp(u(rng) < 0.5f ? -1.0f : 1.0f, exponent(rng)); break;  // ties too
      case Kind::Constant: x = u(rng) < 0.5f ? 0.5f : -0.5f; break;
      case Kind::Subnormal: x = std::numeric_limits<float>::denorm_min() * static_cast<float>(level(rng)); break;
      case Kind::WithInf: x = u(rng) < 0.05f ? (u(rng) < 0.5f ? INFINITY : -INFINITY) : g(rng); break;
    }
  }
  return v;
}

}  // namespace

TEST_CASE("select_topk keeps what a sort by magnitude then position keeps", "[codec][topk][sparse]") {
  const auto kind = GENERATE(Kind::Gaussian, Kind::FewLevels, Kind::MostlyZero, Kind::WideRange, Kind::Constant,
                             Kind::Subnormal, Kind::WithInf);
  const size_t n = GENERATE(size_t{2}, size_t{7}, size_t{64}, size_t{1000}, size_t{1024}, size_t{4099});
  std::mt19937_64 rng(n * 31 + static_cast<size_t>(kind));
  TopkScratch scratch;
  for (int trial = 0; trial < 4; ++trial) {
    const auto x = make_block(kind, n, rng);
    for (const size_t k : {size_t{1}, n / 10, n / 2, n - 1}) {
      if (k == 0 || k >= n) continue;
      INFO("kind " << static_cast<int>(kind) << " n " << n << " k " << k << " trial " << trial);
      std::vector<uint32_t> got(k, 0xdeadbeef);
      select_topk(x.data(), n, k, got.data(), scratch);
      CHECK(got == reference_topk(x.data(), n, k));
    }
  }
}

TEST_CASE("select_topk by hand: ties keep the first, -0 ties +0", "[codec][topk][sparse]") {
  const std::vector<float> x = {0.5f, -1.0f, 0.25f, 1.0f, -0.0f, 0.0f, -0.5f, 1.0f};
  TopkScratch scratch;
  std::vector<uint32_t> out(3);
  select_topk(x.data(), x.size(), 3, out.data(), scratch);
  CHECK(out == std::vector<uint32_t>{1, 3, 7});
  out.assign(4, 0);
  select_topk(x.data(), x.size(), 4, out.data(), scratch);
  CHECK(out == std::vector<uint32_t>{0, 1, 3, 7});  // 0.5 at 0 before -0.5 at 6
  out.assign(7, 0);
  select_topk(x.data(), x.size(), 7, out.data(), scratch);
  CHECK(out == std::vector<uint32_t>{0, 1, 2, 3, 4, 6, 7});  // -0 at 4 before +0 at 5
  CHECK_THROWS_AS(select_topk(x.data(), x.size(), 8, out.data(), scratch), InternalError);
  CHECK_THROWS_AS(select_topk(x.data(), x.size(), 0, out.data(), scratch), InternalError);
}

namespace {

// What top-k error feedback must give, from the dense functions: per block the reference's kept
// values, the others 0; quantize_into that; sent = dequantize_into; residual = x - sent.
struct Reference {
  std::vector<float> scales, sent, residual;
  std::vector<uint8_t> payload;
};

Reference reference_feedback(const std::vector<float>& x, DType dtype, uint32_t block, uint32_t topk) {
  const size_t n = x.size();
  std::vector<float> kept(n, 0.0f);
  for (size_t b = 0; b < n; b += block) {
    const size_t m = std::min<size_t>(block, n - b);
    if (m <= topk) {
      std::copy(x.begin() + static_cast<std::ptrdiff_t>(b), x.begin() + static_cast<std::ptrdiff_t>(b + m),
                kept.begin() + static_cast<std::ptrdiff_t>(b));
      continue;
    }
    for (uint32_t p : reference_topk(x.data() + b, m, topk)) kept[b + p] = x[b + p];
  }
  Reference r;
  r.scales.resize(num_blocks(dtype, block, static_cast<int64_t>(n)));
  r.payload.resize(payload_bytes(dtype, static_cast<int64_t>(n)));
  r.sent.resize(n);
  quantize_into(kept, dtype, block, r.scales, r.payload);
  dequantize_into(dtype, block, r.scales, r.payload, r.sent);
  r.residual.resize(n);
  for (size_t i = 0; i < n; ++i) r.residual[i] = x[i] - r.sent[i];
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("top-k error feedback gives the bits of the dense path on the kept values", "[codec][topk][sparse][feedback]") {
  const auto dtype = GENERATE(DType::INT4, DType::INT8);
  const uint32_t block = GENERATE(1024u, 64u, 33u);
  const auto kind = GENERATE(Kind::Gaussian, Kind::FewLevels, Kind::MostlyZero, Kind::WideRange, Kind::WithInf);
  const size_t n = 5 * block + block / 3 + 1;  // a short last block
  std::mt19937_64 rng(block * 7 + static_cast<size_t>(kind));
  for (const uint32_t topk : {1u, block / 10 + 1, block - 1}) {
    INFO(dtype_name(dtype) << " block " << block << " kind " << static_cast<int>(kind) << " topk " << topk);
    auto delta = make_block(kind, n, rng);
    auto residual0 = make_block(Kind::Gaussian, n, rng);
    if (kind == Kind::WithInf) delta[n / 2] = NAN;  // one block with a NaN scale
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = delta[i] + residual0[i];
    const Reference want = reference_feedback(x, dtype, block, topk);
    std::vector<float> residual = residual0, sent(n, -7.0f), scratch;
    const QuantizedTensor q = quantize_with_feedback(0, {static_cast<int64_t>(n)}, delta, residual, dtype, block,
                                                     scratch, sent, topk);
    CHECK(q.payload == want.payload);
    CHECK(same_bits(q.scales, want.scales));
    CHECK(same_bits(sent, want.sent));
    CHECK(same_bits(residual, want.residual));
  }
}

TEST_CASE("sparse form by hand", "[codec][sparse]") {
  // INT4, 10 values in blocks of 5, topk 2: 3 at 1, -1 at 4, 2 at 7.
  std::vector<uint8_t> payload(5, 0);
  payload[0] = 0x30;  // position 1 (high nibble of byte 0)
  payload[2] = 0x0F;  // position 4 (low nibble of byte 2)
  payload[3] = 0x20;  // position 7
  std::vector<uint8_t> gaps, values;
  sparse_pack(DType::INT4, 5, 2, 10, payload, gaps, values);
  CHECK(gaps == std::vector<uint8_t>{1, 2, 2});
  CHECK(values == std::vector<uint8_t>{0xF3, 0x02});
  CHECK(sparse_check(DType::INT4, 5, 2, 10, gaps, values) == 3);
  std::vector<uint8_t> back(5, 0xAA);
  sparse_unpack(DType::INT4, 10, gaps, values, back);
  CHECK(back == payload);
  const std::vector<float> scales = {0.5f, 0.25f};
  std::vector<float> out(10, 9.0f);
  sparse_dequantize(DType::INT4, 5, scales, gaps, values, out);
  CHECK(out == std::vector<float>{0, 1.5f, 0, 0, -0.5f, 0, 0, 0.5f, 0, 0});
  CHECK(std::signbit(out[0]) == false);

  // INT8, a gap of 300 (255 + 45) and an adjacent pair.
  std::vector<uint8_t> p8(600, 0);
  p8[300] = 0x81;  // -127
  p8[301] = 5;
  sparse_pack(DType::INT8, 600, 2, 600, p8, gaps, values);
  CHECK(gaps == std::vector<uint8_t>{255, 45, 0});
  CHECK(values == std::vector<uint8_t>{0x81, 5});
  CHECK_THROWS_AS(sparse_pack(DType::INT8, 600, 1, 600, p8, gaps, values), InvalidInput);  // 2 in a block
  CHECK_THROWS_AS(sparse_pack(DType::INT8, 600, 2, 599, p8, gaps, values), InvalidInput);  // sizes
  CHECK_THROWS_AS(sparse_pack(DType::F32, 600, 2, 150, p8, gaps, values), InvalidInput);
}

TEST_CASE("sparse_check rejects every inconsistent form", "[codec][sparse]") {
  const auto bad = [](DType dtype, uint32_t block, uint32_t topk, size_t n, std::vector<uint8_t> gaps,
                      std::vector<uint8_t> values) {
    try {
      (void)sparse_check(dtype, block, topk, n, gaps, values);
    } catch (const InvalidInput&) {
      return true;
    }
    return false;
  };
  // Accepted baseline: INT8, n 10, block 5, topk 2, values at 1 and 4 and 7.
  CHECK_FALSE(bad(DType::INT8, 5, 2, 10, {1, 2, 2}, {1, 2, 3}));
  CHECK_FALSE(bad(DType::INT8, 5, 2, 10, {}, {}));                       // nothing sent
  CHECK_FALSE(bad(DType::INT8, 5, 2, 10, {1, 2, 4}, {1, 2, 3}));        // 1, 4, 9
  CHECK(bad(DType::INT8, 5, 2, 10, {1, 2, 5}, {1, 2, 3}));              // position 10 = n
  CHECK(bad(DType::INT8, 5, 2, 10, {0, 0, 0}, {1, 2, 3}));              // 3 in block 0
  CHECK(bad(DType::INT8, 5, 2, 10, {1, 2, 2}, {1, 2}));                 // too few values
  CHECK(bad(DType::INT8, 5, 2, 10, {1, 2, 2}, {1, 2, 3, 4}));           // too many
  CHECK(bad(DType::INT8, 5, 2, 10, {1, 2, 2}, {1, 0, 3}));              // a value 0
  CHECK(bad(DType::INT8, 600, 2, 600, {255}, {}));                      // a run without its end
  CHECK(bad(DType::INT8, 600, 2, 600, {255, 255, 255}, {1}));           // past the end
  CHECK(bad(DType::INT8, 5, 0, 10, {1}, {1}));                          // topk 0: nothing allowed
  CHECK(bad(DType::INT4, 5, 2, 10, {1, 2, 2}, {0x21, 0x13}));           // padding nibble not 0
  CHECK(bad(DType::INT4, 5, 2, 10, {1, 2, 2}, {0x01, 0x03}));           // a nibble 0
  CHECK_FALSE(bad(DType::INT4, 5, 2, 10, {1, 2, 2}, {0x21, 0x03}));
  CHECK(bad(DType::BF16, 5, 2, 10, {}, {}));
}

TEST_CASE("sparse form of top-k tensors: packed, checked and unpacked to the same bits", "[codec][sparse]") {
  const auto dtype = GENERATE(DType::INT4, DType::INT8);
  const uint32_t block = GENERATE(1024u, 64u, 33u, 7u);
  const auto kind = GENERATE(Kind::Gaussian, Kind::FewLevels, Kind::MostlyZero);
  const size_t n = 9 * block + block / 2 + 1;
  const uint32_t topk = block / 8 + 1;
  INFO(dtype_name(dtype) << " block " << block << " kind " << static_cast<int>(kind));
  std::mt19937_64 rng(block + static_cast<size_t>(kind));
  const auto delta = make_block(kind, n, rng);
  std::vector<float> residual(n, 0.0f), scratch;
  const QuantizedTensor q =
      quantize_with_feedback(0, {static_cast<int64_t>(n)}, delta, residual, dtype, block, scratch, {}, topk);
  std::vector<uint8_t> gaps, values;
  sparse_pack(dtype, block, topk, n, q.payload, gaps, values);
  // The count is that of the values not 0 in the dense payload, counted here nibble by nibble.
  size_t nonzero = 0, last = 0;
  for (size_t i = 0; i < n; ++i) {
    const bool set = dtype == DType::INT8 ? q.payload[i] != 0 : ((q.payload[i / 2] >> (4 * (i % 2))) & 0xF) != 0;
    nonzero += set;
    if (set) last = i;
  }
  REQUIRE(nonzero > 0);
  CHECK(sparse_check(dtype, block, topk, n, gaps, values) == nonzero);
  CHECK(sparse_check(dtype, block, topk, last + 1, gaps, values) == nonzero);
  CHECK_THROWS_AS(sparse_check(dtype, block, topk, last, gaps, values), InvalidInput);  // the last one past the end
  std::vector<uint8_t> payload(q.payload.size(), 0x5A);
  sparse_unpack(dtype, n, gaps, values, payload);
  CHECK(payload == q.payload);
  std::vector<float> want(n), got(n, 3.0f);
  dequantize(q, want);
  sparse_dequantize(dtype, block, q.scales, gaps, values, got);
  CHECK(same_bits(got, want));
}
