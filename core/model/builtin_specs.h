// The built-in model's architecture without libtorch: its options and the names and shapes of
// its tensors, in the order the model registers them. Tools that lay out or fake the built-in
// model (bench programs, tests) use this; the model itself is core/model/transformer.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config/run_config.h"
#include "core/fragments/layout.h"

namespace diloco {

// The fixed vocabulary of the corpus (core/data/corpus.h): '\n' and printable ASCII.
inline constexpr int64_t kVocabSize = 96;

struct ModelOptions {
  int64_t vocab = 0;
  int64_t layers = 0;
  int64_t width = 0;  // a multiple of heads
  int64_t heads = 0;
  int64_t context = 0;
};

ModelOptions model_options(const ModelConfig& config, int64_t vocab = kVocabSize);

// Describes the architecture (error messages, model files).
std::string architecture(const ModelOptions& options);

// The tensors in registration order: token_embedding, position_embedding, per block i
// blocks.i.attn_norm.{weight,bias}, blocks.i.attn.qkv.{weight,bias}, blocks.i.attn.out.{weight,bias},
// blocks.i.mlp_norm.{weight,bias}, blocks.i.mlp.up.{weight,bias}, blocks.i.mlp.down.{weight,bias},
// then final_norm.{weight,bias} and head.weight. Throws InvalidInput for non-positive sizes or a
// width that is not a multiple of heads.
std::vector<TensorSpec> builtin_tensor_specs(const ModelOptions& options);

// The built-in model's fragment layout under a run config ([model], diloco.fragments).
FragmentLayout builtin_layout(const RunConfig& config);

}  // namespace diloco
