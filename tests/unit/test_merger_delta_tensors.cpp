// Deltas held as they travelled (merger/delta_tensors.h): reading any range of a quantized
// tensor gives the values dequantize() gives for it, and a merge of int8/int4 inputs held that
// way has the bits of the same merge over their dequantized fp32 values, for every rule,
// optimizer, downlink, norm_block and thread count.
#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <vector>

#include "core/errors.h"
#include "core/parallel.h"
#include "merger/aggregate.h"
#include "merger/delta_tensors.h"
#include "merger/fragment_merger.h"
#include "merger/merge_step.h"
#include "tests/tensor_bits.h"

using namespace diloco;
using diloco::testing::random_tensors;
using diloco::testing::same_bits;

namespace {

std::vector<QuantizedTensor> quantized(const std::vector<DenseTensor>& dense, DType dtype, uint32_t block) {
  std::vector<QuantizedTensor> out;
  for (const auto& t : dense) out.push_back(quantize(t.index, t.shape, t.values, dtype, block));
  return out;
}

std::vector<DenseTensor> dequantized(const std::vector<QuantizedTensor>& q) {
  std::vector<DenseTensor> out;
  for (const auto& t : q) {
    DenseTensor d{t.index, t.shape, std::vector<float>(static_cast<size_t>(t.numel()))};
    dequantize(t, d.values);
    out.push_back(std::move(d));
  }
  return out;
}

}  // namespace

TEST_CASE("a quantized tensor read range by range gives dequantize's values", "[merger]") {
  std::mt19937 rng(5);
  const size_t n = 10'007;  // odd: an INT4 tensor ends in half a byte
  std::vector<float> values(n);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto& v : values) v = dist(rng);
  for (DType dtype : {DType::INT4, DType::INT8})
    for (uint32_t block : {1u, 7u, 128u, 1'000u}) {
      INFO(dtype_name(dtype) << " block " << block);
      const QuantizedTensor q = quantize(0, {static_cast<int64_t>(n)}, values, dtype, block);
      std::vector<float> want(n);
      dequantize(q, want);
      const TensorReader reader(q);
      REQUIRE(reader.size() == n);
      std::vector<float> scratch;
      std::uniform_int_distribution<size_t> at(0, n);
      for (int i = 0; i < 200; ++i) {
        size_t b = at(rng), e = at(rng);
        if (b > e) std::swap(b, e);
        const auto got = reader.read(b, e, scratch);
        REQUIRE(got.size() == e - b);
        CHECK(std::memcmp(got.data(), want.data() + b, got.size() * sizeof(float)) == 0);
      }
      const auto all = reader.read(0, n, scratch);
      CHECK(std::memcmp(all.data(), want.data(), n * sizeof(float)) == 0);
      CHECK_THROWS_AS(reader.read(0, n + 1, scratch), InternalError);
      CHECK(l2_norm(reader) == l2_norm(want));
      CHECK(l2_norm(reader, MergeWork{.norm_block = 1024}) == l2_norm(want, MergeWork{.norm_block = 1024}));
    }
  // fp32 values are read in place, no copy.
  std::vector<float> scratch;
  const TensorReader dense(values);
  CHECK(dense.read(3, 9, scratch).data() == values.data() + 3);
  CHECK(scratch.empty());
  // A quantized tensor whose payload does not hold its shape is refused, not read past its end.
  QuantizedTensor bad = quantize(0, {100}, std::span<const float>(values.data(), 100), DType::INT4, 16);
  bad.payload.pop_back();
  CHECK_THROWS_AS(TensorReader(bad), InvalidInput);
}

TEST_CASE("a merge of int8 and int4 inputs held as sent has the bits of one over their fp32 values", "[merger]") {
  // Tensors above and below a norm block (one of an odd size) and a block size that divides nothing.
  const std::vector<TensorSpec> layout{{"blocks.0.w", {3, 50'001}},
                                       {"token_embedding", {2, 40'000}},
                                       {"blocks.0.b", {999}}};
  std::mt19937 rng(61);
  FragmentState start;
  start.run_id = "run-1";
  start.version = 4;
  start.params = random_tensors(rng, 1.0f, layout);
  start.momentum = random_tensors(rng, 0.1f, layout);
  struct Form {
    DType dtype;
    uint32_t block;
  };
  const Form forms[] = {{DType::INT4, 128}, {DType::INT8, 1'000}, {DType::INT4, 7}};
  WorkPool two(2);
  const OuterOptimizerKind optimizers[] = {OuterOptimizerKind::Nesterov, OuterOptimizerKind::Sgd,
                                           OuterOptimizerKind::DelayedNesterov, OuterOptimizerKind::Cgad};
  const DownlinkCodec downlinks[] = {{.dtype = DType::F32, .block_size = 0}, {.dtype = DType::INT4, .block_size = 64}};
  for (const Form& form : forms) {
    std::vector<DeltaTensors> as_sent, decoded;
    for (int i = 0; i < 3; ++i) {
      auto q = quantized(random_tensors(rng, 0.05f, layout), form.dtype, form.block);
      decoded.emplace_back(dequantized(q));
      as_sent.emplace_back(std::move(q));
    }
    CHECK(as_sent[0].bytes() * 3 < decoded[0].bytes());  // what holding them as sent saves
    auto inputs_of = [&](const std::vector<DeltaTensors>& held) {
      std::vector<MergeInput> inputs;
      for (int i = 0; i < 3; ++i) {
        DeltaRef ref;
        ref.learner_id = "learner-" + std::to_string(i);
        ref.seq = 1;
        ref.base_version = 4;
        ref.weight = 1.0 + i;
        inputs.push_back({ref, held[static_cast<size_t>(i)]});
      }
      return inputs;
    };
    auto sent_inputs = inputs_of(as_sent), dense_inputs = inputs_of(decoded);
    for (MergeRule rule : {MergeRule::RadialDirectional, MergeRule::WeightedAverage})
      for (OuterOptimizerKind optimizer : optimizers)
        for (const DownlinkCodec& downlink : downlinks)
          for (uint32_t norm_block : {0u, kNormBlock})
            for (WorkPool* pool : {static_cast<WorkPool*>(nullptr), &two}) {
              INFO(dtype_name(form.dtype) << "/" << form.block << " rule " << static_cast<int>(rule) << " optimizer "
                                          << static_cast<int>(optimizer) << " downlink " << dtype_name(downlink.dtype)
                                          << " norm_block " << norm_block << (pool ? " 2 threads" : " 1 thread"));
              MergeOptions o{.rule = rule, .optimizer = optimizer, .tensors = layout, .downlink = downlink,
                             .norm_block = norm_block, .pool = pool};
              o.hyper.lr = 0.7f;
              o.hyper.momentum = 0.9f;
              FragmentState a = start, b = start;
              for (int merge = 0; merge < 2; ++merge) {  // the second one uses the residual and outer state
                for (auto& in : sent_inputs) in.ref.staleness = a.version - in.ref.base_version;
                for (auto& in : dense_inputs) in.ref.staleness = b.version - in.ref.base_version;
                const auto ra = merge_step_in_place(a, sent_inputs, o);
                const auto rb = merge_step_in_place(b, dense_inputs, o);
                CHECK(ra.checksum == rb.checksum);
              }
              CHECK(same_bits(a.params, b.params));
              CHECK(same_bits(a.momentum, b.momentum));
              CHECK(same_bits(a.outer_state, b.outer_state));
              CHECK(same_bits(a.downlink_residual, b.downlink_residual));
            }
  }
}

TEST_CASE("a held delta whose tensors do not fit the layout is refused by the merge", "[merger]") {
  const std::vector<TensorSpec> layout{{"blocks.0.w", {4, 8}}};
  std::mt19937 rng(3);
  FragmentState state;
  state.version = 1;
  state.params = random_tensors(rng, 1.0f, layout);
  state.momentum = random_tensors(rng, 0.1f, layout);
  auto q = quantized(random_tensors(rng, 0.1f, layout), DType::INT4, 8);
  q[0].scales.pop_back();  // a caller's bug: scales that do not cover the payload
  DeltaRef ref;
  ref.learner_id = "a";
  ref.seq = 1;
  ref.base_version = 1;
  ref.weight = 1;
  const DeltaTensors held(std::move(q));
  const std::vector<MergeInput> inputs{{ref, held}};
  const FragmentState before = state;
  CHECK_THROWS_AS(merge_step_in_place(state, inputs, MergeOptions{.tensors = layout}), InvalidInput);
  CHECK(same_bits(state.params, before.params));
}

TEST_CASE("the norm bound of a pending delta is the same whether it is held as sent or in fp32", "[merger]") {
  const std::vector<TensorSpec> layout{{"blocks.0.w", {64, 33}}, {"blocks.0.b", {33}}};
  OuterHyper hyper;
  hyper.quorum = 100;  // nothing merges: only the bound decides
  const InputBounds bounds{.max_norm_ratio = 3, .norm_window = 8, .norm_min = 4};
  FragmentMerger sent(0, 5, hyper, 0, {}, bounds), dense(0, 5, hyper, 0, {}, bounds);
  std::mt19937 rng(17);
  for (int i = 0; i < 12; ++i) {
    // Six ordinary deltas set the median; then 2x (accepted) and 5x longer ones (refused) in turn.
    const float scale = i < 6 ? 0.1f : (i % 2 ? 0.5f : 0.2f);
    auto q = quantized(random_tensors(rng, scale, layout), DType::INT4, 32);
    DeltaRef ref;
    ref.position = {"deltas", 0, i};
    ref.learner_id = "learner-" + std::to_string(i);
    ref.seq = 1;
    ref.base_version = 5;
    ref.inner_steps = 1;
    ref.tokens = 1;
    auto plain = dequantized(q);
    const auto a = sent.offer(ref, DeltaTensors(std::move(q)), i);
    const auto b = dense.offer(ref, DeltaTensors(std::move(plain)), i);
    INFO("delta " << i);
    REQUIRE(a.has_value() == b.has_value());
    if (a) CHECK(a->detail == b->detail);  // the same norm and median, to the last digit printed
  }
  CHECK(sent.pending_learners() == dense.pending_learners());
  CHECK(sent.pending_learners() == 9);
}
