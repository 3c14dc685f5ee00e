// The outer optimizer: Nesterov momentum (DiLoCo's outer SGD) and plain SGD, per element in fp32.
#include <catch2/catch.hpp>

#include <vector>

#include "core/errors.h"
#include "merger/outer_optimizer.h"

using namespace diloco;

TEST_CASE("Nesterov from zero momentum moves by lr * (d + mu * d)", "[merger]") {
  std::vector<float> theta{1.0f, -2.0f, 0.0f};
  std::vector<float> buf(3, 0.0f);
  const std::vector<float> d{0.5f, 0.5f, -1.0f};
  outer_step(OuterOptimizerKind::Nesterov, 0.7f, 0.9f, theta, buf, d);
  // 0.7 * (0.5 + 0.9 * 0.5) = 0.665
  CHECK(theta[0] == Approx(1.0 - 0.665).epsilon(1e-6));
  CHECK(theta[1] == Approx(-2.0 - 0.665).epsilon(1e-6));
  CHECK(theta[2] == Approx(1.33).epsilon(1e-6));
  CHECK(buf == std::vector<float>{0.5f, 0.5f, -1.0f});

  // Second step with the same delta: buf = 0.9 * 0.5 + 0.5 = 0.95, step 0.7 * (0.5 + 0.855).
  outer_step(OuterOptimizerKind::Nesterov, 0.7f, 0.9f, theta, buf, d);
  CHECK(buf[0] == Approx(0.95).epsilon(1e-6));
  CHECK(theta[0] == Approx(1.0 - 0.665 - 0.9485).epsilon(1e-6));
}

TEST_CASE("Nesterov with momentum 0 is SGD", "[merger]") {
  std::vector<float> a{1.0f, 2.0f}, b{1.0f, 2.0f}, buf_a(2, 0.0f), buf_b(2, 0.0f);
  const std::vector<float> d{0.25f, -0.5f};
  outer_step(OuterOptimizerKind::Nesterov, 0.5f, 0.0f, a, buf_a, d);
  outer_step(OuterOptimizerKind::Sgd, 0.5f, 0.0f, b, buf_b, d);
  CHECK(a == b);
}

TEST_CASE("SGD ignores and keeps the momentum buffer", "[merger]") {
  std::vector<float> theta{1.0f, 1.0f};
  std::vector<float> buf{3.0f, -3.0f};
  outer_step(OuterOptimizerKind::Sgd, 0.7f, 0.9f, theta, buf, std::vector<float>{0.5f, -0.5f});
  CHECK(theta[0] == Approx(0.65f));
  CHECK(theta[1] == Approx(1.35f));
  CHECK(buf == std::vector<float>{3.0f, -3.0f});
}

TEST_CASE("SGD with lr 1 and one learner adopts the learner's parameters", "[merger]") {
  // delta = anchor - theta_learner, so anchor - 1 * delta = theta_learner.
  std::vector<float> anchor{0.5f, 0.25f, -1.0f};
  const std::vector<float> learner{0.75f, 0.0f, -0.5f};
  std::vector<float> delta(3), buf(3, 0.0f);
  for (size_t k = 0; k < 3; ++k) delta[k] = anchor[k] - learner[k];
  outer_step(OuterOptimizerKind::Sgd, 1.0f, 0.9f, anchor, buf, delta);
  CHECK(anchor == learner);
}

TEST_CASE("outer_step rejects mismatched sizes", "[merger]") {
  std::vector<float> theta(3), buf(3), d(2), short_buf(2);
  CHECK_THROWS_AS(outer_step(OuterOptimizerKind::Nesterov, 0.7f, 0.9f, theta, buf, d),
                  InternalError);
  CHECK_THROWS_AS(outer_step(OuterOptimizerKind::Sgd, 0.7f, 0.9f, theta, short_buf, theta),
                  InternalError);
  CHECK_THROWS_AS(outer_step(static_cast<OuterOptimizerKind>(7), 0.7f, 0.9f, theta, buf, theta),
                  InternalError);
}

TEST_CASE("initial momentum is zero and shaped like the parameters", "[merger]") {
  const std::vector<DenseTensor> params{{0, {2, 3}, std::vector<float>(6, 1.5f)},
                                        {1, {4}, std::vector<float>(4, -2.0f)}};
  const auto momentum = initial_momentum(params);
  REQUIRE(momentum.size() == 2);
  for (size_t t = 0; t < 2; ++t) {
    CHECK(momentum[t].index == params[t].index);
    CHECK(momentum[t].shape == params[t].shape);
    CHECK(momentum[t].values == std::vector<float>(params[t].values.size(), 0.0f));
  }
}

TEST_CASE("outer_step scales the update by the merge's share, momentum included", "[merger]") {
  std::vector<float> theta{1.0f, -2.0f}, buf{0.5f, 0.25f}, d{0.4f, -0.8f};
  outer_step(OuterOptimizerKind::Nesterov, 0.7f, 0.9f, theta, buf, d, 0.5f);
  CHECK(buf[0] == Approx(0.9 * 0.5 + 0.2));
  CHECK(theta[0] == Approx(1.0 - 0.7 * (0.2 + 0.9 * (0.9 * 0.5 + 0.2))));
  std::vector<float> sgd{1.0f, -2.0f};
  outer_step(OuterOptimizerKind::Sgd, 0.7f, 0.9f, sgd, buf, d, 0.25f);
  CHECK(sgd[1] == Approx(-2.0 - 0.7 * 0.25 * -0.8));
}
