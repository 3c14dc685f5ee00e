// Aggregation of one tensor's outer gradients: weighted average and radial-directional averaging
// (RDA), with the fallbacks RDA needs, against straightforward double-precision references.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <limits>
#include <random>
#include <vector>

#include "core/errors.h"
#include "merger/aggregate.h"

using namespace diloco;

namespace {

using Vec = std::vector<float>;

Vec aggregate(MergeRule rule, const std::vector<Vec>& deltas, std::vector<double> raw_weights) {
  std::vector<std::span<const float>> views(deltas.begin(), deltas.end());
  const auto weights = normalised_weights(raw_weights);
  Vec out(deltas.at(0).size(), std::numeric_limits<float>::quiet_NaN());
  aggregate_tensor(rule, views, weights, out);
  return out;
}

double norm(const Vec& v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s);
}

Vec random_vec(std::mt19937& rng, size_t n, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  Vec v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

}  // namespace

TEST_CASE("embeddings are always plainly averaged", "[merger]") {
  CHECK(is_embedding("token_embedding"));
  CHECK(is_embedding("position_embedding"));
  CHECK_FALSE(is_embedding("head"));
  CHECK_FALSE(is_embedding("blocks.0.attn.qkv"));
  CHECK_FALSE(is_embedding("embedding_norm"));
  CHECK(tensor_rule(MergeRule::RadialDirectional, "token_embedding") == MergeRule::WeightedAverage);
  CHECK(tensor_rule(MergeRule::RadialDirectional, "head") == MergeRule::RadialDirectional);
  CHECK(tensor_rule(MergeRule::WeightedAverage, "head") == MergeRule::WeightedAverage);
}

TEST_CASE("weights are normalised to sum 1 in order", "[merger]") {
  CHECK(normalised_weights(std::vector<double>{1, 3}) == std::vector<double>{0.25, 0.75});
  CHECK(normalised_weights(std::vector<double>{5}) == std::vector<double>{1.0});
  CHECK(normalised_weights(std::vector<double>{0, 2}) == std::vector<double>{0.0, 1.0});
  CHECK(normalised_weights(std::vector<double>{1e30, 1e30}) == std::vector<double>{0.5, 0.5});
}

TEST_CASE("weights that do not make a merge are rejected", "[merger]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  CHECK_THROWS_AS(normalised_weights({}), InvalidInput);
  CHECK_THROWS_AS(normalised_weights(std::vector<double>{0, 0}), InvalidInput);
  CHECK_THROWS_AS(normalised_weights(std::vector<double>{1, -1}), InvalidInput);
  CHECK_THROWS_AS(normalised_weights(std::vector<double>{1, nan}), InvalidInput);
  CHECK_THROWS_AS(normalised_weights(std::vector<double>{1, inf}), InvalidInput);
  CHECK_THROWS_AS(normalised_weights(std::vector<double>{1e308, 1e308}), InvalidInput);
}

TEST_CASE("l2 norm over any length", "[merger]") {
  CHECK(l2_norm(Vec{3, 4}) == 5.0);
  CHECK(l2_norm(Vec{}) == 0.0);
  std::mt19937 rng(7);
  for (size_t n : {1u, 7u, 8u, 9u, 63u, 1000u, 4097u}) {
    const Vec v = random_vec(rng, n, 1.0f);
    CHECK(l2_norm(v) == Approx(norm(v)).epsilon(1e-12));
  }
  // Squares are summed in double: no fp32 overflow.
  CHECK(l2_norm(Vec{3e30f, 4e30f}) == Approx(5e30).epsilon(1e-6));
}

TEST_CASE("weighted average", "[merger]") {
  const Vec a{1, 2, 3}, b{3, 2, -1};
  CHECK(aggregate(MergeRule::WeightedAverage, {a, b}, {1, 1}) == Vec{2, 2, 1});
  CHECK(aggregate(MergeRule::WeightedAverage, {a, b}, {3, 1}) == Vec{1.5f, 2, 2});
  CHECK(aggregate(MergeRule::WeightedAverage, {a, b}, {0, 1}) == b);
  CHECK(aggregate(MergeRule::WeightedAverage, {a}, {42}) == a);
}

TEST_CASE("RDA of two orthogonal deltas keeps their length", "[merger]") {
  const Vec a{2, 0}, b{0, 2};
  const Vec avg = aggregate(MergeRule::WeightedAverage, {a, b}, {1, 1});
  const Vec rda = aggregate(MergeRule::RadialDirectional, {a, b}, {1, 1});
  CHECK(norm(avg) == Approx(std::sqrt(2.0)));
  CHECK(norm(rda) == Approx(2.0).epsilon(1e-6));
  CHECK(rda[0] == Approx(std::sqrt(2.0)).epsilon(1e-6));
  CHECK(rda[1] == Approx(std::sqrt(2.0)).epsilon(1e-6));
}

TEST_CASE("RDA of one delta is that delta, bit for bit", "[merger]") {
  std::mt19937 rng(1);
  const Vec d = random_vec(rng, 100, 0.01f);
  CHECK(aggregate(MergeRule::RadialDirectional, {d}, {123}) == d);
}

TEST_CASE("RDA falls back to the average when the directions cancel", "[merger]") {
  const Vec a{1, -2, 0.5f}, b{-1, 2, -0.5f};
  CHECK(aggregate(MergeRule::RadialDirectional, {a, b}, {1, 1}) == Vec{0, 0, 0});
  // Three unit vectors at 120 degrees cancel too.
  const float s = std::sqrt(3.0f) / 2;
  const Vec u{1, 0}, v{-0.5f, s}, w{-0.5f, -s};
  const Vec rda = aggregate(MergeRule::RadialDirectional, {u, v, w}, {1, 1, 1});
  CHECK(rda == aggregate(MergeRule::WeightedAverage, {u, v, w}, {1, 1, 1}));
  CHECK(norm(rda) < 1e-6);
}

TEST_CASE("RDA of opposite deltas with unequal weights keeps the mean length", "[merger]") {
  // Directions: 0.75 u - 0.25 u = 0.5 u, not cancelled; length 0.75 * 1 + 0.25 * 1 = 1.
  const Vec a{1, 0}, b{-1, 0};
  const Vec rda = aggregate(MergeRule::RadialDirectional, {a, b}, {3, 1});
  CHECK(rda[0] == Approx(1.0).epsilon(1e-6));
  CHECK(rda[1] == 0.0f);
}

TEST_CASE("RDA skips zero deltas in the direction", "[merger]") {
  const Vec d{0.5f, -1, 2}, zero{0, 0, 0};
  // One delta with a direction: RDA is the weighted average, exactly.
  CHECK(aggregate(MergeRule::RadialDirectional, {d, zero}, {1, 1}) ==
        aggregate(MergeRule::WeightedAverage, {d, zero}, {1, 1}));
  CHECK(aggregate(MergeRule::RadialDirectional, {zero, zero}, {1, 2}) == zero);
  // Two parallel deltas and a zero one: length (1 + 3 + 0) / 3 |d|, direction d.
  Vec d3(3);
  for (size_t k = 0; k < 3; ++k) d3[k] = 3 * d[k];
  const Vec rda = aggregate(MergeRule::RadialDirectional, {d, d3, zero}, {1, 1, 1});
  for (size_t k = 0; k < 3; ++k) CHECK(rda[k] == Approx(4.0 / 3 * d[k]).epsilon(1e-6));
}

TEST_CASE("RDA matches a straightforward double computation", "[merger]") {
  std::mt19937 rng(42);
  for (int trial = 0; trial < 20; ++trial) {
    const size_t m = 2 + trial % 7, n = 1 + (trial * 37) % 300;
    std::vector<Vec> deltas;
    std::vector<double> raw;
    std::uniform_real_distribution<double> wdist(0.1, 10);
    for (size_t i = 0; i < m; ++i) {
      deltas.push_back(random_vec(rng, n, 0.01f * (1 + i)));
      raw.push_back(wdist(rng));
    }
    double total = 0;
    for (double w : raw) total += w;
    double mean_norm = 0;
    std::vector<double> dir(n, 0.0);
    for (size_t i = 0; i < m; ++i) {
      const double w = raw[i] / total, len = norm(deltas[i]);
      mean_norm += w * len;
      for (size_t k = 0; k < n; ++k) dir[k] += w * deltas[i][k] / len;
    }
    double dir_norm = 0;
    for (double x : dir) dir_norm += x * x;
    dir_norm = std::sqrt(dir_norm);

    const Vec rda = aggregate(MergeRule::RadialDirectional, deltas, raw);
    CHECK(norm(rda) == Approx(mean_norm).epsilon(1e-5));
    for (size_t k = 0; k < n; ++k)
      REQUIRE(rda[k] == Approx(mean_norm * dir[k] / dir_norm).epsilon(1e-4).margin(1e-8));
  }
}

TEST_CASE("RDA does not shrink as learners multiply, the average does", "[merger]") {
  std::mt19937 rng(3);
  const size_t n = 4096;
  for (size_t m : {2u, 8u, 16u}) {
    std::vector<Vec> deltas;
    for (size_t i = 0; i < m; ++i) deltas.push_back(random_vec(rng, n, 1.0f));
    const std::vector<double> raw(m, 1.0);
    const double mean = norm(deltas[0]);  // all about sqrt(n)
    CHECK(norm(aggregate(MergeRule::RadialDirectional, deltas, raw)) == Approx(mean).epsilon(0.05));
    CHECK(norm(aggregate(MergeRule::WeightedAverage, deltas, raw)) ==
          Approx(mean / std::sqrt(double(m))).epsilon(0.1));
  }
}

TEST_CASE("aggregation is deterministic", "[merger]") {
  std::mt19937 rng(9);
  std::vector<Vec> deltas;
  for (int i = 0; i < 5; ++i) deltas.push_back(random_vec(rng, 10'001, 0.02f));
  const std::vector<double> raw{1, 2, 3, 4, 5};
  for (auto rule : {MergeRule::RadialDirectional, MergeRule::WeightedAverage})
    CHECK(aggregate(rule, deltas, raw) == aggregate(rule, deltas, raw));
}

TEST_CASE("aggregate_tensor rejects malformed calls", "[merger]") {
  const Vec a{1, 2}, b{1, 2, 3};
  Vec out(2);
  const std::vector<double> one{1.0}, two{0.5, 0.5};
  std::vector<std::span<const float>> none, mismatched{a, b}, single{a};
  CHECK_THROWS_AS(aggregate_tensor(MergeRule::WeightedAverage, none, {}, out), InternalError);
  CHECK_THROWS_AS(aggregate_tensor(MergeRule::WeightedAverage, mismatched, two, out),
                  InternalError);
  CHECK_THROWS_AS(aggregate_tensor(MergeRule::RadialDirectional, single, two, out),
                  InternalError);
  CHECK_THROWS_AS(aggregate_tensor(static_cast<MergeRule>(9), single, one, out), InternalError);
}

namespace {

// The aggregate as a merge computed it while it held the tensor's weighted sum whole: the sum in
// one buffer, its norm read from that buffer (l2_norm with the merge's norm_block), then scaled.
// TensorAggregate never holds the sum; it must give these bits.
Vec held_sum_aggregate(MergeRule rule, const std::vector<Vec>& deltas, const std::vector<double>& weights,
                       const MergeWork& work) {
  const size_t n = deltas[0].size();
  const auto weighted = [&](const std::vector<float>& c) {
    Vec out(n);
    for (size_t k = 0; k < n; ++k) out[k] = c[0] * deltas[0][k];
    for (size_t i = 1; i < deltas.size(); ++i)
      for (size_t k = 0; k < n; ++k) out[k] += c[i] * deltas[i][k];
    return out;
  };
  const std::vector<float> plain(weights.begin(), weights.end());
  if (rule == MergeRule::WeightedAverage) return weighted(plain);
  double mean_norm = 0, directed_weight = 0;
  size_t directed = 0;
  std::vector<float> c(deltas.size(), 0.0f);
  for (size_t i = 0; i < deltas.size(); ++i) {
    const double len = l2_norm(std::span<const float>(deltas[i]), work);
    mean_norm += weights[i] * len;
    if (len <= 1e-30 || weights[i] == 0) continue;
    c[i] = static_cast<float>(weights[i] / len);
    directed_weight += weights[i];
    ++directed;
  }
  if (directed <= 1) return weighted(plain);
  Vec out = weighted(c);
  const double direction = l2_norm(std::span<const float>(out), work);
  if (direction <= 1e-5 * directed_weight) return weighted(plain);
  const auto scale = static_cast<float>(mean_norm / direction);
  for (float& x : out) x *= scale;
  return out;
}

}  // namespace

TEST_CASE("TensorAggregate gives the bits of the weighted sum held whole, a range at a time", "[merger]") {
  std::mt19937 rng(17);
  // Longer than two norm blocks and not a multiple of one, so that blocks, pieces and the
  // last short range all occur.
  const size_t n = 2 * kNormBlock + 12'345;
  for (const uint32_t norm_block : {0u, kNormBlock}) {
    const MergeWork work{.norm_block = norm_block};
    for (const auto& [what, make] : std::vector<std::pair<std::string, std::function<std::vector<Vec>()>>>{
             {"three deltas", [&] { return std::vector<Vec>{random_vec(rng, n, 0.01f), random_vec(rng, n, 0.02f),
                                                             random_vec(rng, n, 0.03f)}; }},
             {"one direction and a zero delta", [&] { return std::vector<Vec>{random_vec(rng, n, 0.01f), Vec(n, 0.0f)}; }},
             {"opposite deltas (cancelled)", [&] {
                Vec a = random_vec(rng, n, 0.01f), b = a;
                for (float& x : b) x = -x;
                return std::vector<Vec>{a, b};
              }}}) {
      const std::vector<Vec> deltas = make();
      std::vector<double> raw;
      for (size_t i = 0; i < deltas.size(); ++i) raw.push_back(1.0 + static_cast<double>(i));
      const auto weights = normalised_weights(raw);
      const std::vector<TensorReader> readers(deltas.begin(), deltas.end());
      for (auto rule : {MergeRule::RadialDirectional, MergeRule::WeightedAverage}) {
        INFO(what << ", rule " << static_cast<int>(rule) << ", norm_block " << norm_block);
        const Vec want = held_sum_aggregate(rule, deltas, weights, work);
        const TensorAggregate aggregate(rule, readers, weights, work);
        REQUIRE(aggregate.size() == n);
        // Ranges of an odd length that starts anywhere, as no caller divides them.
        Vec got(n, std::numeric_limits<float>::quiet_NaN());
        for (size_t b = 0; b < n; b += 7'777) {
          const size_t e = std::min(n, b + 7'777);
          aggregate.values(b, e, std::span<float>(got).subspan(b, e - b));
        }
        REQUIRE(std::memcmp(got.data(), want.data(), n * sizeof(float)) == 0);
        // With the weighted directions kept in a buffer instead of computed again.
        Vec keep(n);
        const TensorAggregate kept(rule, readers, weights, work, keep);
        got.assign(n, std::numeric_limits<float>::quiet_NaN());
        for (size_t b = 0; b < n; b += 7'777) {
          const size_t e = std::min(n, b + 7'777);
          kept.values(b, e, std::span<float>(got).subspan(b, e - b));
        }
        REQUIRE(std::memcmp(got.data(), want.data(), n * sizeof(float)) == 0);
        Vec whole(n);
        aggregate_tensor(rule, readers, weights, whole, work);
        REQUIRE(std::memcmp(whole.data(), want.data(), n * sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE("TensorAggregate refuses a range that does not fit", "[merger]") {
  const Vec a{1, 2, 3};
  const std::vector<TensorReader> readers{TensorReader(a)};
  const std::vector<double> one{1.0};
  const TensorAggregate aggregate(MergeRule::RadialDirectional, readers, one);
  Vec out(2);
  CHECK_THROWS_AS(aggregate.values(2, 4, out), InternalError);
  CHECK_THROWS_AS(aggregate.values(0, 3, out), InternalError);
  CHECK_NOTHROW(aggregate.values(1, 3, out));
  CHECK(out == Vec{2, 3});
  Vec small(2);
  const Vec b{3, 2, 1};
  const std::vector<TensorReader> two{TensorReader(a), TensorReader(b)};
  const std::vector<double> halves{0.5, 0.5};
  CHECK_THROWS_AS(TensorAggregate(MergeRule::RadialDirectional, two, halves, {}, small), InternalError);
}
