#include "merger/outer_optimizer.h"

#include "core/errors.h"

namespace diloco {

void outer_step(OuterOptimizerKind kind, float lr, float momentum_coefficient,
                std::span<float> params, std::span<float> momentum,
                std::span<const float> update, float share) {
  DILOCO_ENFORCE_EQ(params.size(), update.size());
  DILOCO_ENFORCE_EQ(momentum.size(), update.size());
  float* theta = params.data();
  float* buf = momentum.data();
  const float* d = update.data();
  const size_t n = update.size();
  const float mu = momentum_coefficient;
  switch (kind) {
    case OuterOptimizerKind::Nesterov:
      for (size_t k = 0; k < n; ++k) {
        const float g = share * d[k];
        const float b = mu * buf[k] + g;
        buf[k] = b;
        theta[k] -= lr * (g + mu * b);
      }
      return;
    case OuterOptimizerKind::Sgd:
      for (size_t k = 0; k < n; ++k) theta[k] -= lr * (share * d[k]);
      return;
  }
  DILOCO_ENFORCE(false, "unknown outer optimizer ", static_cast<int>(kind));
}

std::vector<DenseTensor> initial_momentum(std::span<const DenseTensor> params) {
  std::vector<DenseTensor> momentum;
  momentum.reserve(params.size());
  for (const auto& p : params)
    momentum.push_back({.index = p.index,
                        .shape = p.shape,
                        .values = std::vector<float>(p.values.size(), 0.0f)});
  return momentum;
}

}  // namespace diloco
