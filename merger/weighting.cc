#include "merger/weighting.h"

#include <algorithm>
#include <cmath>

#include "core/errors.h"

namespace diloco {

double staleness_factor(uint64_t staleness, float staleness_alpha) {
  // std::pow(x, 0.0) is exactly 1, so alpha = 0 is bit-for-bit the paper's weighting.
  return std::pow(1.0 + static_cast<double>(staleness), -static_cast<double>(staleness_alpha));
}

double delta_weight(uint64_t tokens, uint32_t inner_steps, uint64_t staleness,
                    float staleness_alpha) {
  if (inner_steps == 0) return 0;
  const double t = static_cast<double>(tokens);
  return t * (t / inner_steps) * staleness_factor(staleness, staleness_alpha);
}

namespace {

// The mean of f(staleness) over `inputs`, weighted by tokens * (tokens / inner_steps), summed in
// input order; 1 when no input has a positive weight.
template <typename F>
double weighted_staleness_mean(std::span<const DeltaRef> inputs, F f) {
  double total = 0, sum = 0;
  for (const auto& ref : inputs) {
    const double w = delta_weight(ref.tokens, ref.inner_steps, ref.staleness, 0.0f);
    total += w;
    sum += w * f(ref.staleness);
  }
  return total > 0 ? sum / total : 1.0;
}

}  // namespace

double staleness_scale(std::span<const DeltaRef> inputs, float staleness_alpha) {
  if (staleness_alpha == 0.0f) return 1.0;  // exact, whatever the rounding of the mean
  const double scale = weighted_staleness_mean(
      inputs, [&](uint64_t s) { return staleness_factor(s, staleness_alpha); });
  return std::min(scale, 1.0);
}

double cgad_age_factor(uint64_t staleness, float decay, uint32_t cutoff) {
  if (staleness >= cutoff) return 0.0;
  const double s = static_cast<double>(staleness);
  const double gate = 0.5 * (1.0 + std::cos(M_PI * s / static_cast<double>(cutoff)));
  return std::exp(-static_cast<double>(decay) * s) * gate;
}

double cgad_age_scale(std::span<const DeltaRef> inputs, float decay, uint32_t cutoff) {
  const double scale = weighted_staleness_mean(
      inputs, [&](uint64_t s) { return cgad_age_factor(s, decay, cutoff); });
  return std::clamp(scale, 0.0, 1.0);
}

bool too_stale(uint64_t staleness, uint32_t max_staleness) {
  return max_staleness != kUnlimitedStaleness && staleness > max_staleness;
}

void weigh(DeltaRef& ref, uint64_t version, const OuterHyper& hyper) {
  DILOCO_ENFORCE(ref.base_version <= version, "delta of ", ref.learner_id, " seq ", ref.seq,
                 " has base version ", ref.base_version, " above the version ", version);
  ref.staleness = version - ref.base_version;
  ref.weight = delta_weight(ref.tokens, ref.inner_steps, ref.staleness, hyper.staleness_alpha);
}

}  // namespace diloco
