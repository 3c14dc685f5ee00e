#include "core/train/inner_optimizer.h"

#include <cmath>
#include <limits>
#include <memory>
#include <numbers>

#include "core/errors.h"

namespace diloco {
namespace {

std::vector<torch::optim::OptimizerParamGroup> param_groups(
    const std::vector<torch::Tensor>& parameters, const InnerOptimizerOptions& o) {
  std::vector<torch::Tensor> decayed, not_decayed;
  for (const auto& p : parameters) (p.dim() >= 2 ? decayed : not_decayed).push_back(p);
  const auto options = [&](double weight_decay) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(o.lr)
            .betas({o.beta1, o.beta2})
            .eps(o.eps)
            .weight_decay(weight_decay));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decayed.empty()) groups.emplace_back(decayed, options(o.weight_decay));
  if (!not_decayed.empty()) groups.emplace_back(not_decayed, options(0.0));
  return groups;
}

}  // namespace

InnerOptimizerOptions inner_optimizer_options(const TrainConfig& train) {
  InnerOptimizerOptions o;
  o.lr = train.lr;
  o.warmup_steps = train.warmup_steps;
  o.total_steps = train.total_steps;
  o.weight_decay = train.weight_decay;
  o.grad_clip = train.grad_clip;
  return o;
}

double lr_at(const InnerOptimizerOptions& o, int64_t step) {
  if (step < o.warmup_steps)
    return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps);
  const double final_lr = o.lr * o.final_lr_ratio;
  if (step >= o.total_steps) return final_lr;
  const double progress = static_cast<double>(step - o.warmup_steps) /
                          static_cast<double>(o.total_steps - o.warmup_steps);
  return final_lr + 0.5 * (o.lr - final_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

InnerOptimizer::InnerOptimizer(const std::vector<torch::Tensor>& parameters,
                               const InnerOptimizerOptions& options)
    : options_(options), parameters_(parameters), adamw_(param_groups(parameters, options)) {
  if (options.lr <= 0 || options.warmup_steps < 0 || options.total_steps < options.warmup_steps ||
      options.grad_clip < 0)
    throw InvalidInput(detail::concat("inner optimizer: need lr > 0 (", options.lr,
                                      "), 0 <= warmup_steps (", options.warmup_steps,
                                      ") <= total_steps (", options.total_steps,
                                      "), grad_clip >= 0 (", options.grad_clip, ")"));
}

double InnerOptimizer::step(int64_t step) {
  const double lr = lr_at(options_, step);
  for (auto& group : adamw_.param_groups())
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  // With max_norm = infinity clip_grad_norm_ only measures.
  const double max_norm =
      options_.grad_clip > 0 ? options_.grad_clip : std::numeric_limits<double>::infinity();
  const double norm = torch::nn::utils::clip_grad_norm_(parameters_, max_norm);
  adamw_.step();
  return norm;
}

void InnerOptimizer::zero_grad() { adamw_.zero_grad(); }

}  // namespace diloco
