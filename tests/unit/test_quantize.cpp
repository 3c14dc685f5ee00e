// Blockwise quantization and error feedback (core/codec/quantize.h). Expected values come from
// hand computation or from bounds stated in the issue, never from the code under test.
#include <catch2/catch.hpp>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/codec/quantize.h"
#include "core/errors.h"

using namespace diloco;

namespace {

std::vector<float> gaussian(size_t n, float stddev, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

std::vector<float> round_trip(const std::vector<float>& v, DType dtype, uint32_t block) {
  const QuantizedTensor q = quantize(0, {static_cast<int64_t>(v.size())}, v, dtype, block);
  std::vector<float> out(v.size(), -1.0f);
  dequantize(q, out);
  return out;
}

// |decoded - v| <= absmax(block) / levels for every value, block by block.
void check_block_bound(const std::vector<float>& v, const std::vector<float>& decoded,
                       uint32_t block, float levels) {
  REQUIRE(decoded.size() == v.size());
  for (size_t b = 0; b < v.size(); b += block) {
    const size_t end = std::min(v.size(), b + block);
    float absmax = 0;
    for (size_t i = b; i < end; ++i) absmax = std::max(absmax, std::fabs(v[i]));
    for (size_t i = b; i < end; ++i) {
      INFO("value " << i << " of block at " << b << ", absmax " << absmax);
      CHECK(std::fabs(decoded[i] - v[i]) <= absmax / levels);
    }
  }
}

uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }

}  // namespace

TEST_CASE("dtype names parse back", "[codec][quantize]") {
  CHECK(parse_dtype("fp32") == DType::F32);
  CHECK(parse_dtype("f32") == DType::F32);
  CHECK(parse_dtype("bf16") == DType::BF16);
  CHECK(parse_dtype("int8") == DType::INT8);
  CHECK(parse_dtype("int4") == DType::INT4);
  for (DType d : {DType::F32, DType::BF16, DType::INT8, DType::INT4})
    CHECK(parse_dtype(dtype_name(d)) == d);
  CHECK_THROWS_AS(parse_dtype("int2"), InvalidInput);
  CHECK_THROWS_AS(parse_dtype(""), InvalidInput);
}

TEST_CASE("payload and scale sizes", "[codec][quantize]") {
  CHECK(payload_bytes(DType::F32, 5) == 20);
  CHECK(payload_bytes(DType::BF16, 5) == 10);
  CHECK(payload_bytes(DType::INT8, 5) == 5);
  CHECK(payload_bytes(DType::INT4, 5) == 3);
  CHECK(payload_bytes(DType::INT4, 4) == 2);
  CHECK(payload_bytes(DType::INT4, 0) == 0);
  CHECK(num_blocks(DType::INT8, 128, 256) == 2);
  CHECK(num_blocks(DType::INT8, 128, 257) == 3);
  CHECK(num_blocks(DType::INT4, 1, 7) == 7);
  CHECK(num_blocks(DType::INT4, 128, 0) == 0);
  CHECK(num_blocks(DType::F32, 128, 1000) == 0);
  CHECK(num_blocks(DType::BF16, 0, 1000) == 0);
  CHECK_THROWS_AS(num_blocks(DType::INT8, 0, 10), InvalidInput);
  CHECK_THROWS_AS(payload_bytes(DType::INT8, -1), InvalidInput);
  CHECK_THROWS_AS(payload_bytes(static_cast<DType>(9), 1), InvalidInput);
}

TEST_CASE("int8 and int4 quantize known blocks by hand", "[codec][quantize]") {
  SECTION("int8: scale = absmax/127, round half to even, two's complement bytes") {
    const std::vector<float> v = {1.0f, -0.5f, 0.25f, 0.0f};
    const QuantizedTensor q = quantize(3, {4}, v, DType::INT8, 4);
    CHECK(q.index == 3);
    CHECK(q.block_size == 4);
    REQUIRE(q.scales.size() == 1);
    CHECK(q.scales[0] == 1.0f / 127.0f);
    // 127, round(-63.5) = -64 (half to even), round(31.75) = 32, 0
    CHECK(q.payload == std::vector<uint8_t>{0x7F, 0xC0, 0x20, 0x00});
  }
  SECTION("int4: scale = absmax/7, nibbles low first, two's complement") {
    const std::vector<float> v = {7.0f, -3.5f, 1.0f, 0.0f, -7.0f};
    const QuantizedTensor q = quantize(0, {5}, v, DType::INT4, 8);
    REQUIRE(q.scales.size() == 1);
    CHECK(q.scales[0] == 1.0f);
    // (7, round(-3.5) = -4 -> 0xC), (1, 0), (-7 -> 0x9, padding 0)
    CHECK(q.payload == std::vector<uint8_t>{0xC7, 0x01, 0x09});
    std::vector<float> out(5);
    dequantize(q, out);
    CHECK(out == std::vector<float>{7.0f, -4.0f, 1.0f, 0.0f, -7.0f});
  }
  SECTION("int4 with an odd block size straddling bytes") {
    const std::vector<float> v = {7.0f, 0.0f, -7.0f, 14.0f, 2.0f, 0.0f};  // blocks of 3
    const QuantizedTensor q = quantize(0, {6}, v, DType::INT4, 3);
    CHECK(q.scales == std::vector<float>{1.0f, 2.0f});
    // q = 7, 0, -7 | 7, 1, 0  -> bytes (7,0) (-7,7) (1,0)
    CHECK(q.payload == std::vector<uint8_t>{0x07, 0x79, 0x01});
  }
}

TEST_CASE("fp32 round trip is exact, bit for bit", "[codec][quantize]") {
  auto v = gaussian(1001, 3.0f, 1);
  v[5] = -0.0f;
  v[6] = std::numeric_limits<float>::denorm_min();
  v[7] = std::numeric_limits<float>::quiet_NaN();
  v[8] = -std::numeric_limits<float>::infinity();
  const QuantizedTensor q = quantize(0, {7, 11, 13}, v, DType::F32, 128);
  CHECK(q.scales.empty());
  CHECK(q.payload.size() == 4 * v.size());
  std::vector<float> out(v.size());
  dequantize(q, out);
  for (size_t i = 0; i < v.size(); ++i) CHECK(bits(out[i]) == bits(v[i]));
}

TEST_CASE("bf16 rounds to nearest even and keeps NaN", "[codec][quantize]") {
  SECTION("relative error below 2^-8") {
    const auto v = gaussian(999, 1e-3f, 2);
    const auto out = round_trip(v, DType::BF16, 0);
    for (size_t i = 0; i < v.size(); ++i)
      CHECK(std::fabs(out[i] - v[i]) < std::ldexp(std::fabs(v[i]), -8));
  }
  SECTION("known roundings") {
    const std::vector<float> v = {
        std::bit_cast<float>(0x3F808000u),  // 1 + 2^-8: tie, 0x3F80 is even -> 1.0
        std::bit_cast<float>(0x3F818000u),  // tie, 0x3F81 is odd -> 0x3F82
        std::bit_cast<float>(0x3F808001u),  // above the tie -> 0x3F81
        std::bit_cast<float>(0xBF80FFFFu),  // -> -(0x3F81)
        std::bit_cast<float>(0x7F7FFFFFu),  // FLT_MAX rounds to +Inf, as it should
        std::numeric_limits<float>::infinity(),
    };
    const QuantizedTensor q = quantize(0, {6}, v, DType::BF16, 0);
    CHECK(q.payload == std::vector<uint8_t>{0x80, 0x3F, 0x82, 0x3F, 0x81, 0x3F, 0x81, 0xBF,
                                            0x80, 0x7F, 0x80, 0x7F});
  }
  SECTION("NaN stays NaN, including a NaN whose payload is only in the low bits") {
    const std::vector<float> v = {std::bit_cast<float>(0x7F800001u),
                                  std::bit_cast<float>(0xFFC00000u)};
    const auto out = round_trip(v, DType::BF16, 0);
    CHECK(std::isnan(out[0]));
    CHECK(std::isnan(out[1]));
    CHECK(std::signbit(out[1]));
  }
}

TEST_CASE("int8 and int4 round trips stay within one step per block", "[codec][quantize]") {
  const auto dtype = GENERATE(DType::INT8, DType::INT4);
  const float levels = dtype == DType::INT8 ? 127.0f : 7.0f;
  const uint32_t block = GENERATE(1u, 2u, 3u, 32u, 128u, 1000u);
  const size_t n = GENERATE(size_t{1}, size_t{5}, size_t{127}, size_t{1001}, size_t{4096});
  INFO(dtype_name(dtype) << " block " << block << " n " << n);
  auto v = gaussian(n, 0.01f, 3 + n + block);
  if (n > 10) v[10] = 5.0f;  // an outlier: its block gets a coarse scale, the others do not
  const QuantizedTensor q = quantize(0, {static_cast<int64_t>(n)}, v, dtype, block);
  CHECK(q.scales.size() == (n + block - 1) / block);
  CHECK(q.payload.size() == (dtype == DType::INT8 ? n : (n + 1) / 2));
  std::vector<float> out(n);
  dequantize(q, out);
  check_block_bound(v, out, block, levels);
}

TEST_CASE("a zero block gets scale 0 and decodes to zeros", "[codec][quantize]") {
  const auto dtype = GENERATE(DType::INT8, DType::INT4);
  std::vector<float> v(300, 0.0f);
  v[260] = 1.0f;  // blocks 0 and 1 of 128 are zero, block 2 is not
  const QuantizedTensor q = quantize(0, {300}, v, dtype, 128);
  REQUIRE(q.scales.size() == 3);
  CHECK(q.scales[0] == 0.0f);
  CHECK(q.scales[1] == 0.0f);
  CHECK(q.scales[2] > 0.0f);
  std::vector<float> out(300, 7.0f);
  dequantize(q, out);
  for (size_t i = 0; i < 300; ++i) CHECK(out[i] == v[i]);

  const std::vector<float> zeros(1000, 0.0f);
  const auto zq = quantize(0, {10, 100}, zeros, dtype, 64);
  for (float s : zq.scales) CHECK(s == 0.0f);
  std::vector<float> zout(1000, 1.0f);
  dequantize(zq, zout);
  for (float x : zout) CHECK(x == 0.0f);
}

TEST_CASE("blocks too small for a normal scale are flushed to zero", "[codec][quantize]") {
  const std::vector<float> v = {1e-38f, -2e-38f, 0.0f, 3e-39f};  // absmax / 127 is subnormal
  const QuantizedTensor q = quantize(0, {4}, v, DType::INT8, 4);
  CHECK(q.scales == std::vector<float>{0.0f});
  std::vector<float> out(4, 1.0f);
  dequantize(q, out);
  for (float x : out) CHECK(x == 0.0f);
}

TEST_CASE("a NaN in a quantized block makes its scale NaN", "[codec][quantize]") {
  std::vector<float> v(256, 0.5f);
  v[130] = std::numeric_limits<float>::quiet_NaN();
  const QuantizedTensor q = quantize(0, {256}, v, DType::INT4, 128);
  CHECK(q.scales[0] == 0.5f / 7.0f);
  CHECK(std::isnan(q.scales[1]));  // so the decoder rejects it as non-finite
}

TEST_CASE("quantize and dequantize check their sizes", "[codec][quantize]") {
  const std::vector<float> v(12, 1.0f);
  CHECK_THROWS_AS(quantize(0, {5, 2}, v, DType::INT8, 4), InvalidInput);
  CHECK_THROWS_AS(quantize(0, {-1, -12}, v, DType::INT8, 4), InvalidInput);
  CHECK_THROWS_AS(quantize(0, {12}, v, DType::INT8, 0), InvalidInput);
  const QuantizedTensor q = quantize(0, {3, 4}, v, DType::INT4, 4);
  std::vector<float> wrong(11);
  CHECK_THROWS_AS(dequantize(q, wrong), InvalidInput);
  QuantizedTensor short_payload = q;
  short_payload.payload.pop_back();
  std::vector<float> out(12);
  CHECK_THROWS_AS(dequantize(short_payload, out), InvalidInput);
  std::vector<float> scales(2);
  std::vector<uint8_t> payload(6);
  CHECK_THROWS_AS(quantize_into(v, DType::INT4, 4, scales, payload), InvalidInput);
}

TEST_CASE("the span forms match quantize/dequantize", "[codec][quantize]") {
  const auto v = gaussian(777, 1.0f, 9);
  const QuantizedTensor q = quantize(0, {777}, v, DType::INT4, 64);
  std::vector<float> scales(q.scales.size());
  std::vector<uint8_t> payload(q.payload.size());
  quantize_into(v, DType::INT4, 64, scales, payload);
  CHECK(scales == q.scales);
  CHECK(payload == q.payload);
  std::vector<float> a(777), b(777);
  dequantize(q, a);
  dequantize_into(DType::INT4, 64, scales, payload, b);
  CHECK(a == b);
}

TEST_CASE("error feedback: the sum of what was sent tracks the sum of the deltas",
          "[codec][quantize][feedback]") {
  const auto dtype = GENERATE(DType::INT4, DType::INT8);
  const uint32_t block = GENERATE(128u, 7u);
  constexpr size_t n = 1000;
  ErrorFeedback feedback(n);
  std::vector<double> true_sum(n, 0.0), sent_sum(n, 0.0);
  std::vector<float> sent(n);
  float last_max_scale = 0;
  std::mt19937_64 rng(7);
  for (int push = 0; push < 100; ++push) {
    std::normal_distribution<float> dist(0.001f * (push % 3), 0.01f * (1 + push % 5));
    std::vector<float> delta(n);
    for (auto& x : delta) x = dist(rng);
    const QuantizedTensor q = feedback.push(2, {10, 100}, delta, dtype, block);
    CHECK(q.index == 2);
    dequantize(q, sent);
    for (size_t i = 0; i < n; ++i) {
      true_sum[i] += delta[i];
      sent_sum[i] += sent[i];
    }
    last_max_scale = *std::max_element(q.scales.begin(), q.scales.end());
  }
  INFO(dtype_name(dtype) << " block " << block << ", max scale of the last push "
                         << last_max_scale);
  for (size_t i = 0; i < n; ++i) CHECK(std::fabs(sent_sum[i] - true_sum[i]) <= last_max_scale);
  // What is still owed is exactly the residual.
  for (size_t i = 0; i < n; ++i)
    CHECK(std::fabs((true_sum[i] - sent_sum[i]) - feedback.residual()[i]) < 1e-5);
}

TEST_CASE("error feedback sends what plain quantization loses", "[codec][quantize][feedback]") {
  // One large value fixes the int4 scale at 1; the small ones (0.1) always round to 0 on their
  // own, so without feedback they are never sent.
  constexpr size_t n = 16;
  std::vector<float> delta(n, 0.1f);
  delta[0] = 7.0f;
  ErrorFeedback feedback(n);
  std::vector<float> sent(n), plain(n);
  double with = 0, without = 0;
  for (int push = 0; push < 50; ++push) {
    dequantize(feedback.push(0, {n}, delta, DType::INT4, n), sent);
    dequantize(quantize(0, {n}, delta, DType::INT4, n), plain);
    with += sent[5];
    without += plain[5];
  }
  CHECK(without == 0.0);
  CHECK(std::fabs(with - 50 * 0.1) <= 1.0);  // within one step (scale 1) of the true 5.0
  feedback.reset();
  for (float r : feedback.residual()) CHECK(r == 0.0f);
}

TEST_CASE("error feedback checks sizes and starts empty", "[codec][quantize][feedback]") {
  ErrorFeedback fresh;  // sized by its first push
  const std::vector<float> delta(10, 1.0f);
  CHECK_NOTHROW(fresh.push(0, {10}, delta, DType::INT8, 4));
  CHECK(fresh.residual().size() == 10);
  const std::vector<float> other(11, 1.0f);
  CHECK_THROWS_AS(fresh.push(0, {11}, other, DType::INT8, 4), InvalidInput);
  CHECK_THROWS_AS(fresh.push(0, {3, 3}, delta, DType::INT8, 4), InvalidInput);
  ErrorFeedback exact(10);
  std::vector<float> out(10);
  dequantize(exact.push(0, {10}, delta, DType::F32, 0), out);
  CHECK(out == delta);
  for (float r : exact.residual()) CHECK(r == 0.0f);
}

TEST_CASE("top-k sends only the largest values of each block and carries the rest",
          "[codec][quantize][feedback][topk]") {
  const auto dtype = GENERATE(DType::INT4, DType::INT8);
  const uint32_t block = GENERATE(64u, 100u);
  const uint32_t topk = GENERATE(1u, 5u);
  constexpr size_t n = 1000;  // the last block is shorter (1000 % 64 = 40, 1000 % 100 = 0)
  const auto delta = gaussian(n, 0.01f, 21);
  ErrorFeedback feedback(n);
  const QuantizedTensor q = feedback.push(0, {n}, delta, dtype, block, topk);
  std::vector<float> sent(n);
  dequantize(q, sent);
  for (size_t b = 0; b < n; b += block) {
    const size_t end = std::min(n, b + size_t{block});
    // Every value sent is one of the topk largest of its block: no value left out is larger than
    // the smallest one that went.
    size_t nonzero = 0;
    float smallest_sent = INFINITY, largest_held = 0;
    for (size_t i = b; i < end; ++i) {
      if (sent[i] != 0.0f) {
        ++nonzero;
        smallest_sent = std::min(smallest_sent, std::fabs(delta[i]));
      } else {
        largest_held = std::max(largest_held, std::fabs(delta[i]));
      }
    }
    INFO(dtype_name(dtype) << " block " << block << " topk " << topk << " at " << b);
    CHECK(nonzero <= topk);
    CHECK(nonzero >= 1);  // the largest value of a block quantizes to the largest level
    CHECK(largest_held <= smallest_sent);
  }
  // Nothing is lost: what was not sent is exactly in the residual.
  for (size_t i = 0; i < n; ++i) CHECK(std::fabs(delta[i] - sent[i] - feedback.residual()[i]) < 1e-7f);
}

TEST_CASE("top-k with error feedback: every value is sent in time", "[codec][quantize][feedback][topk]") {
  // 16 values per block, 2 sent per push: a value held back grows by its delta every push until
  // it is among the largest, so the sums of sent and true deltas stay within a few pushes.
  constexpr size_t n = 64;
  std::vector<float> delta(n);
  for (size_t i = 0; i < n; ++i) delta[i] = 0.001f * static_cast<float>(1 + i % 16);
  ErrorFeedback feedback(n);
  std::vector<double> sent_sum(n, 0.0);
  std::vector<float> sent(n);
  constexpr int pushes = 400;
  for (int push = 0; push < pushes; ++push) {
    dequantize(feedback.push(0, {n}, delta, DType::INT8, 16, 2), sent);
    for (size_t i = 0; i < n; ++i) sent_sum[i] += sent[i];
  }
  for (size_t i = 0; i < n; ++i) {
    INFO("value " << i);
    CHECK(sent_sum[i] > 0);
    // Owed = residual, and the residual stays bounded (about 8 pushes' worth of the largest delta).
    CHECK(std::fabs(pushes * delta[i] - sent_sum[i] - feedback.residual()[i]) < 1e-3);
    CHECK(std::fabs(feedback.residual()[i]) < 0.016f * 9);
  }
}

TEST_CASE("top-k: ties keep the first values, a NaN is kept, ranges give the same bits",
          "[codec][quantize][feedback][topk]") {
  std::vector<float> ties(8, 1.0f);
  ErrorFeedback feedback(8);
  std::vector<float> sent(8);
  dequantize(feedback.push(0, {8}, ties, DType::INT4, 8, 3), sent);
  for (size_t i = 0; i < 8; ++i) CHECK((sent[i] != 0.0f) == (i < 3));

  std::vector<float> with_nan(8, 0.5f);
  with_nan[6] = NAN;
  std::vector<float> residual(8), scratch;
  const QuantizedTensor bad = quantize_with_feedback(0, {8}, with_nan, residual, DType::INT4, 8, scratch, {}, 1);
  CHECK_FALSE(std::isfinite(bad.scales[0]));  // as without top-k: decoders reject the block

  constexpr size_t n = 6 * 64;
  const auto delta = gaussian(n, 0.02f, 5);
  std::vector<float> whole_residual(n, 0.0f), split_residual(n, 0.0f), whole_sent(n), split_sent(n);
  const QuantizedTensor whole =
      quantize_with_feedback(0, {n}, delta, whole_residual, DType::INT4, 64, scratch, whole_sent, 4);
  QuantizedTensor split = feedback_result(0, {n}, DType::INT4, 64);
  feedback_range(split, delta, split_residual, split_sent, 256, n, scratch, 4);
  feedback_range(split, delta, split_residual, split_sent, 0, 256, scratch, 4);
  CHECK(split.payload == whole.payload);
  CHECK(split.scales == whole.scales);
  CHECK(split_residual == whole_residual);
  CHECK(split_sent == whole_sent);
}

TEST_CASE("feedback_range takes a range's delta and residual alone and gives the whole tensor's bits",
          "[codec][quantize][feedback]") {
  constexpr size_t n = 5 * 64 + 10;  // a last block that is not whole
  const auto delta = gaussian(n, 0.02f, 6);
  const auto start = gaussian(n, 0.01f, 7);
  for (const uint32_t topk : {0u, 4u}) {
    std::vector<float> whole_residual = start, scratch;
    const QuantizedTensor whole =
        quantize_with_feedback(0, {n}, delta, whole_residual, DType::INT4, 64, scratch, {}, topk);
    QuantizedTensor split = feedback_result(0, {n}, DType::INT4, 64);
    std::vector<float> pieces_residual;
    for (size_t b = 0; b < n; b += 128) {
      const size_t e = std::min(n, b + 128);
      const std::vector<float> d(delta.begin() + b, delta.begin() + e);
      std::vector<float> r(start.begin() + b, start.begin() + e);
      feedback_range(split, d, r, {}, b, e, scratch, topk);
      pieces_residual.insert(pieces_residual.end(), r.begin(), r.end());
    }
    CHECK(split.payload == whole.payload);
    CHECK(split.scales == whole.scales);
    CHECK(pieces_residual == whole_residual);
  }
  QuantizedTensor q = feedback_result(0, {n}, DType::INT4, 64);
  std::vector<float> scratch, three(3), r(128);
  CHECK_THROWS_AS(feedback_range(q, three, r, {}, 0, 128, scratch), InternalError);  // neither n nor the range
}

TEST_CASE("top-k is refused where it has no meaning", "[codec][quantize][topk]") {
  CHECK_NOTHROW(check_topk(DType::F32, 0, 0, "codec.topk"));
  CHECK_NOTHROW(check_topk(DType::INT4, 64, 63, "codec.topk"));
  CHECK_THROWS_WITH(check_topk(DType::INT4, 64, 64, "codec.topk"), Catch::Contains("below the block size"));
  CHECK_THROWS_WITH(check_topk(DType::F32, 0, 4, "codec.topk"), Catch::Contains("int8 or int4"));
  CHECK_THROWS_WITH(check_topk(DType::BF16, 0, 4, "codec.downlink_topk"), Catch::Contains("codec.downlink_topk"));
  std::vector<float> delta(16, 1.0f), residual(16), scratch;
  CHECK_THROWS_AS(quantize_with_feedback(0, {16}, delta, residual, DType::INT8, 16, scratch, {}, 16), InvalidInput);
}
