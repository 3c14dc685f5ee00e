// One merge of one fragment as a deterministic function: state at version v plus the input deltas
// (with the raw weights recorded in the merge log) gives the state at version v + 1 and its
// MergeRecord. Live merging, recovery after a rebalance or crash and offline replay all call this
// one function, so applying the logged records to a checkpoint rebuilds every version bit for bit.
//
// Per tensor, in layout order: weights normalised to sum 1 -> aggregate (aggregate.h, with the
// tensor's rule) -> outer optimizer step (outer_optimizer.h). No threads, fixed order, fp32.
#pragma once

#include <span>

#include "core/codec/messages.h"
#include "core/fragments/layout.h"

namespace diloco {

// One input of a merge: which delta (ref.weight is the raw weight, ref.staleness is relative to
// the version merged onto) and its decoded tensors in layout order. The tensors are a view: the
// caller keeps them alive for the call.
struct MergeInput {
  DeltaRef ref;
  std::span<const DenseTensor> tensors;
};

struct MergeOptions {
  MergeRule rule = MergeRule::RadialDirectional;
  OuterOptimizerKind optimizer = OuterOptimizerKind::Nesterov;
  OuterHyper hyper;                      // lr and momentum are used here; all of it is recorded
  std::span<const TensorSpec> tensors;   // the fragment's layout: names pick per-tensor rules
  // The share of a full round this merge applies, in (0, 1]: the aggregated outer gradient is
  // scaled by it before the outer optimizer. With quorum 1 and M learners every delta is merged
  // alone; unscaled, a round then moves the fragment M outer steps (with the momentum of each)
  // instead of one, and the global model diverges. Scaled by 1/M, a round of singletons adds up
  // to one DiLoCo outer step in expectation, and a merge of all M learners is plain DiLoCo.
  float share = 1.0f;
};

// The share of a round a merge of these inputs applies while `live` learners are live: distinct
// learners merged / live ones (merged ones count as live); 1 for no inputs.
float round_share(std::span<const MergeInput> inputs, size_t live);

// Throws InvalidInput unless lr is finite and > 0, momentum in [0, 1), staleness_alpha finite
// and >= 0, and quorum >= 1.
void validate_outer_hyper(const OuterHyper& hyper);

// Writes version current.version + 1 of the fragment into `next` (which must not be `current`;
// its buffers are reused, so a caller can alternate two states without allocating): run id,
// fingerprint, fragment, version, params, momentum and checksum; consumed, last_merge and
// accounted are copied from `current` for the caller to update. Returns the MergeRecord with fragment, run id,
// fingerprint, version, prev_version, inputs (as given, raw weights), rule, optimizer, hyper and
// checksum; the caller adds dropped deltas, merger instance, epoch and time.
//
// Throws InvalidInput when the inputs do not fit: no inputs, weights that are negative, not
// finite or sum to 0, a base version above current.version or a staleness other than
// current.version - base_version, tensors (of the state or of a delta) that do not match the
// layout, or invalid hyper-parameters. `current` and `next` are untouched then.
MergeRecord merge_step(const FragmentState& current, std::span<const MergeInput> inputs,
                       const MergeOptions& options, FragmentState& next);

}  // namespace diloco
