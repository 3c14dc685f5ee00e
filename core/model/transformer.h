// The model: a character-level decoder-only transformer language model (GPT-2 shape).
//
//   token embedding + learned position embedding
//   -> layers x pre-LN block: x += attn(LN(x)) (causal multi-head self-attention);
//                             x += mlp(LN(x))  (width -> 4*width, GELU (tanh), -> width)
//   -> final LN -> output head (no bias)
//
// The output head is untied from the token embedding: they are separate tensors, so they can
// land in different fragments and the merger can treat the embedding (plain average) and the head
// (radial-directional) by their own rules without one tensor meaning two things.
//
// Parameters are plain fp32 tensors listed in a fixed order with fixed names; the fragment layout
// (core/fragments) is computed from that list, and deltas and adoption go through
// copy_fragment / write_fragment.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/config/run_config.h"
#include "core/fragments/layout.h"
#include "core/model/builtin_specs.h"

namespace diloco {

class Transformer {
 public:
  // Initialisation depends only on options and seed (its own generator, no global RNG state):
  // weights N(0, 0.02), the two residual projections of each block N(0, 0.02 / sqrt(2 * layers))
  // so the residual stream does not grow with depth, biases 0, layer-norm gains 1.
  // Throws InvalidInput for non-positive sizes or a width that is not a multiple of heads.
  Transformer(const ModelOptions& options, uint64_t seed);
  // Tensors are handles: a copy would share the parameters, not duplicate them. Keep anchors and
  // snapshots as copy_fragment values instead.
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;
  Transformer(Transformer&&) = default;
  Transformer& operator=(Transformer&&) = default;

  const ModelOptions& options() const { return options_; }

  // In this order: token_embedding, position_embedding, then per block i
  // blocks.i.attn_norm.{weight,bias}, blocks.i.attn.qkv.{weight,bias},
  // blocks.i.attn.out.{weight,bias}, blocks.i.mlp_norm.{weight,bias},
  // blocks.i.mlp.up.{weight,bias}, blocks.i.mlp.down.{weight,bias}; then final_norm.{weight,bias}
  // and head.weight.
  const std::vector<std::string>& parameter_names() const { return names_; }
  const std::vector<torch::Tensor>& parameters() const { return params_; }
  const torch::Tensor& parameter(std::string_view name) const;  // throws InvalidInput if unknown
  std::vector<TensorSpec> tensor_specs() const;                 // names and shapes, same order
  // The same list from the options alone, without allocating a model (throws InvalidInput as the
  // constructor does).
  static std::vector<TensorSpec> specs(const ModelOptions& options);
  // The constructor's initialisation, tensor by tensor in list order, into the tensor `target`
  // returns for each (any tensor of that spec's shape: a model's parameter, a view of a caller's
  // buffer, or scratch space for one the caller does not keep). Values depend only on (options,
  // seed), so a caller can build version 0 of some fragments without holding the whole model.
  static void initialise_in_order(const ModelOptions& options, uint64_t seed,
                                  const std::function<torch::Tensor(size_t, const TensorSpec&)>& target);
  int64_t num_parameters() const;

  // input: int64 [batch, T] with T <= context. Returns logits [batch, T, vocab].
  torch::Tensor logits(const torch::Tensor& input) const;
  // Mean cross-entropy of predicting target from input, in nats per character.
  torch::Tensor loss(const torch::Tensor& input, const torch::Tensor& target) const;

 private:
  static void initialise(const ModelOptions& options, const std::string& name, torch::Tensor& t,
                         at::Generator& generator);
  struct Block {
    torch::Tensor attn_norm_w, attn_norm_b, qkv_w, qkv_b, out_w, out_b;
    torch::Tensor mlp_norm_w, mlp_norm_b, up_w, up_b, down_w, down_b;
  };
  torch::Tensor add(std::string name, std::vector<int64_t> shape);

  ModelOptions options_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
  torch::Tensor token_embedding_, position_embedding_, final_norm_w_, final_norm_b_, head_w_;
  std::vector<Block> blocks_;
  torch::Tensor causal_mask_;  // [context, context], -inf above the diagonal, 0 elsewhere
};

// The fp32 values of fragment p's tensors, one flat vector per tensor in layout order.
// Throws InvalidInput if the layout names a tensor this model does not have or with another shape.
std::vector<std::vector<float>> copy_fragment(const Transformer& model,
                                              const FragmentLayout& layout, uint32_t p);

// Overwrites fragment p's tensors in place (the inner optimizer keeps its references and state).
// values: one flat vector per tensor of the fragment, in layout order; sizes must match.
void write_fragment(Transformer& model, const FragmentLayout& layout, uint32_t p,
                    std::span<const std::vector<float>> values);

}  // namespace diloco
