// One merge of one fragment as a deterministic function: state at version v plus the input deltas
// (with the raw weights recorded in the merge log) gives the state at version v + 1 and its
// MergeRecord. Live merging, recovery after a rebalance or crash and offline replay all call this
// one function, so applying the logged records to a checkpoint rebuilds every version bit for bit.
//
// Per tensor, in layout order: weights normalised to sum 1 -> aggregate (aggregate.h, with the
// tensor's rule) -> outer optimizer step (outer_optimizer.h) -> with a quantized downlink, the
// step's change quantized with error feedback and applied to the previous version (below). Fixed
// order, fp32. A tensor's work is divided into fixed ranges (aggregate.h's MergeWork) that the
// threads of MergeOptions::pool share; the division, and so every bit, is the same for any number
// of threads.
#pragma once

#include <span>

#include "core/codec/messages.h"
#include "core/fragments/layout.h"
#include "merger/aggregate.h"
#include "merger/delta_tensors.h"

namespace diloco {

// One input of a merge: which delta (ref.weight is the raw weight, ref.staleness is relative to
// the version merged onto) and its tensors in layout order, fp32 or as they travelled (INT8 and
// INT4 are dequantized range by range during the merge). The tensors are a view: the caller keeps
// them alive for the call.
struct MergeInput {
  DeltaRef ref;
  DeltaView tensors;
};

// The largest tensor whose RDA aggregate a merge holds whole (16M values, 64 MiB): a larger
// one is aggregated a range at a time, reading its inputs once more, so that the merge of a
// fragment of any size needs no buffer of its largest tensor. Either way gives the same bits.
inline constexpr size_t kKeptAggregateValues = size_t{1} << 24;

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
  //
  // The share also carries the inputs' staleness scale (weighting.h), so that alpha > 0 shrinks
  // the update of a stale merge, not only the weight of its stale inputs against fresh ones.
  float share = 1.0f;
  // The part of `share` that is the staleness scale; recorded (the step uses `share` only).
  float staleness_scale = 1.0f;
  // How the new version travels (recorded). With F32 the new parameters are the outer step's.
  // Otherwise the step's change plus the state's downlink_residual is quantized; the new
  // parameters are the previous ones plus the dequantized change (apply_update), which is what a
  // subscriber holding the previous version reconstructs from the update message, and what was
  // not sent stays in downlink_residual for the next merge.
  DownlinkCodec downlink;
  // Out, optional: the quantized change of every tensor (a quantized downlink only; cleared
  // otherwise), for the update message.
  std::vector<QuantizedTensor>* change = nullptr;
  // How norms are summed (aggregate.h; recorded): new merges use kNormBlock, a rebuilt one its
  // record's value. 0 or a power of two in [kMinNormBlock, kMaxNormBlock].
  uint32_t norm_block = kNormBlock;
  // Threads that share the arithmetic (not recorded: they change no bit); null = the caller's.
  WorkPool* pool = nullptr;
  // RDA tensors of at most this many values have their aggregate held whole during the step,
  // larger ones are aggregated a range at a time (not recorded: it changes no bit).
  size_t kept_aggregate_values = kKeptAggregateValues;
};

// The options a merge record was made with (rule, optimizer, hyper, share, staleness scale,
// downlink, norm_block), for rebuilding it.
MergeOptions recorded_merge_options(const MergeRecord& record, std::span<const TensorSpec> tensors);

// The share of a round a merge of these inputs applies while `live` learners are live: distinct
// learners merged / live ones (merged ones count as live); 1 for no inputs.
float round_share(std::span<const MergeInput> inputs, size_t live);

// staleness_scale (weighting.h) of the inputs' refs.
double staleness_scale(std::span<const MergeInput> inputs, float staleness_alpha);

// Sets options.staleness_scale to the staleness scale of `inputs` (with
// options.hyper.staleness_alpha; their staleness must be set) and options.share to
// (share_scaling ? round_share(inputs, live) : 1) * that scale, in (0, 1].
void set_merge_share(MergeOptions& options, std::span<const MergeInput> inputs, size_t live,
                     bool share_scaling);

// Combines a share of a round with a staleness scale: the product, rounded to fp32, never 0
// (a scale that underflows leaves the smallest normal share). Exactly `round` when scale is 1.
float scaled_share(float round, double scale);

// Throws InvalidInput unless lr is finite and > 0, momentum in [0, 1), staleness_alpha finite
// and >= 0, quorum >= 1, dn_period >= 1, dn_activation in [0, 1], cgad_decay finite and >= 0,
// cgad_cutoff >= 1, adam_beta2 in [0, 1) and adam_epsilon finite and > 0.
void validate_outer_hyper(const OuterHyper& hyper);

// Whether a merge with `optimizer` switches the fragment's optimizer (another one stepped its
// buffers: merge_step starts them from zero and counts merges from there).
bool switches_optimizer(const FragmentState& state, OuterOptimizerKind optimizer);

// The count of the fragment's next merge with `optimizer` since the run began using it, as
// merge_step counts it (CGAD's bias correction, the momentum schedule's warm-up): 1 right after a
// switch, else state.version + 1 - state.optimizer_since.
uint64_t next_merge_count(const FragmentState& state, OuterOptimizerKind optimizer);

// Writes version current.version + 1 of the fragment into `next` (which must not be `current`;
// its buffers are reused, so a caller can alternate two states without allocating): run id,
// fingerprint, fragment, version, params, momentum, outer_state, downlink_residual and checksum. The outer_state
// of an optimizer that keeps one starts from zeros when `current` has none (an older checkpoint,
// or a run that switched optimizer) and is left empty otherwise. With Cgad the outer gradient
// is also scaled by the inputs' age factor (weighting.h). consumed, last_merge and
// accounted are copied from `current` for the caller to update. Returns the MergeRecord with fragment, run id,
// fingerprint, version, prev_version, inputs (as given, raw weights), rule, optimizer, hyper,
// share, staleness_scale and checksum; the caller adds dropped deltas, merger instance, epoch and time.
//
// Throws InvalidInput when the inputs do not fit: no inputs, weights that are negative, not
// finite or sum to 0, a base version above current.version or a staleness other than
// current.version - base_version, tensors (of the state or of a delta) that do not match the
// layout, or invalid hyper-parameters. `current` and `next` are untouched then.
MergeRecord merge_step(const FragmentState& current, std::span<const MergeInput> inputs,
                       const MergeOptions& options, FragmentState& next);

// The same merge written over `state` itself, tensor by tensor, with the same bits: the only
// memory it needs beyond the state is a few buffers of the largest tensor (the merger's, which
// keeps no second copy of a fragment). Invalid inputs throw before anything is written; after
// that `state` is the new version (bookkeeping fields untouched), so a caller that cannot use
// the result (not finite) must rebuild the fragment from the logs.
MergeRecord merge_step_in_place(FragmentState& state, std::span<const MergeInput> inputs, const MergeOptions& options);

}  // namespace diloco
