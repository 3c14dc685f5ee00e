#include "merger/outer_optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/errors.h"

namespace diloco {

namespace {

void delayed_nesterov_step(const OuterHyper& h, uint64_t version, float* theta, float* buf,
                           float* acc, const float* d, size_t n, float scale) {
  const float lr = h.lr;
  const float beta = h.momentum;
  const float c = h.dn_activation;
  const float period = static_cast<float>(h.dn_period);
  if (version % h.dn_period == 0) {
    const float fold = (1.0f - c * period + c) * beta;
    for (size_t k = 0; k < n; ++k) {
      const float g = scale * d[k];
      const float a = acc[k] + g;
      const float b = beta * buf[k] + a / period;
      buf[k] = b;
      theta[k] -= lr * (fold * b + g / period);
      acc[k] = 0.0f;
    }
  } else {
    const float between = c * beta;
    for (size_t k = 0; k < n; ++k) {
      const float g = scale * d[k];
      acc[k] += g;
      theta[k] -= lr * (between * buf[k] + g / period);
    }
  }
}

void cgad_adam_step(const OuterHyper& h, uint64_t version, float* theta, float* m, float* v,
                    const float* d, size_t n, float scale) {
  const float lr = h.lr;
  const float b1 = h.momentum;
  const float b2 = h.adam_beta2;
  const float eps = h.adam_epsilon;
  const double t = static_cast<double>(version);
  const float correction1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), t));
  const float correction2 = static_cast<float>(1.0 - std::pow(static_cast<double>(b2), t));
  for (size_t k = 0; k < n; ++k) {
    const float g = scale * d[k];
    const float mk = b1 * m[k] + (1.0f - b1) * g;
    const float vk = b2 * v[k] + (1.0f - b2) * (g * g);
    m[k] = mk;
    v[k] = vk;
    theta[k] -= lr * ((mk / correction1) / (std::sqrt(vk / correction2) + eps));
  }
}

}  // namespace

float scheduled_momentum(const MomentumSchedule& s, uint64_t merges, uint64_t version) {
  double mu = s.momentum;
  if (s.decay_to > s.decay_from && version > s.decay_from) {
    const double t = std::min(1.0, static_cast<double>(version - s.decay_from) / (s.decay_to - s.decay_from));
    mu += (static_cast<double>(s.final_momentum) - mu) * t;
  }
  if (s.warmup > 0 && merges < s.warmup) mu *= static_cast<double>(merges) / s.warmup;
  return static_cast<float>(mu);
}

void outer_step(OuterOptimizerKind kind, const OuterHyper& hyper, uint64_t version,
                std::span<float> params, std::span<float> momentum, std::span<float> state,
                std::span<const float> update, float scale) {
  DILOCO_ENFORCE_EQ(params.size(), update.size());
  DILOCO_ENFORCE_EQ(momentum.size(), update.size());
  DILOCO_ENFORCE_EQ(state.size(), has_outer_state(kind) ? update.size() : 0);
  float* theta = params.data();
  float* buf = momentum.data();
  const float* d = update.data();
  const size_t n = update.size();
  const float lr = hyper.lr;
  const float mu = hyper.momentum;
  switch (kind) {
    case OuterOptimizerKind::Nesterov:
      for (size_t k = 0; k < n; ++k) {
        const float g = scale * d[k];
        const float b = mu * buf[k] + g;
        buf[k] = b;
        theta[k] -= lr * (g + mu * b);
      }
      return;
    case OuterOptimizerKind::Sgd:
      for (size_t k = 0; k < n; ++k) theta[k] -= lr * (scale * d[k]);
      return;
    case OuterOptimizerKind::DelayedNesterov:
      DILOCO_ENFORCE(hyper.dn_period >= 1, "dn_period 0");
      delayed_nesterov_step(hyper, version, theta, buf, state.data(), d, n, scale);
      return;
    case OuterOptimizerKind::Cgad:
      DILOCO_ENFORCE(version >= 1, "an Adam step makes version 1 or later");
      // Every input at or past the cutoff age: the merge counts for nothing. Adam would still
      // move the parameters along its decaying first moment; no step instead, moments kept.
      if (scale == 0.0f) return;
      cgad_adam_step(hyper, version, theta, buf, state.data(), d, n, scale);
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
