// The outer optimizer: applies the aggregated outer gradient of one tensor, scaled by the merge's
// share of a round (g = share * d), to the global parameters theta, in fp32, element by element,
// in index order.
//   Nesterov: buf = mu * buf + g;  theta -= lr * (g + mu * buf)   (DiLoCo: lr 0.7, mu 0.9)
//   Sgd:      theta -= lr * g                                     (buf is left as it is)
//   DelayedNesterov, DN(N) (Liu et al., "Asynchronous Local-SGD Training for Language Modeling",
//   arXiv 2401.09135, in the form the HALoS authors implement, arXiv 2506.04531), with the
//   accumulator acc (FragmentState::outer_state), beta = mu, c = dn_activation, N = dn_period:
//     acc += g
//     at every N-th version (the new version % N == 0, so recovery and replay from any checkpoint
//     fold at the same merges):
//       buf = beta * buf + acc / N;  theta -= lr * ((1 - c*N + c) * beta * buf + g / N);  acc = 0
//     otherwise:
//       theta -= lr * (c * beta * buf + g / N)
//     lr is the configured per-merge lr: HALoS's scripts multiply the lr they configure by N, so
//     their "lr 0.15, N 2" is our lr 0.3.
//   Cgad: CGAD (arXiv 2605.09126): the outer gradient is first scaled by the merge's age factor
//   (exponential decay with a cosine gate reaching 0 at a cutoff age, weighting.h; merge_step
//   passes it in `scale` together with the share), then an Adam step with buf the first moment
//   and v (FragmentState::outer_state) the second:
//     buf = b1 * buf + (1 - b1) * g;  v = b2 * v + (1 - b2) * g * g
//     theta -= lr * (buf / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
//   with b1 = mu, b2 = adam_beta2, eps = adam_epsilon and t the new version counted from where the
//   run began using this optimizer (FragmentState::optimizer_since; genesis in a run that never
//   switched), so bias correction too is a function of the version. A merge whose inputs are all
//   at or past the cutoff (scale 0) takes no step: parameters and both moments stay. The paper's exact decay
//   rate, cutoff and Adam constants are not in what we could read: the defaults (decay 0.1 per
//   version of staleness, cutoff 16, beta2 0.99, eps 1e-8) are ours. Adam normalises the step
//   size, so its lr is of the order of the parameter change wanted per merge (1e-3..1e-2), far
//   below Nesterov's 0.7.
// A scale of 1 leaves d exact, so records without a share rebuild bit for bit as before.
// The outer gradient points from the new parameters back to the old ones (delta = anchor -
// theta_learner), hence the minus sign: lr 1 with Sgd and one learner adopts that learner's
// parameters.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/codec/messages.h"

namespace diloco {

// Updates `params`, `momentum` and (DelayedNesterov, Cgad) `state` in place with `update`
// scaled by `scale`, for the merge that makes `version` (counted from the version at which the run
// began using this optimizer: merge_step starts a switched-to optimizer's buffers from zero); all the same size, `state` empty for
// Nesterov and Sgd (InternalError otherwise). Reads lr, momentum and the optimizer's own
// hyper-parameters from `hyper`.
void outer_step(OuterOptimizerKind kind, const OuterHyper& hyper, uint64_t version,
                std::span<float> params, std::span<float> momentum, std::span<float> state,
                std::span<const float> update, float scale = 1.0f);

// The outer momentum of the merge that makes `version`, the `merges`-th merge (1 for the first) since
// the run began using its optimizer: `momentum`, decayed linearly to `final_momentum` from version
// decay_from to decay_to (then held; decay_to 0: no decay), and scaled by merges / warmup while
// merges < warmup (0: no warm-up). Pier (arXiv 2511.17849) warms the outer momentum up and decays
// it; the shapes and lengths here are ours, set per run (merger.momentum_*). The merger records
// the momentum it used in the merge record, so replay and verify need no schedule.
struct MomentumSchedule {
  float momentum = 0.9f;
  uint32_t warmup = 0;
  uint32_t decay_from = 0;
  uint32_t decay_to = 0;
  float final_momentum = 0.5f;
};
float scheduled_momentum(const MomentumSchedule& schedule, uint64_t merges, uint64_t version);

// Zero momentum shaped like `params`: the outer state of a fragment at genesis (also the
// optimizer's second buffer when it keeps one).
std::vector<DenseTensor> initial_momentum(std::span<const DenseTensor> params);

}  // namespace diloco
