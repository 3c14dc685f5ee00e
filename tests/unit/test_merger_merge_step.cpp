// merge_step, the one function behind live merging, recovery and replay: its result against an
// independent computation, bit-identical repeats, the MergeRecord it fills, and its refusals.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/errors.h"
#include "merger/merge_step.h"
#include "merger/outer_optimizer.h"
#include "merger/weighting.h"
#include "tests/tensor_bits.h"

using namespace diloco;
using diloco::testing::same_bits;

namespace {

// One RDA tensor and one (always averaged) embedding.
const std::vector<TensorSpec> kLayout{{"blocks.0.w", {2, 3}}, {"token_embedding", {2, 2}}};

std::vector<DenseTensor> random_tensors(std::mt19937& rng, float scale,
                                       const std::vector<TensorSpec>& layout = kLayout) {
  return testing::random_tensors(rng, scale, layout);
}

FragmentState genesis(std::mt19937& rng) {
  FragmentState state;
  state.run_id = "run-1";
  state.fingerprint = 0xABCD;
  state.fragment = 3;
  state.version = 5;
  state.params = random_tensors(rng, 1.0f);
  state.momentum = random_tensors(rng, 0.1f);
  state.consumed = {{"diloco.run-1.deltas.eu", 0, 17}};
  state.last_merge = LogPosition{"diloco.run-1.merges", 0, 4};
  state.accounted = {{"a", 3}};
  return state;
}

struct TestDelta {
  DeltaRef ref;
  std::vector<DenseTensor> tensors;
};

TestDelta make_delta(std::mt19937& rng, const std::string& learner, int64_t offset, uint64_t base,
                 uint64_t version, double weight) {
  TestDelta d;
  d.ref.position = {"diloco.run-1.deltas.eu", 0, offset};
  d.ref.learner_id = learner;
  d.ref.seq = 1;
  d.ref.base_version = base;
  d.ref.staleness = version - base;
  d.ref.inner_steps = 10;
  d.ref.tokens = 100;
  d.ref.weight = weight;
  d.tensors = random_tensors(rng, 0.05f);
  return d;
}

std::vector<MergeInput> inputs_of(const std::vector<TestDelta>& deltas) {
  std::vector<MergeInput> inputs;
  for (const auto& d : deltas) inputs.push_back({d.ref, d.tensors});
  return inputs;
}

MergeOptions options(MergeRule rule = MergeRule::RadialDirectional,
                     OuterOptimizerKind optimizer = OuterOptimizerKind::Nesterov) {
  MergeOptions o;
  o.rule = rule;
  o.optimizer = optimizer;
  o.hyper.lr = 0.7f;
  o.hyper.momentum = 0.9f;
  o.tensors = kLayout;
  return o;
}


// The merge written out from the formulas, in double, tensor by tensor.
void reference_merge(const FragmentState& current, const std::vector<TestDelta>& deltas,
                     const MergeOptions& o, std::vector<std::vector<double>>& params,
                     std::vector<std::vector<double>>& momentum) {
  double total = 0;
  for (const auto& d : deltas) total += d.ref.weight;
  for (size_t t = 0; t < kLayout.size(); ++t) {
    const size_t n = kLayout[t].numel();
    const bool rda = o.rule == MergeRule::RadialDirectional && kLayout[t].name != "token_embedding";
    std::vector<double> avg(n, 0.0), dir(n, 0.0);
    double mean_norm = 0;
    for (const auto& d : deltas) {
      const double w = d.ref.weight / total;
      double len = 0;
      for (float x : d.tensors[t].values) len += double(x) * x;
      len = std::sqrt(len);
      mean_norm += w * len;
      for (size_t k = 0; k < n; ++k) {
        avg[k] += w * d.tensors[t].values[k];
        dir[k] += w * d.tensors[t].values[k] / len;
      }
    }
    double dir_norm = 0;
    for (double x : dir) dir_norm += x * x;
    dir_norm = std::sqrt(dir_norm);
    std::vector<double> p(n), b(n);
    for (size_t k = 0; k < n; ++k) {
      const double u = rda ? mean_norm * dir[k] / dir_norm : avg[k];
      b[k] = o.hyper.momentum * current.momentum[t].values[k] + u;
      p[k] = current.params[t].values[k] - o.hyper.lr * (u + o.hyper.momentum * b[k]);
    }
    params.push_back(p);
    momentum.push_back(b);
  }
}

}  // namespace

TEST_CASE("merge_step matches an independent computation", "[merger]") {
  std::mt19937 rng(11);
  const FragmentState current = genesis(rng);
  for (auto rule : {MergeRule::RadialDirectional, MergeRule::WeightedAverage}) {
    const std::vector<TestDelta> deltas{make_delta(rng, "a", 3, 5, 5, 1000),
                                    make_delta(rng, "b", 8, 4, 5, 400),
                                    make_delta(rng, "c", 9, 2, 5, 2500)};
    const MergeOptions o = options(rule);
    FragmentState next;
    merge_step(current, inputs_of(deltas), o, next);

    std::vector<std::vector<double>> params, momentum;
    reference_merge(current, deltas, o, params, momentum);
    for (size_t t = 0; t < kLayout.size(); ++t)
      for (size_t k = 0; k < params[t].size(); ++k) {
        CHECK(next.params[t].values[k] == Approx(params[t][k]).epsilon(1e-5).margin(1e-7));
        CHECK(next.momentum[t].values[k] == Approx(momentum[t][k]).epsilon(1e-5).margin(1e-7));
      }
  }
}

TEST_CASE("a merge's share scales its outer gradient, momentum included", "[merger]") {
  std::mt19937 rng(12);
  const FragmentState current = genesis(rng);
  const std::vector<TestDelta> deltas{make_delta(rng, "a", 3, 5, 5, 1000), make_delta(rng, "b", 8, 4, 5, 400)};
  MergeOptions full = options();
  MergeOptions third = options();
  third.share = 1.0f / 3.0f;
  FragmentState next_full, next_third;
  merge_step(current, inputs_of(deltas), full, next_full);
  const MergeRecord record = merge_step(current, inputs_of(deltas), third, next_third);
  CHECK(record.share == third.share);
  // Nesterov is linear in the update: b' = mu b + s u, and theta' = theta - lr (s u + mu b').
  for (size_t t = 0; t < kLayout.size(); ++t)
    for (size_t k = 0; k < current.params[t].values.size(); ++k) {
      const double mu = full.hyper.momentum, lr = full.hyper.lr, b = current.momentum[t].values[k];
      const double u = next_full.momentum[t].values[k] - mu * b;  // the unscaled aggregate
      const double b3 = mu * b + u / 3.0;
      CHECK(next_third.momentum[t].values[k] == Approx(b3).epsilon(1e-5).margin(1e-7));
      CHECK(next_third.params[t].values[k] ==
            Approx(current.params[t].values[k] - lr * (u / 3.0 + mu * b3)).epsilon(1e-5).margin(1e-7));
    }
  for (float bad : {0.0f, -0.5f, 1.5f, std::numeric_limits<float>::quiet_NaN()}) {
    third.share = bad;
    CHECK_THROWS_AS(merge_step(current, inputs_of(deltas), third, next_third), InvalidInput);
  }
}

TEST_CASE("round_share is distinct learners merged over live ones, merged ones counted live", "[merger]") {
  auto inputs = [](std::vector<std::string> learners) {
    std::vector<MergeInput> out;
    for (auto& l : learners) out.push_back({DeltaRef{.learner_id = l}, {}});
    return out;
  };
  CHECK(round_share(inputs({"a"}), 3) == Approx(1.0 / 3.0));
  CHECK(round_share(inputs({"a", "b", "c"}), 3) == 1.0f);
  CHECK(round_share(inputs({"a", "a"}), 4) == Approx(0.25));  // one learner, counted once
  CHECK(round_share(inputs({"a", "b"}), 0) == 1.0f);  // no heartbeat seen yet: the merged are all
  CHECK(round_share(inputs({"a", "b", "c", "d"}), 2) == 1.0f);
  CHECK(round_share(inputs({}), 5) == 1.0f);
}

TEST_CASE("merge_step fills the next state and the merge record", "[merger]") {
  std::mt19937 rng(12);
  const FragmentState current = genesis(rng);
  const std::vector<TestDelta> deltas{make_delta(rng, "a", 3, 5, 5, 1000),
                                  make_delta(rng, "b", 8, 4, 5, 400)};
  MergeOptions o = options(MergeRule::WeightedAverage, OuterOptimizerKind::Sgd);
  o.hyper.staleness_alpha = 0.5f;
  o.hyper.max_staleness = 4;
  o.hyper.quorum = 2;
  FragmentState next;
  const MergeRecord record = merge_step(current, inputs_of(deltas), o, next);

  CHECK(next.run_id == "run-1");
  CHECK(next.fingerprint == 0xABCD);
  CHECK(next.fragment == 3);
  CHECK(next.version == 6);
  CHECK(next.consumed == current.consumed);
  CHECK(next.last_merge == current.last_merge);
  CHECK(next.accounted == current.accounted);
  CHECK(next.checksum == checksum_fp32(next.params));
  for (size_t t = 0; t < kLayout.size(); ++t) {
    CHECK(next.params[t].index == t);
    CHECK(next.params[t].shape == kLayout[t].shape);
    CHECK(next.momentum[t].index == t);
  }
  // Sgd leaves the momentum as it was.
  CHECK(same_bits(next.momentum, current.momentum));

  CHECK(record.run_id == "run-1");
  CHECK(record.fingerprint == 0xABCD);
  CHECK(record.fragment == 3);
  CHECK(record.version == 6);
  CHECK(record.prev_version == 5);
  CHECK(record.rule == MergeRule::WeightedAverage);
  CHECK(record.optimizer == OuterOptimizerKind::Sgd);
  CHECK(record.hyper.lr == 0.7f);
  CHECK(record.hyper.momentum == 0.9f);
  CHECK(record.hyper.staleness_alpha == 0.5f);
  CHECK(record.hyper.max_staleness == 4);
  CHECK(record.hyper.quorum == 2);
  CHECK(record.checksum == next.checksum);
  CHECK(record.dropped.empty());
  CHECK(record.merger_instance.empty());
  REQUIRE(record.inputs.size() == 2);
  CHECK(record.inputs[0].learner_id == "a");
  CHECK(record.inputs[0].weight == 1000.0);  // raw, not normalised
  CHECK(record.inputs[1].learner_id == "b");
  CHECK(record.inputs[1].weight == 400.0);
  CHECK(record.inputs[1].staleness == 1);
  CHECK(record.inputs[1].position == LogPosition{"diloco.run-1.deltas.eu", 0, 8});
}

TEST_CASE("merge_step is bit-for-bit deterministic", "[merger]") {
  std::mt19937 rng(13);
  const FragmentState current = genesis(rng);
  const std::vector<TestDelta> deltas{make_delta(rng, "a", 1, 5, 5, 1),
                                  make_delta(rng, "b", 2, 5, 5, 3),
                                  make_delta(rng, "c", 3, 1, 5, 7)};
  FragmentState first, second;
  const MergeRecord r1 = merge_step(current, inputs_of(deltas), options(), first);
  // `next` reused with stale contents of another shape must not matter.
  second.params = {{9, {1}, {42.0f}}};
  second.momentum = {{0, {7, 7}, std::vector<float>(49, -1.0f)}, {1, {1}, {1.0f}},
                     {2, {1}, {2.0f}}};
  second.version = 77;
  const MergeRecord r2 = merge_step(current, inputs_of(deltas), options(), second);
  CHECK(same_bits(first.params, second.params));
  CHECK(same_bits(first.momentum, second.momentum));
  CHECK(r1.checksum == r2.checksum);
  CHECK(second.version == 6);

  // A chain of merges alternating two states equals the same chain run again.
  FragmentState a = current, b;
  FragmentState c = current, d;
  for (int step = 0; step < 4; ++step) {
    std::vector<TestDelta> round{make_delta(rng, "a", 10 + step, a.version, a.version, 2),
                             make_delta(rng, "b", 20 + step, a.version, a.version, 5)};
    const auto ra = merge_step(a, inputs_of(round), options(), b);
    const auto rc = merge_step(c, inputs_of(round), options(), d);
    CHECK(ra.checksum == rc.checksum);
    std::swap(a, b);
    std::swap(c, d);
  }
  CHECK(same_bits(a.params, c.params));
  CHECK(same_bits(a.momentum, c.momentum));
  CHECK(a.version == 9);
}

TEST_CASE("the record keeps the input order, which replay must reuse", "[merger]") {
  // Another order is the same merge up to fp32 rounding, not necessarily bit for bit.
  std::mt19937 rng(14);
  const FragmentState current = genesis(rng);
  const std::vector<TestDelta> deltas{make_delta(rng, "a", 1, 5, 5, 1),
                                  make_delta(rng, "b", 2, 5, 5, 3)};
  FragmentState next;
  const MergeRecord record = merge_step(current, inputs_of(deltas), options(), next);
  CHECK(record.inputs[0].learner_id == "a");
  CHECK(record.inputs[1].learner_id == "b");
  const std::vector<TestDelta> reversed{deltas[1], deltas[0]};
  FragmentState other;
  merge_step(current, inputs_of(reversed), options(), other);
  for (size_t t = 0; t < kLayout.size(); ++t)
    for (size_t k = 0; k < other.params[t].values.size(); ++k)
      CHECK(other.params[t].values[k] == Approx(next.params[t].values[k]).epsilon(1e-6));
}

TEST_CASE("merge_step refuses inputs that do not fit, leaving both states untouched",
          "[merger]") {
  std::mt19937 rng(15);
  const FragmentState current = genesis(rng);
  FragmentState next;
  next.version = 99;
  next.params = {{0, {1}, {1.0f}}};
  const FragmentState next_before = next;
  auto refuses = [&](std::vector<TestDelta> deltas, MergeOptions o, FragmentState state) {
    CHECK_THROWS_AS(merge_step(state, inputs_of(deltas), o, next), InvalidInput);
    CHECK(next.version == next_before.version);
    CHECK(same_bits(next.params, next_before.params));
  };
  const TestDelta good = make_delta(rng, "a", 1, 5, 5, 10);

  refuses({}, options(), current);
  TestDelta zero = good;
  zero.ref.weight = 0;
  refuses({zero, zero}, options(), current);
  TestDelta negative = good;
  negative.ref.weight = -1;
  refuses({good, negative}, options(), current);
  TestDelta future = good;
  future.ref.base_version = 6;
  refuses({future}, options(), current);
  TestDelta wrong_staleness = good;
  wrong_staleness.ref.staleness = 1;
  refuses({wrong_staleness}, options(), current);
  TestDelta missing_tensor = good;
  missing_tensor.tensors.pop_back();
  refuses({good, missing_tensor}, options(), current);
  TestDelta short_tensor = good;
  short_tensor.tensors[0].values.pop_back();
  refuses({short_tensor}, options(), current);
  TestDelta reshaped = good;
  reshaped.tensors[0].shape = {3, 2};
  refuses({reshaped}, options(), current);

  FragmentState no_momentum = current;
  no_momentum.momentum.clear();
  refuses({good}, options(), no_momentum);
  FragmentState short_params = current;
  short_params.params[1].values.resize(3);
  refuses({good}, options(), short_params);

  for (auto change : std::vector<void (*)(OuterHyper&)>{
           [](OuterHyper& h) { h.lr = 0; }, [](OuterHyper& h) { h.lr = NAN; },
           [](OuterHyper& h) { h.momentum = 1; }, [](OuterHyper& h) { h.momentum = -0.1f; },
           [](OuterHyper& h) { h.staleness_alpha = -1; }, [](OuterHyper& h) { h.quorum = 0; }}) {
    MergeOptions o = options();
    change(o.hyper);
    refuses({good}, o, current);
  }
}

TEST_CASE("merge_step cannot write the state it reads", "[merger]") {
  std::mt19937 rng(16);
  FragmentState state = genesis(rng);
  const std::vector<TestDelta> deltas{make_delta(rng, "a", 1, 5, 5, 1)};
  CHECK_THROWS_AS(merge_step(state, inputs_of(deltas), options(), state), InternalError);
}

TEST_CASE("a genesis state with zero momentum merges", "[merger]") {
  std::mt19937 rng(17);
  FragmentState state = genesis(rng);
  state.version = 0;
  state.momentum = initial_momentum(state.params);
  const std::vector<TestDelta> deltas{make_delta(rng, "a", 1, 0, 0, 1)};
  FragmentState next;
  merge_step(state, inputs_of(deltas), options(MergeRule::RadialDirectional), next);
  CHECK(next.version == 1);
  // One delta, from zero momentum: theta - lr * (1 + mu) * d, buf = d.
  for (size_t t = 0; t < kLayout.size(); ++t)
    for (size_t k = 0; k < state.params[t].values.size(); ++k) {
      const float d = deltas[0].tensors[t].values[k];
      CHECK(next.momentum[t].values[k] == d);
      CHECK(next.params[t].values[k] ==
            Approx(state.params[t].values[k] - 0.7 * 1.9 * d).epsilon(1e-6).margin(1e-7));
    }
}

namespace {

// A one-input Sgd merge (lr 1, weighted average) of a delta of staleness 3 onto version 5.
struct StaleMerge {
  FragmentState current, next;
  TestDelta delta;
  MergeRecord record;
  StaleMerge(float alpha, bool share_scaling, size_t live) {
    std::mt19937 rng(31);
    current = genesis(rng);
    delta = make_delta(rng, "a", 1, 2, 5, 1000);
    MergeOptions o = options(MergeRule::WeightedAverage, OuterOptimizerKind::Sgd);
    o.hyper.lr = 1.0f;
    o.hyper.staleness_alpha = alpha;
    const std::vector<MergeInput> inputs{{delta.ref, delta.tensors}};
    set_merge_share(o, inputs, live, share_scaling);
    record = merge_step(current, inputs, o, next);
  }
  double applied(size_t t, size_t k) const { return current.params[t].values[k] - next.params[t].values[k]; }
};

}  // namespace

TEST_CASE("the staleness scale shrinks a single-input merge's update by g(s)", "[merger]") {
  const StaleMerge plain(0.0f, false, 1), discounted(0.5f, false, 1);
  // Alpha 0 applies the whole update; alpha 0.5 at staleness 3 applies g(3) = 4^-0.5 = 0.5 of it.
  CHECK(plain.record.share == 1.0f);
  CHECK(plain.record.staleness_scale == 1.0f);
  CHECK(discounted.record.share == 0.5f);
  CHECK(discounted.record.staleness_scale == 0.5f);
  CHECK_FALSE(same_bits(plain.next.params, discounted.next.params));
  for (size_t t = 0; t < kLayout.size(); ++t)
    for (size_t k = 0; k < plain.current.params[t].values.size(); ++k) {
      if (plain.applied(t, k) == 0) continue;
      CHECK(discounted.applied(t, k) / plain.applied(t, k) == Approx(staleness_factor(3, 0.5f)).epsilon(1e-5));
    }
  // With share scaling the round's share multiplies in: 1 learner of 2 live, times 0.5.
  const StaleMerge both(0.5f, true, 2);
  CHECK(both.record.share == 0.25f);
  CHECK(both.record.staleness_scale == 0.5f);
}

TEST_CASE("scaled_share keeps the round share exact at scale 1 and never returns 0", "[merger]") {
  CHECK(scaled_share(1.0f / 3, 1.0) == 1.0f / 3);
  CHECK(scaled_share(0.5f, 0.5) == 0.25f);
  CHECK(scaled_share(1.0f, 0.0) > 0.0f);
}

TEST_CASE("merge_step keeps the outer_state only for the optimizers that use it", "[merger]") {
  std::mt19937 rng(32);
  const FragmentState current = genesis(rng);  // no outer_state, as an older checkpoint
  std::vector<TestDelta> deltas{make_delta(rng, "a", 1, 5, 5, 1), make_delta(rng, "b", 2, 4, 5, 2)};
  // The same deltas merged onto `state`: their staleness follows its version.
  auto onto = [&](const FragmentState& state) {
    for (auto& d : deltas) d.ref.staleness = state.version - d.ref.base_version;
    return inputs_of(deltas);
  };
  FragmentState dn, back;
  MergeOptions o = options(MergeRule::RadialDirectional, OuterOptimizerKind::DelayedNesterov);
  o.hyper.dn_period = 3;
  merge_step(current, onto(current), o, dn);
  // Version 6 is a fold for N 3: the accumulator was added to the momentum and reset to zeros.
  REQUIRE(dn.outer_state.size() == kLayout.size());
  CHECK(same_bits(dn.outer_state, initial_momentum(current.params)));
  CHECK_FALSE(same_bits(dn.momentum, current.momentum));
  FragmentState between;
  merge_step(dn, onto(dn), o, between);  // version 7: accumulates
  CHECK_FALSE(same_bits(between.outer_state, dn.outer_state));
  CHECK(same_bits(between.momentum, dn.momentum));
  // Switching to Nesterov drops it; a wrongly shaped one is refused.
  merge_step(between, onto(between), options(), back);
  CHECK(back.outer_state.empty());
  FragmentState bad = between;
  bad.outer_state.pop_back();
  CHECK_THROWS_AS(merge_step(bad, onto(bad), o, back), InvalidInput);
}

TEST_CASE("CGAD scales a merge by its inputs' age factor before the Adam step", "[merger]") {
  std::mt19937 rng(33);
  FragmentState current = genesis(rng);
  current.momentum = initial_momentum(current.params);
  MergeOptions o = options(MergeRule::WeightedAverage, OuterOptimizerKind::Cgad);
  o.hyper.lr = 0.01f;
  o.hyper.cgad_cutoff = 4;
  // Past the cutoff age the update is 0: from zero moments nothing moves.
  const std::vector<TestDelta> old{make_delta(rng, "a", 1, 1, 5, 1)};
  FragmentState next;
  merge_step(current, inputs_of(old), o, next);
  CHECK(same_bits(next.params, current.params));
  CHECK(next.outer_state.size() == kLayout.size());
  // A fresh input: first moment (1 - b1) * d, second (1 - b2) * d^2.
  const std::vector<TestDelta> fresh{make_delta(rng, "a", 2, 5, 5, 1)};
  merge_step(current, inputs_of(fresh), o, next);
  for (size_t k = 0; k < next.params[1].values.size(); ++k) {
    const double d = fresh[0].tensors[1].values[k];
    CHECK(next.momentum[1].values[k] == Approx((1 - 0.9) * d).epsilon(1e-5));
    CHECK(next.outer_state[1].values[k] == Approx((1 - 0.99) * d * d).epsilon(1e-4));
  }
  // Staleness 2 of 4: exp(-0.2) * (1 + cos(pi / 2)) / 2 = exp(-0.2) / 2 of the update.
  const std::vector<TestDelta> aged{make_delta(rng, "a", 3, 3, 5, 1)};
  merge_step(current, inputs_of(aged), o, next);
  const double factor = std::exp(-0.1 * 2) * 0.5;
  for (size_t k = 0; k < next.momentum[1].values.size(); ++k)
    CHECK(next.momentum[1].values[k] == Approx((1 - 0.9) * factor * aged[0].tensors[1].values[k]).epsilon(1e-5));
}

TEST_CASE("merge_step refuses invalid delayed Nesterov and CGAD settings", "[merger]") {
  std::mt19937 rng(34);
  const FragmentState current = genesis(rng);
  const std::vector<TestDelta> deltas{make_delta(rng, "a", 1, 5, 5, 1)};
  for (auto bad : {+[](OuterHyper& h) { h.dn_period = 0; }, +[](OuterHyper& h) { h.dn_activation = 1.5f; },
                   +[](OuterHyper& h) { h.cgad_decay = -1; }, +[](OuterHyper& h) { h.cgad_cutoff = 0; },
                   +[](OuterHyper& h) { h.adam_beta2 = 1; }, +[](OuterHyper& h) { h.adam_epsilon = 0; }}) {
    MergeOptions o = options();
    bad(o.hyper);
    FragmentState next;
    CHECK_THROWS_AS(merge_step(current, inputs_of(deltas), o, next), InvalidInput);
  }
}

TEST_CASE("with a quantized downlink the new version is the previous one plus what is sent", "[merger]") {
  std::mt19937 rng(31);
  FragmentState current = genesis(rng);
  const std::vector<TestDelta> deltas{make_delta(rng, "a", 3, 5, 5, 1), make_delta(rng, "b", 8, 5, 5, 1)};
  const MergeOptions fp32 = options();
  FragmentState exact;
  merge_step(current, inputs_of(deltas), fp32, exact);

  MergeOptions o = options();
  std::vector<QuantizedTensor> change;
  o.downlink = {.dtype = DType::INT4, .block_size = 4, .topk = GENERATE(0u, 1u)};  // also top-k: one value of 4
  o.change = &change;
  FragmentState next;
  const MergeRecord record = merge_step(current, inputs_of(deltas), o, next);
  CHECK(record.downlink == o.downlink);
  CHECK(record.checksum == checksum_fp32(next.params));
  CHECK(same_bits(next.momentum, exact.momentum));  // the optimizer's state is the exact step's
  REQUIRE(change.size() == kLayout.size());
  REQUIRE(next.downlink_residual.size() == kLayout.size());
  bool lossy = false;
  for (size_t t = 0; t < kLayout.size(); ++t) {
    CHECK(change[t].dtype == DType::INT4);
    CHECK(change[t].index == t);
    std::vector<float> sent(next.params[t].values.size()), rebuilt(sent.size());
    dequantize(change[t], sent);
    // What a subscriber holding the previous version computes: the same bits.
    apply_update(current.params[t].values, sent, rebuilt);
    CHECK(std::memcmp(rebuilt.data(), next.params[t].values.data(), 4 * rebuilt.size()) == 0);
    // Nothing is lost: the residual holds what the exact step has and the sent version has not.
    for (size_t k = 0; k < sent.size(); ++k) {
      const float want = exact.params[t].values[k] - current.params[t].values[k];
      CHECK(sent[k] + next.downlink_residual[t].values[k] == Approx(want).margin(1e-6));
      lossy |= next.downlink_residual[t].values[k] != 0.0f;
    }
  }
  CHECK(lossy);  // int4 at these sizes does not send the step exactly

  // The residual goes into the next merge's change (and a replay from the record rebuilds it).
  FragmentState after, again;
  const std::vector<TestDelta> more{make_delta(rng, "a", 9, 6, 6, 1)};
  const MergeRecord second = merge_step(next, inputs_of(more), o, after);
  merge_step(next, inputs_of(more), recorded_merge_options(second, kLayout), again);
  CHECK(same_bits(after.params, again.params));
  CHECK(same_bits(after.downlink_residual, again.downlink_residual));

  // An fp32 downlink keeps no residual and sends no change.
  FragmentState plain;
  MergeOptions f = options();
  f.change = &change;
  merge_step(next, inputs_of(more), f, plain);
  CHECK(plain.downlink_residual.empty());
  CHECK(change.empty());
}

TEST_CASE("merge_step_in_place gives merge_step's bits for every rule, optimizer and downlink", "[merger]") {
  const MergeRule rules[] = {MergeRule::RadialDirectional, MergeRule::WeightedAverage};
  const OuterOptimizerKind optimizers[] = {OuterOptimizerKind::Nesterov, OuterOptimizerKind::Sgd,
                                           OuterOptimizerKind::DelayedNesterov, OuterOptimizerKind::Cgad};
  const DownlinkCodec downlinks[] = {{.dtype = DType::F32, .block_size = 0}, {.dtype = DType::INT4, .block_size = 4},
                                     {.dtype = DType::INT8, .block_size = 3},
                                     {.dtype = DType::INT4, .block_size = 4, .topk = 1}};
  for (MergeRule rule : rules)
    for (OuterOptimizerKind optimizer : optimizers)
      for (const DownlinkCodec& downlink : downlinks) {
        INFO("rule " << static_cast<int>(rule) << " optimizer " << static_cast<int>(optimizer) << " downlink "
                     << dtype_name(downlink.dtype) << " topk " << downlink.topk);
        std::mt19937 rng(41);
        FragmentState copied = genesis(rng), in_place = copied, spare;
        MergeOptions o = options(rule, optimizer);
        o.downlink = downlink;
        std::vector<QuantizedTensor> change_copied, change_in_place;
        for (int step = 0; step < 3; ++step) {
          const uint64_t v = copied.version;
          const std::vector<TestDelta> round{make_delta(rng, "a", 10 + step, v, v, 2),
                                             make_delta(rng, "b", 20 + step, v - 1, v, 5)};
          o.change = &change_copied;
          const MergeRecord r1 = merge_step(copied, inputs_of(round), o, spare);
          std::swap(copied, spare);
          o.change = &change_in_place;
          const MergeRecord r2 = merge_step_in_place(in_place, inputs_of(round), o);
          CHECK(r1.checksum == r2.checksum);
          CHECK(r1.version == r2.version);
          CHECK(r1.prev_version == r2.prev_version);
          CHECK(in_place.version == copied.version);
          CHECK(change_copied.size() == change_in_place.size());
          for (size_t t = 0; t < std::min(change_copied.size(), change_in_place.size()); ++t)
            CHECK(change_copied[t].payload == change_in_place[t].payload);
        }
        CHECK(same_bits(in_place.params, copied.params));
        CHECK(same_bits(in_place.momentum, copied.momentum));
        CHECK(same_bits(in_place.outer_state, copied.outer_state));
        CHECK(same_bits(in_place.downlink_residual, copied.downlink_residual));
        CHECK(in_place.checksum == copied.checksum);
      }
}

TEST_CASE("merge_step_in_place refuses inputs that do not fit before it writes anything", "[merger]") {
  std::mt19937 rng(43);
  FragmentState state = genesis(rng);
  const FragmentState before = state;
  MergeOptions o = options();
  o.downlink = {.dtype = DType::INT4, .block_size = 4};
  // A staleness that does not fit the version, then a tensor of the wrong shape.
  std::vector<TestDelta> bad{make_delta(rng, "a", 1, 5, 5, 1), make_delta(rng, "b", 2, 4, 5, 1)};
  bad[1].ref.staleness = 3;
  CHECK_THROWS_AS(merge_step_in_place(state, inputs_of(bad), o), InvalidInput);
  bad[1].ref.staleness = 1;
  bad[1].tensors[0].values.pop_back();
  CHECK_THROWS_AS(merge_step_in_place(state, inputs_of(bad), o), InvalidInput);
  CHECK(state.version == before.version);
  CHECK(same_bits(state.params, before.params));
  CHECK(same_bits(state.momentum, before.momentum));
  CHECK(state.downlink_residual.empty());
}

TEST_CASE("a merge has the same bits on 1 thread as on N, and with its RDA aggregates held whole or streamed, for every rule, optimizer and downlink", "[merger]") {
  // Tensors of several norm blocks (one of an odd size), and one smaller than a block.
  const std::vector<TensorSpec> layout{{"blocks.0.w", {3, 100'001}},
                                       {"token_embedding", {2, 70'000}},
                                       {"blocks.0.b", {1'000}}};
  auto tensors = [&](std::mt19937& rng, float scale) { return random_tensors(rng, scale, layout); };
  std::mt19937 rng(47);
  FragmentState start;
  start.run_id = "run-1";
  start.fragment = 0;
  start.version = 6;
  start.params = tensors(rng, 1.0f);
  start.momentum = tensors(rng, 0.1f);
  std::vector<std::vector<DenseTensor>> deltas;
  for (int i = 0; i < 3; ++i) deltas.push_back(tensors(rng, 0.05f));
  std::vector<MergeInput> inputs;
  for (int i = 0; i < 3; ++i) {
    DeltaRef ref;
    ref.learner_id = "learner-" + std::to_string(i);
    ref.seq = 1;
    ref.base_version = 6;
    ref.weight = 1.0 + i;
    inputs.push_back({ref, deltas[i]});
  }
  WorkPool two(2), five(5);
  const OuterOptimizerKind optimizers[] = {OuterOptimizerKind::Nesterov, OuterOptimizerKind::Sgd,
                                           OuterOptimizerKind::DelayedNesterov, OuterOptimizerKind::Cgad};
  const DownlinkCodec downlinks[] = {{.dtype = DType::F32, .block_size = 0},
                                     {.dtype = DType::INT4, .block_size = 64},
                                     {.dtype = DType::INT8, .block_size = 1'000},  // not a divisor of 2^16
                                     {.dtype = DType::BF16, .block_size = 0},
                                     {.dtype = DType::INT4, .block_size = 1'024, .topk = 100}};
  for (MergeRule rule : {MergeRule::RadialDirectional, MergeRule::WeightedAverage})
    for (OuterOptimizerKind optimizer : optimizers)
      for (const DownlinkCodec& downlink : downlinks) {
        INFO("rule " << static_cast<int>(rule) << " optimizer " << static_cast<int>(optimizer) << " downlink "
                     << dtype_name(downlink.dtype) << " topk " << downlink.topk);
        MergeOptions o = options(rule, optimizer);
        o.tensors = layout;
        o.downlink = downlink;
        std::vector<FragmentState> states(4, start);
        std::vector<std::vector<QuantizedTensor>> changes(4);
        WorkPool* pools[] = {nullptr, &two, &five, &two};
        std::vector<MergeRecord> records;
        for (size_t k = 0; k < 4; ++k) {
          o.pool = pools[k];
          // The last one aggregates every tensor a range at a time (the others hold them whole).
          o.kept_aggregate_values = k == 3 ? 0 : kKeptAggregateValues;
          o.change = &changes[k];
          for (int merge = 0; merge < 2; ++merge) {  // the second one uses the residual and outer state
            for (auto& in : inputs) in.ref.staleness = states[k].version - in.ref.base_version;
            records.push_back(merge_step_in_place(states[k], inputs, o));
          }
        }
        for (size_t k = 1; k < 4; ++k) {
          INFO("configuration " << k);
          CHECK(records[2 * k + 1].checksum == records[1].checksum);
          CHECK(records[2 * k + 1].norm_block == kNormBlock);
          CHECK(same_bits(states[k].params, states[0].params));
          CHECK(same_bits(states[k].momentum, states[0].momentum));
          CHECK(same_bits(states[k].outer_state, states[0].outer_state));
          CHECK(same_bits(states[k].downlink_residual, states[0].downlink_residual));
          REQUIRE(changes[k].size() == changes[0].size());
          for (size_t t = 0; t < changes[0].size(); ++t) {
            CHECK(changes[k][t].payload == changes[0][t].payload);
            CHECK(changes[k][t].scales == changes[0][t].scales);
          }
        }
      }
}

TEST_CASE("norm_block decides how norms are summed: 0 sums each tensor at once, as records before it", "[merger]") {
  std::mt19937 rng(53);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(300'007);
  for (auto& v : x) v = dist(rng) * (1.0f + static_cast<float>(&v - x.data()) * 1e-3f);
  WorkPool pool(3);
  CHECK(l2_norm(x, MergeWork{.pool = &pool, .norm_block = 0}) == l2_norm(x));
  const double blocked = l2_norm(x, MergeWork{.pool = nullptr, .norm_block = kNormBlock});
  CHECK(l2_norm(x, MergeWork{.pool = &pool, .norm_block = kNormBlock}) == blocked);
  CHECK(blocked == Approx(l2_norm(x)).epsilon(1e-12));
  // A tensor within one block is summed the old way under either setting.
  const std::span<const float> small(x.data(), kNormBlock);
  CHECK(l2_norm(small, MergeWork{.pool = &pool, .norm_block = kNormBlock}) == l2_norm(small));
  // A replayed record with norm_block 0 is rebuilt with it; a merge with a bad block is refused.
  MergeRecord record;
  record.norm_block = 0;
  CHECK(recorded_merge_options(record, {}).norm_block == 0);
  record.norm_block = kMinNormBlock;
  CHECK(recorded_merge_options(record, {}).norm_block == kMinNormBlock);
  FragmentState state = genesis(rng);
  const std::vector<TestDelta> round{make_delta(rng, "a", 1, state.version, state.version, 1)};
  MergeOptions o = options();
  o.norm_block = 3;
  CHECK_THROWS_AS(merge_step_in_place(state, inputs_of(round), o), InvalidInput);
}

TEST_CASE("a run switched to another outer optimizer starts its buffers from zero and counts its steps from the switch",
          "[merger]") {
  std::mt19937 rng(34);
  MergeOptions o = options(MergeRule::WeightedAverage, OuterOptimizerKind::Cgad);
  o.hyper.lr = 0.01f;
  const std::vector<TestDelta> fresh{make_delta(rng, "a", 2, 5, 5, 1)};  // staleness 0: age factor 1
  // From Nesterov (its momentum is no first moment), and from Delayed Nesterov (its accumulated
  // gradients, here negative, are no second moment): the first CGAD merge is Adam's first step,
  // t = 1, whatever the version: m = (1 - b1) g, v = (1 - b2) g^2, so
  // theta -= lr * g / (|g| + eps).
  for (const auto before : {OuterOptimizerKind::Nesterov, OuterOptimizerKind::DelayedNesterov}) {
    INFO("from " << outer_optimizer_name(before));
    FragmentState current = genesis(rng);  // version 5, momentum nonzero
    current.optimizer = before;
    if (before == OuterOptimizerKind::DelayedNesterov) {
      current.outer_state = initial_momentum(current.params);
      for (auto& t : current.outer_state) std::fill(t.values.begin(), t.values.end(), -1.0f);
    }
    FragmentState next;
    merge_step(current, inputs_of(fresh), o, next);
    REQUIRE(next.optimizer == OuterOptimizerKind::Cgad);
    CHECK(next.optimizer_since == 5);
    for (size_t t = 0; t < kLayout.size(); ++t)
      for (size_t k = 0; k < next.params[t].values.size(); ++k) {
        const double g = fresh[0].tensors[t].values[k];
        CHECK(next.momentum[t].values[k] == Approx((1 - 0.9) * g).epsilon(1e-5));
        CHECK(next.outer_state[t].values[k] == Approx((1 - 0.99) * g * g).epsilon(1e-4));
        CHECK(next.params[t].values[k] ==
              Approx(current.params[t].values[k] - 0.01 * g / (std::abs(g) + 1e-8)).epsilon(1e-5));
      }
    // The next CGAD merge is its second step (t = 2), counted from the switch, not version 7.
    FragmentState after;
    const std::vector<TestDelta> again{make_delta(rng, "a", 3, 6, 6, 1)};
    merge_step(next, inputs_of(again), o, after);
    CHECK(after.optimizer_since == 5);
    for (size_t k = 0; k < after.params[1].values.size(); ++k) {
      const double g2 = again[0].tensors[1].values[k];
      const double m = 0.9 * next.momentum[1].values[k] + 0.1 * g2;
      const double v = 0.99 * next.outer_state[1].values[k] + 0.01 * g2 * g2;
      const double step = 0.01 * (m / (1 - 0.9 * 0.9)) / (std::sqrt(v / (1 - 0.99 * 0.99)) + 1e-8);
      CHECK(after.params[1].values[k] == Approx(next.params[1].values[k] - step).epsilon(1e-4));
    }
  }
  // The same optimizer again, or a checkpoint that names none (older binaries): buffers kept.
  FragmentState kept = genesis(rng);
  FragmentState next;
  merge_step(kept, inputs_of(fresh), options(), next);
  CHECK(next.optimizer == OuterOptimizerKind::Nesterov);
  CHECK(next.optimizer_since == 0);
  FragmentState again;
  merge_step(next, inputs_of({make_delta(rng, "a", 4, 6, 6, 1)}), options(), again);
  CHECK(again.optimizer_since == 0);
  CHECK_FALSE(same_bits(again.momentum, initial_momentum(again.params)));
}

TEST_CASE("a fragment's next merge is counted from where its optimizer began", "[merge]") {
  FragmentState s;
  s.version = 6;
  // A checkpoint of older binaries names no optimizer: no switch, counted from genesis.
  CHECK_FALSE(switches_optimizer(s, OuterOptimizerKind::Cgad));
  CHECK(next_merge_count(s, OuterOptimizerKind::Cgad) == 7);
  // Nesterov since version 2: its next merge (version 7) is its 5th; CGAD's would be its 1st.
  s.optimizer = OuterOptimizerKind::Nesterov;
  s.optimizer_since = 2;
  CHECK_FALSE(switches_optimizer(s, OuterOptimizerKind::Nesterov));
  CHECK(next_merge_count(s, OuterOptimizerKind::Nesterov) == 5);
  CHECK(switches_optimizer(s, OuterOptimizerKind::Cgad));
  CHECK(next_merge_count(s, OuterOptimizerKind::Cgad) == 1);
}
