// Inner optimizer: the warmup + cosine schedule, clipping, and that it trains.
#include <ATen/CPUGeneratorImpl.h>
#include <catch2/catch.hpp>

#include <cmath>

#include "core/errors.h"
#include "core/model/transformer.h"
#include "core/train/inner_optimizer.h"

using namespace diloco;

TEST_CASE("lr_at: linear warmup, cosine decay, floor after the total", "[optimizer]") {
  InnerOptimizerOptions o;
  o.lr = 1.0;
  o.final_lr_ratio = 0.1;
  o.warmup_steps = 10;
  o.total_steps = 110;
  CHECK(lr_at(o, 0) == Approx(0.1));
  CHECK(lr_at(o, 4) == Approx(0.5));
  CHECK(lr_at(o, 9) == Approx(1.0));
  CHECK(lr_at(o, 10) == Approx(1.0));
  CHECK(lr_at(o, 60) == Approx(0.55));  // half way through the cosine: mean of 1.0 and 0.1
  CHECK(lr_at(o, 109) == Approx(0.1).margin(1e-3));
  CHECK(lr_at(o, 110) == Approx(0.1));
  CHECK(lr_at(o, 100000) == Approx(0.1));
  for (int64_t t = 10; t < 110; ++t) REQUIRE(lr_at(o, t + 1) <= lr_at(o, t));

  o.warmup_steps = 0;
  CHECK(lr_at(o, 0) == Approx(1.0));
}

TEST_CASE("the inner optimizer reduces the loss on a fixed batch", "[optimizer]") {
  const ModelOptions options{.vocab = 96, .layers = 1, .width = 32, .heads = 2, .context = 16};
  Transformer model(options, 1);
  InnerOptimizerOptions o;
  o.lr = 3e-3;
  o.warmup_steps = 2;
  o.total_steps = 30;
  InnerOptimizer optimizer(model.parameters(), o);
  auto gen = at::detail::createCPUGenerator(5);
  const auto tokens = torch::randint(options.vocab, {4, options.context + 1}, gen, torch::kInt64);
  const auto input = tokens.narrow(1, 0, options.context);
  const auto target = tokens.narrow(1, 1, options.context);

  double first = 0, last = 0;
  for (int64_t step = 0; step < 30; ++step) {
    optimizer.zero_grad();
    auto loss = model.loss(input, target);
    loss.backward();
    const double norm = optimizer.step(step);
    REQUIRE(std::isfinite(norm));
    (step == 0 ? first : last) = loss.item<double>();
  }
  CHECK(last < first - 0.5);
}

TEST_CASE("gradients are clipped to grad_clip", "[optimizer]") {
  auto p = torch::zeros({4}, torch::requires_grad());
  InnerOptimizerOptions o;
  o.grad_clip = 1.0;
  InnerOptimizer optimizer({p}, o);
  p.mutable_grad() = torch::full({4}, 10.0);
  CHECK(optimizer.step(0) == Approx(20.0));
  CHECK(p.grad().norm().item<double>() == Approx(1.0).epsilon(1e-4));
}

TEST_CASE("bad inner optimizer options are invalid input", "[optimizer]") {
  auto p = torch::zeros({4}, torch::requires_grad());
  InnerOptimizerOptions o;
  o.lr = 0;
  CHECK_THROWS_AS(InnerOptimizer({p}, o), InvalidInput);
  o.lr = 1e-3;
  o.warmup_steps = 10;
  o.total_steps = 5;
  CHECK_THROWS_AS(InnerOptimizer({p}, o), InvalidInput);
}
