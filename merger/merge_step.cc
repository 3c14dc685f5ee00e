#include "merger/merge_step.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "core/errors.h"
#include "merger/aggregate.h"
#include "merger/outer_optimizer.h"
#include "merger/weighting.h"

namespace diloco {

bool switches_optimizer(const FragmentState& state, OuterOptimizerKind optimizer) {
  return state.optimizer && *state.optimizer != optimizer;
}

uint64_t next_merge_count(const FragmentState& state, OuterOptimizerKind optimizer) {
  return state.version + 1 - (switches_optimizer(state, optimizer) ? state.version : state.optimizer_since);
}

namespace {

// The state's tensors or a delta's (a DeltaView of either) against the layout.
void check_tensors(const DeltaView& tensors, std::span<const TensorSpec> layout, const std::string& what) {
  if (tensors.size() != layout.size())
    throw InvalidInput(detail::concat(what, " has ", tensors.size(), " tensors, the layout ", layout.size()));
  for (size_t t = 0; t < layout.size(); ++t) {
    const int64_t numel = layout[t].numel();
    if (tensors.shape(t) != layout[t].shape || tensors.values(t) != static_cast<size_t>(numel))
      throw InvalidInput(detail::concat(what, " tensor ", t, " (", layout[t].name, ") has ", tensors.values(t),
                                        " values, the layout ", numel, " (or a different shape)"));
  }
}

// Copies src into dst, reusing dst's memory.
void copy_tensors(const std::vector<DenseTensor>& src, std::vector<DenseTensor>& dst) {
  dst.resize(src.size());
  for (size_t t = 0; t < src.size(); ++t) {
    dst[t].index = src[t].index;
    dst[t].shape = src[t].shape;
    dst[t].values.assign(src[t].values.begin(), src[t].values.end());
  }
}

std::vector<DeltaRef> input_refs(std::span<const MergeInput> inputs) {
  std::vector<DeltaRef> refs;
  refs.reserve(inputs.size());
  for (const auto& in : inputs) refs.push_back(in.ref);
  return refs;
}

}  // namespace

float round_share(std::span<const MergeInput> inputs, size_t live) {
  std::set<std::string> learners;
  for (const auto& in : inputs) learners.insert(in.ref.learner_id);
  const size_t merged = learners.size();
  if (merged == 0) return 1.0f;
  return static_cast<float>(static_cast<double>(merged) / static_cast<double>(std::max(merged, live)));
}

float scaled_share(float round, double scale) {
  if (scale == 1.0) return round;
  const float share = static_cast<float>(static_cast<double>(round) * scale);
  return std::max(share, std::numeric_limits<float>::min());
}

double staleness_scale(std::span<const MergeInput> inputs, float staleness_alpha) {
  return staleness_scale(input_refs(inputs), staleness_alpha);
}

void set_merge_share(MergeOptions& options, std::span<const MergeInput> inputs, size_t live,
                     bool share_scaling) {
  const double scale = staleness_scale(inputs, options.hyper.staleness_alpha);
  options.share = scaled_share(share_scaling ? round_share(inputs, live) : 1.0f, scale);
  options.staleness_scale = scaled_share(1.0f, scale);
}

void validate_outer_hyper(const OuterHyper& h) {
  if (!(std::isfinite(h.lr) && h.lr > 0))
    throw InvalidInput(detail::concat("outer lr ", h.lr, " is not a positive number"));
  if (!(h.momentum >= 0 && h.momentum < 1))
    throw InvalidInput(detail::concat("outer momentum ", h.momentum, " is not in [0, 1)"));
  if (!(std::isfinite(h.staleness_alpha) && h.staleness_alpha >= 0))
    throw InvalidInput(detail::concat("staleness_alpha ", h.staleness_alpha, " is not >= 0"));
  if (h.quorum < 1) throw InvalidInput("quorum 0: a merge needs at least one learner");
  if (h.dn_period < 1) throw InvalidInput("dn_period 0: delayed Nesterov folds every N >= 1 merges");
  if (!(h.dn_activation >= 0 && h.dn_activation <= 1))
    throw InvalidInput(detail::concat("dn_activation ", h.dn_activation, " is not in [0, 1]"));
  if (!(std::isfinite(h.cgad_decay) && h.cgad_decay >= 0))
    throw InvalidInput(detail::concat("cgad_decay ", h.cgad_decay, " is not >= 0"));
  if (h.cgad_cutoff < 1) throw InvalidInput("cgad_cutoff 0: the cutoff age must be at least 1");
  if (!(h.adam_beta2 >= 0 && h.adam_beta2 < 1))
    throw InvalidInput(detail::concat("adam_beta2 ", h.adam_beta2, " is not in [0, 1)"));
  if (!(std::isfinite(h.adam_epsilon) && h.adam_epsilon > 0))
    throw InvalidInput(detail::concat("adam_epsilon ", h.adam_epsilon, " is not > 0"));
}

namespace {

struct CheckedInputs {
  std::vector<double> weights;  // normalised
  float scale = 1;              // the outer gradient's scale (share, and Cgad's age factor)
};

// Every check of merge_step, before anything is written.
CheckedInputs check_merge(const FragmentState& current, std::span<const MergeInput> inputs, const MergeOptions& options) {
  validate_outer_hyper(options.hyper);
  if (!(options.share > 0.0f && options.share <= 1.0f))
    throw InvalidInput(detail::concat("merge share ", options.share, " is not in (0, 1]"));
  if (!(options.staleness_scale > 0.0f && options.staleness_scale <= 1.0f))
    throw InvalidInput(
        detail::concat("staleness scale ", options.staleness_scale, " is not in (0, 1]"));
  if (!valid_norm_block(options.norm_block))
    throw InvalidInput(detail::concat("norm_block ", options.norm_block, " is neither 0 nor a power of two in [",
                                      kMinNormBlock, ", ", kMaxNormBlock, "]"));
  const auto layout = options.tensors;
  check_tensors(current.params, layout, "state params");
  check_tensors(current.momentum, layout, "state momentum");
  if (has_outer_state(options.optimizer) && !current.outer_state.empty())
    check_tensors(current.outer_state, layout, "state outer_state");
  if (options.downlink.dtype != DType::F32 && !current.downlink_residual.empty())
    check_tensors(current.downlink_residual, layout, "state downlink_residual");

  std::vector<double> raw(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const DeltaRef& ref = inputs[i].ref;
    const std::string what = detail::concat("delta of ", ref.learner_id, " seq ", ref.seq);
    if (ref.base_version > current.version || ref.staleness != current.version - ref.base_version)
      throw InvalidInput(detail::concat(what, ": base version ", ref.base_version, " staleness ",
                                        ref.staleness, " does not fit version ",
                                        current.version));
    check_tensors(inputs[i].tensors, layout, what);
    raw[i] = ref.weight;
  }
  CheckedInputs out{.weights = normalised_weights(raw), .scale = options.share};
  if (options.optimizer == OuterOptimizerKind::Cgad) {
    out.scale = static_cast<float>(static_cast<double>(options.share) *
                                   cgad_age_scale(input_refs(inputs), options.hyper.cgad_decay,
                                                  options.hyper.cgad_cutoff));
  }
  return out;
}

MergeRecord merge_checked(FragmentState& state, std::span<const MergeInput> inputs, const MergeOptions& options,
                          const CheckedInputs& checked) {
  const auto layout = options.tensors;
  const bool keeps_state = has_outer_state(options.optimizer);
  // Another optimizer than the one that stepped the buffers (a run switched, say, from Nesterov
  // to CGAD): its buffers start from zero and its steps are counted from this merge on. Reusing
  // them would make Nesterov's momentum Adam's first moment with no bias correction left, or
  // Delayed Nesterov's accumulated gradients (possibly negative) Adam's second moment.
  if (switches_optimizer(state, options.optimizer)) {
    for (auto& t : state.momentum) std::fill(t.values.begin(), t.values.end(), 0.0f);
    state.outer_state.clear();
    state.optimizer_since = state.version;
  }
  state.optimizer = options.optimizer;
  if (!keeps_state)
    state.outer_state.clear();
  else if (state.outer_state.empty())
    state.outer_state = initial_momentum(state.params);  // zeros
  const bool quantized = options.downlink.dtype != DType::F32;
  if (!quantized)
    state.downlink_residual.clear();
  else if (state.downlink_residual.empty())
    state.downlink_residual = initial_momentum(state.params);  // zeros
  if (options.change) options.change->clear();
  const uint64_t previous_version = state.version;
  state.version = previous_version + 1;

  // One tensor at a time, in place, a range at a time: beyond the state a merge holds a range's
  // aggregate, previous values and what is sent of it per thread, and the weighted directions
  // of an RDA tensor of at most options.kept_aggregate_values (a larger one's are computed again when
  // stepped: TensorAggregate). Within a tensor, ranges of whole downlink blocks go to the
  // pool's threads.
  size_t kept = 0;
  for (const auto& spec : layout)
    if (static_cast<size_t>(spec.numel()) <= options.kept_aggregate_values &&
        tensor_rule(options.rule, spec.name) == MergeRule::RadialDirectional)
      kept = std::max(kept, static_cast<size_t>(spec.numel()));
  std::vector<float> directions(kept);
  std::vector<TensorReader> deltas(inputs.size());
  const MergeWork work{.pool = options.pool, .norm_block = options.norm_block};
  const size_t align = feedback_alignment(options.downlink.dtype, options.downlink.block_size);
  const size_t grain = std::max<size_t>(1, kNormBlock / align) * align;
  for (size_t t = 0; t < layout.size(); ++t) {
    for (size_t i = 0; i < inputs.size(); ++i) deltas[i] = inputs[i].tensors.tensor(t);
    const std::span<float> params(state.params[t].values);
    const size_t n = params.size();
    const TensorAggregate aggregate(tensor_rule(options.rule, layout[t].name), std::span<const TensorReader>(deltas),
                                    checked.weights, work,
                                    n <= kept ? std::span<float>(directions.data(), n) : std::span<float>());
    DILOCO_ENFORCE_EQ(aggregate.size(), n);
    const std::span<float> outer = keeps_state ? std::span<float>(state.outer_state[t].values) : std::span<float>();
    const std::span<float> momentum(state.momentum[t].values);
    QuantizedTensor q;
    if (quantized)
      q = feedback_result(static_cast<uint32_t>(t), layout[t].shape, options.downlink.dtype,
                          options.downlink.block_size);
    for_ranges(options.pool, n, grain, [&](size_t, size_t b, size_t e) {
      const size_t len = e - b;
      const std::span<float> p = params.subspan(b, len);
      // This range's aggregate (then the step's change), previous values, and what is sent.
      thread_local std::vector<float> update, before, sent, scratch;
      update.resize(len);
      aggregate.values(b, e, update);
      if (quantized) before.assign(p.begin(), p.end());
      outer_step(options.optimizer, options.hyper, state.version - state.optimizer_since, p, momentum.subspan(b, len),
                 keeps_state ? outer.subspan(b, len) : std::span<float>(), update, checked.scale);
      if (!quantized) return;
      // The step's change, quantized with the residual; the new version is the previous one
      // plus what is sent.
      for (size_t k = 0; k < len; ++k) update[k] = p[k] - before[k];
      sent.resize(len);
      feedback_range(q, update, state.downlink_residual[t].values, std::span<float>(sent), b, e, scratch,
                     options.downlink.topk);
      apply_update(before, sent, p);
    });
    if (options.change && quantized) options.change->push_back(std::move(q));
  }
  state.checksum = checksum_fp32(state.params);

  MergeRecord record;
  record.run_id = state.run_id;
  record.fingerprint = state.fingerprint;
  record.fragment = state.fragment;
  record.version = state.version;
  record.prev_version = previous_version;
  record.inputs.reserve(inputs.size());
  for (const auto& input : inputs) record.inputs.push_back(input.ref);
  record.rule = options.rule;
  record.optimizer = options.optimizer;
  record.hyper = options.hyper;
  record.checksum = state.checksum;
  record.share = options.share;
  record.staleness_scale = options.staleness_scale;
  record.downlink = options.downlink;
  record.norm_block = options.norm_block;
  return record;
}

}  // namespace

MergeRecord merge_step_in_place(FragmentState& state, std::span<const MergeInput> inputs, const MergeOptions& options) {
  const CheckedInputs checked = check_merge(state, inputs, options);
  return merge_checked(state, inputs, options, checked);
}

MergeRecord merge_step(const FragmentState& current, std::span<const MergeInput> inputs,
                       const MergeOptions& options, FragmentState& next) {
  DILOCO_ENFORCE(&current != &next, "merge_step cannot write the state it reads");
  const CheckedInputs checked = check_merge(current, inputs, options);
  next.run_id = current.run_id;
  next.fingerprint = current.fingerprint;
  next.fragment = current.fragment;
  next.version = current.version;
  copy_tensors(current.params, next.params);
  copy_tensors(current.momentum, next.momentum);
  copy_tensors(current.outer_state, next.outer_state);
  copy_tensors(current.downlink_residual, next.downlink_residual);
  next.consumed = current.consumed;
  next.last_merge = current.last_merge;
  next.accounted = current.accounted;
  next.optimizer = current.optimizer;
  next.optimizer_since = current.optimizer_since;
  return merge_checked(next, inputs, options, checked);
}

MergeOptions recorded_merge_options(const MergeRecord& r, std::span<const TensorSpec> tensors) {
  return MergeOptions{.rule = r.rule, .optimizer = r.optimizer, .hyper = r.hyper, .tensors = tensors,
                      .share = r.share, .staleness_scale = r.staleness_scale, .downlink = r.downlink,
                      .norm_block = r.norm_block};
}

}  // namespace diloco
