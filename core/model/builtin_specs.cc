#include "core/model/builtin_specs.h"

#include "core/errors.h"
#include "core/fragments/partition.h"

namespace diloco {

ModelOptions model_options(const ModelConfig& config, int64_t vocab) {
  return ModelOptions{vocab, config.layers, config.width, config.heads, config.context};
}

std::string architecture(const ModelOptions& o) {
  return detail::concat("char-transformer-v1 vocab=", o.vocab, " layers=", o.layers,
                        " width=", o.width, " heads=", o.heads, " context=", o.context,
                        " mlp=4x-gelu-tanh norm=pre-ln head=untied-nobias");
}

std::vector<TensorSpec> builtin_tensor_specs(const ModelOptions& o) {
  if (o.vocab < 1 || o.layers < 1 || o.width < 1 || o.heads < 1 || o.context < 1 ||
      o.width % o.heads != 0)
    throw InvalidInput("invalid model options: " + architecture(o));
  const int64_t w = o.width;
  std::vector<TensorSpec> out;
  auto add = [&](std::string name, std::vector<int64_t> shape) { out.push_back(TensorSpec{std::move(name), std::move(shape)}); };
  add("token_embedding", {o.vocab, w});
  add("position_embedding", {o.context, w});
  for (int64_t i = 0; i < o.layers; ++i) {
    const std::string p = detail::concat("blocks.", i, ".");
    add(p + "attn_norm.weight", {w});
    add(p + "attn_norm.bias", {w});
    add(p + "attn.qkv.weight", {3 * w, w});
    add(p + "attn.qkv.bias", {3 * w});
    add(p + "attn.out.weight", {w, w});
    add(p + "attn.out.bias", {w});
    add(p + "mlp_norm.weight", {w});
    add(p + "mlp_norm.bias", {w});
    add(p + "mlp.up.weight", {4 * w, w});
    add(p + "mlp.up.bias", {4 * w});
    add(p + "mlp.down.weight", {w, 4 * w});
    add(p + "mlp.down.bias", {w});
  }
  add("final_norm.weight", {w});
  add("final_norm.bias", {w});
  add("head.weight", {o.vocab, w});
  return out;
}

FragmentLayout builtin_layout(const RunConfig& config) {
  return partition_tensors(builtin_tensor_specs(model_options(config.model)), config.diloco.fragments);
}

}  // namespace diloco
