// The transformer: deterministic initialisation, parameter listing, fragment copy-out and
// write-back, a sane untrained loss, causality.
#include <ATen/CPUGeneratorImpl.h>
#include <catch2/catch.hpp>

#include <cmath>
#include <set>

#include "core/errors.h"
#include "core/fragments/partition.h"
#include "core/model/transformer.h"
#include "core/train/model_setup.h"

using namespace diloco;

namespace {

const ModelOptions kSmall{.vocab = 96, .layers = 2, .width = 32, .heads = 4, .context = 16};

bool same_parameters(const Transformer& a, const Transformer& b) {
  if (a.parameters().size() != b.parameters().size()) return false;
  for (size_t i = 0; i < a.parameters().size(); ++i)
    if (!torch::equal(a.parameters()[i], b.parameters()[i])) return false;
  return true;
}

}  // namespace

TEST_CASE("the same seed gives identical parameters, another seed different ones", "[model]") {
  const Transformer a(kSmall, 7), b(kSmall, 7), c(kSmall, 8);
  CHECK(same_parameters(a, b));
  CHECK_FALSE(same_parameters(a, c));
  // Each randomly initialised tensor differs, not just one of them.
  CHECK_FALSE(torch::equal(a.parameter("head.weight"), c.parameter("head.weight")));
  CHECK_FALSE(torch::equal(a.parameter("token_embedding"), c.parameter("token_embedding")));
}

TEST_CASE("initialisation does not depend on the global torch RNG", "[model]") {
  torch::manual_seed(1);
  const Transformer a(kSmall, 3);
  torch::manual_seed(2);
  const Transformer b(kSmall, 3);
  CHECK(same_parameters(a, b));
}

TEST_CASE("parameters are listed in a fixed order with unique names", "[model]") {
  const Transformer m(kSmall, 1);
  const auto& names = m.parameter_names();
  REQUIRE(names.size() == 5 + 12 * static_cast<size_t>(kSmall.layers));
  CHECK(names.front() == "token_embedding");
  CHECK(names[1] == "position_embedding");
  CHECK(names[2] == "blocks.0.attn_norm.weight");
  CHECK(names.back() == "head.weight");
  CHECK(std::set<std::string>(names.begin(), names.end()).size() == names.size());

  const int64_t w = kSmall.width, v = kSmall.vocab, l = kSmall.layers;
  const int64_t per_block = 2 * w + (3 * w * w + 3 * w) + (w * w + w) + 2 * w +
                            (4 * w * w + 4 * w) + (4 * w * w + w);
  CHECK(m.num_parameters() == v * w + kSmall.context * w + l * per_block + 2 * w + v * w);

  const auto specs = m.tensor_specs();
  REQUIRE(specs.size() == names.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    CHECK(specs[i].name == names[i]);
    CHECK(specs[i].shape == m.parameters()[i].sizes().vec());
    CHECK(m.parameters()[i].requires_grad());
  }
  CHECK_THROWS_AS(m.parameter("nope"), InvalidInput);
}

TEST_CASE("the architecture description distinguishes models", "[model]") {
  auto other = kSmall;
  other.heads = 8;
  CHECK(architecture(kSmall) != architecture(other));
  CHECK(architecture(kSmall) == architecture(kSmall));
}

TEST_CASE("invalid options are rejected", "[model]") {
  auto bad = kSmall;
  bad.heads = 5;
  CHECK_THROWS_AS(Transformer(bad, 1), InvalidInput);
  bad = kSmall;
  bad.layers = 0;
  CHECK_THROWS_AS(Transformer(bad, 1), InvalidInput);
}

TEST_CASE("fragments round-trip through copy_fragment and write_fragment", "[model]") {
  Transformer m(kSmall, 5);
  const Transformer reference(kSmall, 5);
  // 3 fragments hold whole tensors; 40, more than the model's tensors, cut the largest into
  // blocks of rows.
  const uint32_t parts = GENERATE(3u, 40u);
  const auto layout = partition_tensors(m.tensor_specs(), parts);
  bool cut = false;
  for (uint32_t p = 0; p < parts; ++p) {
    const auto values = copy_fragment(m, layout, p);
    for (size_t i = 0; i < values.size(); ++i) {
      const TensorPiece& piece = layout.pieces[p][i];
      cut = cut || !piece.whole;
      const float* first = m.parameter(layout.tensors[piece.tensor].name).data_ptr<float>() + piece.offset;
      REQUIRE(values[i] == std::vector<float>(first, first + piece.numel));
    }
  }
  CHECK(cut == (parts == 40));

  auto values = copy_fragment(m, layout, 1);
  REQUIRE(values.size() == layout.fragments[1].size());
  for (size_t i = 0; i < values.size(); ++i)
    REQUIRE(static_cast<int64_t>(values[i].size()) == layout.fragments[1][i].numel());

  auto changed = values;
  for (auto& v : changed)
    for (auto& x : v) x += 1.0f;
  write_fragment(m, layout, 1, changed);
  CHECK(copy_fragment(m, layout, 1) == changed);
  CHECK(copy_fragment(m, layout, 0) == copy_fragment(reference, layout, 0));
  CHECK(copy_fragment(m, layout, 2) == copy_fragment(reference, layout, 2));
  CHECK(m.parameters()[0].requires_grad());

  write_fragment(m, layout, 1, values);
  CHECK(same_parameters(m, reference));
}

TEST_CASE("write_fragment and copy_fragment reject mismatched input", "[model]") {
  Transformer m(kSmall, 5);
  const auto layout = partition_tensors(m.tensor_specs(), 2);
  auto values = copy_fragment(m, layout, 0);

  auto fewer = values;
  fewer.pop_back();
  CHECK_THROWS_AS(write_fragment(m, layout, 0, fewer), InvalidInput);
  auto shorter = values;
  shorter[0].pop_back();
  CHECK_THROWS_AS(write_fragment(m, layout, 0, shorter), InvalidInput);

  auto wider = kSmall;
  wider.width = 64;
  const Transformer other(wider, 5);
  const auto other_layout = partition_tensors(other.tensor_specs(), 2);
  CHECK_THROWS_AS(copy_fragment(m, other_layout, 0), InvalidInput);
}

TEST_CASE("an untrained model predicts about uniformly: loss near ln(vocab)", "[model]") {
  const Transformer m(kSmall, 11);
  auto gen = at::detail::createCPUGenerator(3);
  const auto input = torch::randint(kSmall.vocab, {8, kSmall.context}, gen, torch::kInt64);
  const auto target = torch::randint(kSmall.vocab, {8, kSmall.context}, gen, torch::kInt64);
  torch::NoGradGuard no_grad;
  const double loss = m.loss(input, target).item<double>();
  CHECK(loss == Approx(std::log(static_cast<double>(kSmall.vocab))).margin(0.1));
}

TEST_CASE("attention is causal: a position does not see later tokens", "[model]") {
  const Transformer m(kSmall, 2);
  auto gen = at::detail::createCPUGenerator(4);
  const auto input = torch::randint(kSmall.vocab, {2, kSmall.context}, gen, torch::kInt64);
  auto altered = input.clone();
  altered.index_put_({torch::indexing::Slice(), -1}, (input.index({0, -1}).item<int64_t>() + 1) %
                                                         kSmall.vocab);
  torch::NoGradGuard no_grad;
  const auto a = m.logits(input), b = m.logits(altered);
  const auto t = kSmall.context - 1;
  CHECK(torch::allclose(a.narrow(1, 0, t), b.narrow(1, 0, t)));
  CHECK_FALSE(torch::allclose(a.narrow(1, t, 1), b.narrow(1, t, 1)));
  // Shorter inputs than the context work too.
  CHECK(m.logits(input.narrow(1, 0, 5)).sizes() == torch::IntArrayRef({2, 5, kSmall.vocab}));
}

TEST_CASE("every parameter gets a gradient", "[model]") {
  Transformer m(kSmall, 9);
  const auto input = torch::randint(kSmall.vocab, {2, kSmall.context}, torch::kInt64);
  m.loss(input, input).backward();
  for (size_t i = 0; i < m.parameters().size(); ++i) {
    INFO(m.parameter_names()[i]);
    REQUIRE(m.parameters()[i].grad().defined());
  }
}

TEST_CASE("the built-in tensor list without libtorch is the model's own, and its layout the config's", "[model]") {
  for (const ModelOptions& o : {kSmall, ModelOptions{.vocab = 96, .layers = 3, .width = 24, .heads = 3, .context = 5}}) {
    const Transformer m(o, 1);
    CHECK(builtin_tensor_specs(o) == m.tensor_specs());
  }
  // What diloco-learner registers for a config is what the merger and replay lay out without it.
  const RunConfig config = load_run_config(DILOCO_SOURCE_DIR "/configs/tiny.toml", {});
  const ModelSetup setup = build_model(config);
  CHECK(setup.layout.fingerprint == partition_tensors(setup.model.tensor_specs(), config.diloco.fragments).fingerprint);
  CHECK(setup.layout.tensors == setup.model.tensor_specs());
}
