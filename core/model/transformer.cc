#include "core/model/transformer.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>

#include "core/errors.h"

namespace diloco {
namespace {

constexpr double kInitStd = 0.02;
constexpr double kLayerNormEps = 1e-5;

torch::Tensor layer_norm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  return torch::layer_norm(x, {x.size(-1)}, w, b, kLayerNormEps);
}

// The model's tensor that piece i of fragment p comes from, checked against the layout, and the
// rows of it the piece holds.
torch::Tensor checked_piece(const Transformer& model, const FragmentLayout& layout, uint32_t p, size_t i) {
  const TensorPiece& piece = layout.pieces.at(p).at(i);
  const TensorSpec& spec = layout.tensors.at(piece.tensor);
  const torch::Tensor& t = model.parameter(spec.name);
  if (t.sizes().vec() != spec.shape)
    throw InvalidInput(detail::concat("fragment ", p, ": tensor ", spec.name, " has shape ",
                                      t.sizes(), " in the model but ",
                                      torch::IntArrayRef(spec.shape), " in the layout"));
  return piece.whole ? t : t.narrow(0, piece.row_begin, piece.rows);
}

}  // namespace

torch::Tensor Transformer::add(std::string name, std::vector<int64_t> shape) {
  names_.push_back(std::move(name));
  params_.push_back(torch::empty(shape, torch::kFloat32));
  return params_.back();
}

std::vector<TensorSpec> Transformer::specs(const ModelOptions& o) { return builtin_tensor_specs(o); }

void Transformer::initialise(const ModelOptions& options, const std::string& name, torch::Tensor& t,
                             at::Generator& generator) {
  const double residual_std = kInitStd / std::sqrt(2.0 * static_cast<double>(options.layers));
  torch::NoGradGuard no_grad;
  const auto ends_with = [&](std::string_view s) { return name.ends_with(s); };
  if (ends_with("norm.weight"))
    t.fill_(1.0);
  else if (ends_with(".bias"))
    t.zero_();
  else if (ends_with("attn.out.weight") || ends_with("mlp.down.weight"))
    t.normal_(0.0, residual_std, generator);
  else
    t.normal_(0.0, kInitStd, generator);
}

void Transformer::initialise_in_order(const ModelOptions& options, uint64_t seed,
                                      const std::function<torch::Tensor(size_t, const TensorSpec&)>& target) {
  // Parameters are initialised in list order from one generator, so the values depend only on
  // (options, seed).
  auto generator = at::detail::createCPUGenerator(seed);
  const auto list = specs(options);
  for (size_t i = 0; i < list.size(); ++i) {
    torch::Tensor t = target(i, list[i]);
    initialise(options, list[i].name, t, generator);
  }
}

Transformer::Transformer(const ModelOptions& options, uint64_t seed) : options_(options) {
  const auto& o = options_;
  const auto list = specs(o);  // validates the options
  auto next = list.begin();
  auto take = [&](std::string_view name) {
    if (next == list.end() || next->name != name)
      throw InvalidInput(detail::concat("model construction out of step with the tensor list at ", name));
    const auto& spec = *next++;
    return add(spec.name, spec.shape);
  };
  token_embedding_ = take("token_embedding");
  position_embedding_ = take("position_embedding");
  for (int64_t i = 0; i < o.layers; ++i) {
    const std::string p = detail::concat("blocks.", i, ".");
    Block b;
    b.attn_norm_w = take(p + "attn_norm.weight");
    b.attn_norm_b = take(p + "attn_norm.bias");
    b.qkv_w = take(p + "attn.qkv.weight");
    b.qkv_b = take(p + "attn.qkv.bias");
    b.out_w = take(p + "attn.out.weight");
    b.out_b = take(p + "attn.out.bias");
    b.mlp_norm_w = take(p + "mlp_norm.weight");
    b.mlp_norm_b = take(p + "mlp_norm.bias");
    b.up_w = take(p + "mlp.up.weight");
    b.up_b = take(p + "mlp.up.bias");
    b.down_w = take(p + "mlp.down.weight");
    b.down_b = take(p + "mlp.down.bias");
    blocks_.push_back(std::move(b));
  }
  final_norm_w_ = take("final_norm.weight");
  final_norm_b_ = take("final_norm.bias");
  head_w_ = take("head.weight");

  initialise_in_order(o, seed, [&](size_t i, const TensorSpec&) { return params_[i]; });
  for (auto& t : params_) t.set_requires_grad(true);

  causal_mask_ = torch::full({o.context, o.context}, -std::numeric_limits<float>::infinity())
                     .triu(1);
}

const torch::Tensor& Transformer::parameter(std::string_view name) const {
  for (size_t i = 0; i < names_.size(); ++i)
    if (names_[i] == name) return params_[i];
  throw InvalidInput(detail::concat("the model has no tensor named '", name, "'"));
}

std::vector<TensorSpec> Transformer::tensor_specs() const {
  std::vector<TensorSpec> specs;
  for (size_t i = 0; i < params_.size(); ++i)
    specs.push_back(TensorSpec{names_[i], params_[i].sizes().vec()});
  return specs;
}

int64_t Transformer::num_parameters() const {
  int64_t n = 0;
  for (const auto& t : params_) n += t.numel();
  return n;
}

torch::Tensor Transformer::logits(const torch::Tensor& input) const {
  const auto& o = options_;
  if (input.dim() != 2 || input.size(1) > o.context || input.scalar_type() != torch::kInt64)
    throw InvalidInput(detail::concat("model input must be int64 [batch, T <= ", o.context,
                                      "], got ", input.scalar_type(), " ", input.sizes()));
  const int64_t batch = input.size(0);
  const int64_t time = input.size(1);
  const int64_t head_dim = o.width / o.heads;

  torch::Tensor x = torch::embedding(token_embedding_, input) +
                    position_embedding_.narrow(0, 0, time);
  const torch::Tensor mask = causal_mask_.narrow(0, 0, time).narrow(1, 0, time);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  for (const Block& b : blocks_) {
    // [batch, time, 3, heads, head_dim] -> three [batch, heads, time, head_dim]
    const auto qkv = torch::linear(layer_norm(x, b.attn_norm_w, b.attn_norm_b), b.qkv_w, b.qkv_b)
                         .view({batch, time, 3, o.heads, head_dim})
                         .permute({2, 0, 3, 1, 4});
    const auto q = qkv[0], k = qkv[1], v = qkv[2];
    const auto attention = torch::softmax(torch::matmul(q, k.transpose(-2, -1)) * scale + mask, -1);
    const auto y = torch::matmul(attention, v).transpose(1, 2).reshape({batch, time, o.width});
    x = x + torch::linear(y, b.out_w, b.out_b);

    const auto h = torch::gelu(
        torch::linear(layer_norm(x, b.mlp_norm_w, b.mlp_norm_b), b.up_w, b.up_b), "tanh");
    x = x + torch::linear(h, b.down_w, b.down_b);
  }
  return torch::linear(layer_norm(x, final_norm_w_, final_norm_b_), head_w_);
}

torch::Tensor Transformer::loss(const torch::Tensor& input, const torch::Tensor& target) const {
  const auto l = logits(input);
  return torch::cross_entropy_loss(l.view({-1, options_.vocab}), target.reshape({-1}));
}

std::vector<std::vector<float>> copy_fragment(const Transformer& model,
                                              const FragmentLayout& layout, uint32_t p) {
  std::vector<std::vector<float>> values;
  for (size_t i = 0; i < layout.fragments.at(p).size(); ++i) {
    const torch::Tensor t = checked_piece(model, layout, p, i).detach().contiguous();
    values.emplace_back(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
  }
  return values;
}

void write_fragment(Transformer& model, const FragmentLayout& layout, uint32_t p,
                    std::span<const std::vector<float>> values) {
  const auto& specs = layout.fragments.at(p);
  if (values.size() != specs.size())
    throw InvalidInput(detail::concat("fragment ", p, " has ", specs.size(), " tensors, got ",
                                      values.size(), " value vectors"));
  std::vector<torch::Tensor> targets;
  for (size_t i = 0; i < specs.size(); ++i) {
    targets.push_back(checked_piece(model, layout, p, i));
    if (static_cast<int64_t>(values[i].size()) != specs[i].numel())
      throw InvalidInput(detail::concat("fragment ", p, ": tensor ", specs[i].name, " has ",
                                        specs[i].numel(), " values, got ", values[i].size()));
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < specs.size(); ++i) {
    // copy_ (rather than a raw memcpy) bumps the tensor's version counter, so autograd notices
    // if a graph that saved the old values were used after this write.
    targets[i].copy_(torch::from_blob(const_cast<float*>(values[i].data()), targets[i].sizes(), torch::kFloat32));
  }
}

}  // namespace diloco
