// The outer optimizers, per element in fp32: Nesterov momentum (DiLoCo's outer SGD), plain SGD,
// Delayed Nesterov and CGAD's Adam step, against values computed by hand.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "core/errors.h"
#include "merger/outer_optimizer.h"

using namespace diloco;

namespace {

// Nesterov or Sgd (no second buffer) with only lr and momentum set, as most cases below need.
void outer_step(OuterOptimizerKind kind, float lr, float momentum, std::span<float> params,
                std::span<float> buf, std::span<const float> update, float share = 1.0f) {
  diloco::outer_step(kind, OuterHyper{.lr = lr, .momentum = momentum}, 0, params, buf, {}, update, share);
}

}  // namespace

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

namespace {

// Runs `kind` over merges making versions first_version, first_version + 1, ... with one update
// per merge (two elements: d and -d), returning theta of the first element after each merge.
struct Run {
  std::vector<float> theta{0.0f, 0.0f}, buf{0.0f, 0.0f}, state{0.0f, 0.0f};
  std::vector<float> trace;
  void step(OuterOptimizerKind kind, const OuterHyper& h, uint64_t version, float d, float scale = 1.0f) {
    outer_step(kind, h, version, theta, buf, state, std::vector<float>{d, -d}, scale);
    trace.push_back(theta[0]);
    CHECK(theta[1] == -theta[0]);
  }
};

OuterHyper dn_hyper(float c) {
  return OuterHyper{.lr = 1.0f, .momentum = 0.5f, .dn_period = 2, .dn_activation = c};
}

}  // namespace

TEST_CASE("delayed Nesterov folds its accumulator every N-th version (c = 0)", "[merger]") {
  // lr 1, beta 0.5, N 2; updates 1, 2, 4, 0.5 making versions 1..4:
  //   v1: acc 1, theta -= 1/2 = -0.5
  //   v2 (fold): acc 3, m = 3/2 = 1.5, theta -= 0.5*1.5 + 2/2 = 1.75 -> -2.25, acc 0
  //   v3: acc 4, theta -= 4/2 -> -4.25
  //   v4 (fold): acc 4.5, m = 0.5*1.5 + 2.25 = 3, theta -= 0.5*3 + 0.25 -> -6
  Run r;
  const std::vector<float> d{1.0f, 2.0f, 4.0f, 0.5f};
  r.step(OuterOptimizerKind::DelayedNesterov, dn_hyper(0), 1, d[0]);
  CHECK(r.state[0] == 1.0f);
  CHECK(r.buf[0] == 0.0f);
  r.step(OuterOptimizerKind::DelayedNesterov, dn_hyper(0), 2, d[1]);
  CHECK(r.state[0] == 0.0f);
  CHECK(r.buf[0] == 1.5f);
  r.step(OuterOptimizerKind::DelayedNesterov, dn_hyper(0), 3, d[2]);
  CHECK(r.state[0] == 4.0f);
  r.step(OuterOptimizerKind::DelayedNesterov, dn_hyper(0), 4, d[3]);
  CHECK(r.buf[0] == 3.0f);
  CHECK(r.state == std::vector<float>{0.0f, 0.0f});
  CHECK(r.trace == std::vector<float>{-0.5f, -2.25f, -4.25f, -6.0f});
}

TEST_CASE("delayed Nesterov with momentum activation applies c * beta * m in between", "[merger]") {
  // c 0.25: fold coefficient (1 - 0.5 + 0.25) * 0.5 = 0.375, in between 0.125.
  //   v1: theta -= 0.125*0 + 0.5 -> -0.5
  //   v2 (fold): m 1.5, theta -= 0.375*1.5 + 1 = 1.5625 -> -2.0625
  //   v3: theta -= 0.125*1.5 + 2 = 2.1875 -> -4.25
  //   v4 (fold): m 3, theta -= 0.375*3 + 0.25 = 1.375 -> -5.625
  Run r;
  const std::vector<float> d{1.0f, 2.0f, 4.0f, 0.5f};
  for (uint64_t v = 1; v <= 4; ++v) r.step(OuterOptimizerKind::DelayedNesterov, dn_hyper(0.25f), v, d[v - 1]);
  CHECK(r.trace == std::vector<float>{-0.5f, -2.0625f, -4.25f, -5.625f});
  CHECK(r.buf[0] == 3.0f);
}

TEST_CASE("delayed Nesterov decides the fold by the version, and with N 1 and c 0 is Nesterov-like", "[merger]") {
  // Starting at version 7 (odd) with N 2: the first merge does not fold, the second does.
  Run r;
  r.step(OuterOptimizerKind::DelayedNesterov, dn_hyper(0), 7, 1.0f);
  CHECK(r.buf[0] == 0.0f);
  r.step(OuterOptimizerKind::DelayedNesterov, dn_hyper(0), 8, 2.0f);
  CHECK(r.buf[0] == 1.5f);
  // N 1: m = beta*m + g; theta -= lr*(beta*m + g): Nesterov's update, bit for bit.
  OuterHyper h = dn_hyper(0);
  h.dn_period = 1;
  Run dn;
  std::vector<float> theta{0.0f, 0.0f}, buf{0.0f, 0.0f};
  for (uint64_t v = 1; v <= 3; ++v) {
    const float d = 0.3f * static_cast<float>(v);
    dn.step(OuterOptimizerKind::DelayedNesterov, h, v, d);
    outer_step(OuterOptimizerKind::Nesterov, h.lr, h.momentum, theta, buf, std::vector<float>{d, -d});
    CHECK(dn.theta == theta);
    CHECK(dn.buf == buf);
  }
}

TEST_CASE("CGAD's Adam step with bias correction by version", "[merger]") {
  // b1 0.5, b2 0.75, lr 0.25, updates 1 then 2:
  //   v1: m 0.5, v 0.25; m^ = 0.5/0.5 = 1, v^ = 0.25/0.25 = 1; theta -= 0.25 * 1/(1 + eps)
  //   v2: m 0.25 + 0.5*2 = 1.25, v 0.75*0.25 + 0.25*4 = 1.1875;
  //       m^ = 1.25/0.75, v^ = 1.1875/0.4375; theta -= 0.25 * m^/(sqrt(v^) + eps)
  OuterHyper h{.lr = 0.25f, .momentum = 0.5f, .adam_beta2 = 0.75f, .adam_epsilon = 1e-8f};
  Run r;
  r.step(OuterOptimizerKind::Cgad, h, 1, 1.0f);
  CHECK(r.buf[0] == 0.5f);
  CHECK(r.state[0] == 0.25f);
  CHECK(r.theta[0] == Approx(-0.25).epsilon(1e-6));
  r.step(OuterOptimizerKind::Cgad, h, 2, 2.0f);
  CHECK(r.buf[0] == 1.25f);
  CHECK(r.state[0] == 1.1875f);
  const double step2 = 0.25 * (1.25 / 0.75) / std::sqrt(1.1875 / 0.4375);
  CHECK(r.theta[0] == Approx(-0.25 - step2).epsilon(1e-6));
  // An outer gradient of 0 still moves along the first moment, as Adam does.
  const float before = r.theta[0];
  r.step(OuterOptimizerKind::Cgad, h, 3, 0.0f);
  CHECK(r.buf[0] == 0.625f);
  CHECK(r.theta[0] < before);
}

TEST_CASE("CGAD takes no step from a merge whose inputs all count for nothing (age factor 0)", "[merger]") {
  // Every input at or past cgad_cutoff: merge_step passes scale 0. The parameters do not move
  // on inputs that count for nothing, and both moments stay as they were (no decay either).
  OuterHyper h{.lr = 0.25f, .momentum = 0.5f, .adam_beta2 = 0.75f, .adam_epsilon = 1e-8f};
  Run r;
  r.step(OuterOptimizerKind::Cgad, h, 1, 1.0f);
  const auto theta = r.theta, buf = r.buf, state = r.state;
  r.step(OuterOptimizerKind::Cgad, h, 2, 3.0f, 0.0f);
  CHECK(r.theta == theta);
  CHECK(r.buf == buf);
  CHECK(r.state == state);
  // The next merge with a live input continues from there (bias correction by version 3).
  r.step(OuterOptimizerKind::Cgad, h, 3, 1.0f);
  CHECK(r.buf[0] == 0.5f * 0.5f + 0.5f * 1.0f);
  CHECK(r.theta[0] < theta[0]);
}

TEST_CASE("optimizers with a second buffer refuse to run without it", "[merger]") {
  std::vector<float> theta{1.0f}, buf{0.0f};
  const std::vector<float> d{0.5f};
  CHECK_THROWS_AS(outer_step(OuterOptimizerKind::DelayedNesterov, 0.7f, 0.9f, theta, buf, d), InternalError);
  std::vector<float> state{0.0f};
  CHECK_THROWS_AS(outer_step(OuterOptimizerKind::Nesterov, OuterHyper{}, 1, theta, buf, state, d), InternalError);
}

TEST_CASE("outer optimizer names", "[merger]") {
  for (auto kind : {OuterOptimizerKind::Nesterov, OuterOptimizerKind::Sgd, OuterOptimizerKind::DelayedNesterov,
                    OuterOptimizerKind::Cgad})
    CHECK(parse_outer_optimizer(outer_optimizer_name(kind)) == kind);
  CHECK(std::string(outer_optimizer_name(OuterOptimizerKind::DelayedNesterov)) == "dn");
  CHECK_FALSE(parse_outer_optimizer("adam"));
  CHECK(outer_optimizer_names() == "nesterov, sgd, dn, cgad");
  CHECK(has_outer_state(OuterOptimizerKind::DelayedNesterov));
  CHECK(has_outer_state(OuterOptimizerKind::Cgad));
  CHECK_FALSE(has_outer_state(OuterOptimizerKind::Nesterov));
  CHECK_FALSE(has_outer_state(OuterOptimizerKind::Sgd));
}

TEST_CASE("the momentum schedule: warm-up from 0, then a linear decay to the final momentum", "[merger]") {
  const MomentumSchedule none{.momentum = 0.9f};
  CHECK(scheduled_momentum(none, 1, 1) == 0.9f);
  CHECK(scheduled_momentum(none, 1000, 1000) == 0.9f);

  const MomentumSchedule s{.momentum = 0.8f, .warmup = 4, .decay_from = 10, .decay_to = 20, .final_momentum = 0.4f};
  // Warm-up: merges 1, 2, 3 of 4 take 1/4, 2/4, 3/4 of 0.8; the 4th and later all of it.
  CHECK(scheduled_momentum(s, 1, 1) == Approx(0.2));
  CHECK(scheduled_momentum(s, 2, 2) == Approx(0.4));
  CHECK(scheduled_momentum(s, 3, 3) == Approx(0.6));
  CHECK(scheduled_momentum(s, 4, 4) == Approx(0.8));
  CHECK(scheduled_momentum(s, 10, 10) == Approx(0.8));  // the decay starts after version 10
  // Decay by version: 15 is halfway from 10 to 20, 0.8 + (0.4 - 0.8) / 2 = 0.6; at 20 and after, 0.4.
  CHECK(scheduled_momentum(s, 15, 15) == Approx(0.6));
  CHECK(scheduled_momentum(s, 20, 20) == Approx(0.4));
  CHECK(scheduled_momentum(s, 500, 500) == Approx(0.4));
  // A run that switched optimizer at version 14 warms up again (merge 2 since), from the decayed
  // momentum of version 16: (0.8 - 0.4 * 6 / 10) * 2 / 4 = 0.28.
  CHECK(scheduled_momentum(s, 2, 16) == Approx(0.28));
}
