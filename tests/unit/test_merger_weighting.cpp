// Weight of a delta: tokens * (tokens / steps) * (1 + staleness)^(-alpha), and the staleness limit.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "core/errors.h"
#include "merger/weighting.h"

using namespace diloco;

TEST_CASE("weight is tokens times tokens per step", "[merger]") {
  CHECK(delta_weight(100, 10, 0, 0.0f) == 1000.0);
  CHECK(delta_weight(100, 100, 0, 0.0f) == 100.0);
  // Same tokens in fewer steps (bigger batches) count more: "quantity times quality".
  CHECK(delta_weight(100, 5, 0, 0.0f) > delta_weight(100, 10, 0, 0.0f));
  // Large counters stay exact enough in double.
  CHECK(delta_weight(1'000'000'000ull, 1000, 0, 0.0f) == Approx(1e15));
}

TEST_CASE("a delta of zero steps weighs zero", "[merger]") {
  CHECK(delta_weight(100, 0, 0, 0.0f) == 0.0);
  CHECK(delta_weight(100, 0, 3, 1.0f) == 0.0);
}

TEST_CASE("staleness discount g(s) = (1 + s)^-alpha", "[merger]") {
  for (uint64_t s : {0ull, 1ull, 5ull, 1'000'000'000ull}) CHECK(staleness_factor(s, 0.0f) == 1.0);
  CHECK(staleness_factor(0, 1.0f) == 1.0);
  CHECK(staleness_factor(1, 1.0f) == 0.5);
  CHECK(staleness_factor(3, 2.0f) == 1.0 / 16);
  CHECK(staleness_factor(3, 0.5f) == 0.5);
  CHECK(delta_weight(100, 10, 1, 1.0f) == 500.0);
  // Monotone: staler deltas never weigh more.
  double previous = 2;
  for (uint64_t s = 0; s < 50; ++s) {
    const double g = staleness_factor(s, 0.7f);
    CHECK(g < previous);
    CHECK(g > 0);
    previous = g;
  }
}

TEST_CASE("max_staleness: 0 accepts only fresh deltas, kUnlimitedStaleness accepts any",
          "[merger]") {
  CHECK_FALSE(too_stale(0, 0));
  CHECK(too_stale(1, 0));
  CHECK_FALSE(too_stale(3, 3));
  CHECK(too_stale(4, 3));
  CHECK_FALSE(too_stale(0, kUnlimitedStaleness));
  CHECK_FALSE(too_stale(kUnlimitedStaleness, kUnlimitedStaleness));
  CHECK_FALSE(too_stale(1ull << 40, kUnlimitedStaleness));
}

TEST_CASE("weigh fills staleness and weight for a version", "[merger]") {
  DeltaRef ref;
  ref.base_version = 7;
  ref.tokens = 100;
  ref.inner_steps = 10;
  OuterHyper hyper;
  hyper.staleness_alpha = 1.0f;
  weigh(ref, 8, hyper);
  CHECK(ref.staleness == 1);
  CHECK(ref.weight == 500.0);
  weigh(ref, 7, hyper);
  CHECK(ref.staleness == 0);
  CHECK(ref.weight == 1000.0);
  CHECK_THROWS_AS(weigh(ref, 6, hyper), InternalError);
}

namespace {
DeltaRef ref_of(uint64_t tokens, uint32_t steps, uint64_t staleness) {
  DeltaRef r;
  r.tokens = tokens;
  r.inner_steps = steps;
  r.staleness = staleness;
  return r;
}
}  // namespace

TEST_CASE("staleness scale: the token-weighted mean of g(s) over a merge's inputs", "[merger]") {
  // Weights 100*10 = 1000 (fresh) and 200*20 = 4000 (staleness 3, g = 0.5 with alpha 0.5).
  const std::vector<DeltaRef> refs{ref_of(100, 10, 0), ref_of(200, 10, 3)};
  CHECK(staleness_scale(refs, 0.5f) == Approx((1000 * 1.0 + 4000 * 0.5) / 5000));
  CHECK(staleness_scale(refs, 0.0f) == 1.0);
  CHECK(staleness_scale(std::vector<DeltaRef>{ref_of(100, 10, 3)}, 0.5f) == 0.5);
  CHECK(staleness_scale(std::vector<DeltaRef>{ref_of(100, 10, 0)}, 2.0f) == 1.0);
  CHECK(staleness_scale(std::vector<DeltaRef>{ref_of(100, 0, 3)}, 0.5f) == 1.0);  // no weight
  CHECK(staleness_scale({}, 0.5f) == 1.0);
}

TEST_CASE("CGAD age factor: exponential decay under a cosine gate that closes at the cutoff", "[merger]") {
  CHECK(cgad_age_factor(0, 0.1f, 8) == 1.0);
  CHECK(cgad_age_factor(4, 0.1f, 8) == Approx(std::exp(-0.4) * 0.5));
  CHECK(cgad_age_factor(2, 0.0f, 8) == Approx(0.5 * (1 + std::cos(M_PI / 4))));
  CHECK(cgad_age_factor(8, 0.1f, 8) == 0.0);
  CHECK(cgad_age_factor(100, 0.1f, 8) == 0.0);
  for (uint64_t s = 0; s + 1 < 8; ++s) CHECK(cgad_age_factor(s + 1, 0.1f, 8) < cgad_age_factor(s, 0.1f, 8));
  const std::vector<DeltaRef> refs{ref_of(100, 10, 0), ref_of(100, 10, 8)};
  CHECK(cgad_age_scale(refs, 0.1f, 8) == 0.5);
}
