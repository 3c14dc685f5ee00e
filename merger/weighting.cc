#include "merger/weighting.h"

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
