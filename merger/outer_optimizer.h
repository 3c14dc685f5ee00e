// The outer optimizer: applies the aggregated outer gradient of one tensor, scaled by the merge's
// share of a round (g = share * d), to the global parameters theta, in fp32, element by element.
//   Nesterov: buf = mu * buf + g;  theta -= lr * (g + mu * buf)   (DiLoCo: lr 0.7, mu 0.9)
//   Sgd:      theta -= lr * g                                     (buf is left as it is)
// share 1 leaves d exact, so records without a share rebuild bit for bit as before.
// The outer gradient points from the new parameters back to the old ones (delta = anchor -
// theta_learner), hence the minus sign: lr 1 with Sgd and one learner adopts that learner's
// parameters.
#pragma once

#include <span>
#include <vector>

#include "core/codec/messages.h"

namespace diloco {

// Updates `params` and (Nesterov) `momentum` in place with `update`; all three the same size
// (InternalError otherwise).
void outer_step(OuterOptimizerKind kind, float lr, float momentum_coefficient,
                std::span<float> params, std::span<float> momentum,
                std::span<const float> update, float share = 1.0f);

// Zero momentum shaped like `params`: the outer state of a fragment at genesis.
std::vector<DenseTensor> initial_momentum(std::span<const DenseTensor> params);

}  // namespace diloco
