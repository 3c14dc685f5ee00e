// The built-in model's tensors without libtorch (core/model/builtin_specs.h): what benches and
// tests that fake the built-in model lay out. The list is written out here by hand for a small
// model; tests/model/test_model.cpp checks it against the model's own parameters.
#include <catch2/catch.hpp>

#include "core/errors.h"
#include "core/fragments/partition.h"
#include "core/model/builtin_specs.h"

using namespace diloco;

TEST_CASE("the built-in model's tensors in registration order, written out for one block", "[model_specs]") {
  const ModelOptions o{.vocab = 96, .layers = 1, .width = 8, .heads = 2, .context = 4};
  const std::vector<TensorSpec> want = {
      {"token_embedding", {96, 8}},
      {"position_embedding", {4, 8}},
      {"blocks.0.attn_norm.weight", {8}},
      {"blocks.0.attn_norm.bias", {8}},
      {"blocks.0.attn.qkv.weight", {24, 8}},
      {"blocks.0.attn.qkv.bias", {24}},
      {"blocks.0.attn.out.weight", {8, 8}},
      {"blocks.0.attn.out.bias", {8}},
      {"blocks.0.mlp_norm.weight", {8}},
      {"blocks.0.mlp_norm.bias", {8}},
      {"blocks.0.mlp.up.weight", {32, 8}},
      {"blocks.0.mlp.up.bias", {32}},
      {"blocks.0.mlp.down.weight", {8, 32}},
      {"blocks.0.mlp.down.bias", {8}},
      {"final_norm.weight", {8}},
      {"final_norm.bias", {8}},
      {"head.weight", {96, 8}},
  };
  CHECK(builtin_tensor_specs(o) == want);
}

TEST_CASE("the built-in layout of a config is the partition of its tensors, the same for any seed or run",
          "[model_specs]") {
  RunConfig config;
  config.model.layers = 2;
  config.model.width = 16;
  config.model.heads = 4;
  config.model.context = 8;
  config.diloco.fragments = 3;
  const FragmentLayout layout = builtin_layout(config);
  REQUIRE(layout.num_fragments() == 3);
  CHECK(layout.tensors.size() == 5 + 12 * 2);
  // vocab x w twice (embedding, head), context x w, per block 12 w^2 + 13 w, two final norms.
  const int64_t w = 16;
  CHECK(layout.numel() == 2 * kVocabSize * w + 8 * w + 2 * (12 * w * w + 13 * w) + 2 * w);
  RunConfig other = config;
  other.run.seed = config.run.seed + 1;
  other.run.id = "another-run";
  other.train.lr *= 2;
  other.diloco.H *= 2;
  CHECK(builtin_layout(other).fingerprint == layout.fingerprint);
  other.model.width = 32;
  CHECK(builtin_layout(other).fingerprint != layout.fingerprint);
}

TEST_CASE("built-in model options that make no model are refused", "[model_specs]") {
  const ModelOptions good{.vocab = 96, .layers = 1, .width = 8, .heads = 2, .context = 4};
  CHECK_NOTHROW(builtin_tensor_specs(good));
  auto bad = good;
  bad.heads = 3;  // 8 is not a multiple of 3
  CHECK_THROWS_AS(builtin_tensor_specs(bad), InvalidInput);
  bad = good;
  bad.layers = 0;
  CHECK_THROWS_AS(builtin_tensor_specs(bad), InvalidInput);
  bad = good;
  bad.context = 0;
  CHECK_THROWS_AS(builtin_tensor_specs(bad), InvalidInput);
}
