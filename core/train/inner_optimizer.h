// The inner optimizer of a learner: AdamW with linear warmup and cosine decay, and gradient
// clipping. Its state (moments) stays local to the learner and survives the adoption of new
// global parameters, as in DiLoCo.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "core/config/run_config.h"

namespace diloco {

struct InnerOptimizerOptions {
  double lr = 3e-3;           // peak learning rate
  double final_lr_ratio = 0.1;  // the cosine ends at lr * final_lr_ratio
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double weight_decay = 0.1;  // decoupled; applied to tensors of rank >= 2 only (not to biases
                              // and layer-norm gains, whose scale is meaningful)
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // max global L2 norm of the gradients; 0 disables clipping
};

InnerOptimizerOptions inner_optimizer_options(const TrainConfig& train);

// Learning rate of inner step `step` (0 for the first step):
//   step < warmup:          lr * (step + 1) / warmup
//   warmup <= step < total: cosine from lr down to lr * final_lr_ratio
//   step >= total:          lr * final_lr_ratio (learners may train past the planned total)
double lr_at(const InnerOptimizerOptions& options, int64_t step);

class InnerOptimizer {
 public:
  InnerOptimizer(const std::vector<torch::Tensor>& parameters,
                 const InnerOptimizerOptions& options);

  // Sets the learning rate of `step`, clips the gradients, updates the parameters; returns the
  // global gradient norm before clipping.
  double step(int64_t step);
  void zero_grad();

 private:
  InnerOptimizerOptions options_;
  std::vector<torch::Tensor> parameters_;
  torch::optim::AdamW adamw_;
};

}  // namespace diloco
