// How much a learner's delta counts in a merge: "quantity times quality" (Decoupled DiLoCo)
// times a staleness discount (our design card):
//   w = tokens * (tokens / inner_steps) * g(s),   g(s) = (1 + s)^(-alpha),
// where the staleness s is the version merged onto minus the delta's base version. A delta of
// 0 inner steps weighs 0. alpha = 0 recovers the paper.
#pragma once

#include <cstdint>
#include <limits>
#include <span>

#include "core/codec/messages.h"

namespace diloco {

// OuterHyper::max_staleness value that accepts any staleness. 0 is not "unlimited": it accepts
// only deltas computed against the current version (staleness 0), as synchronous DiLoCo does.
inline constexpr uint32_t kUnlimitedStaleness = std::numeric_limits<uint32_t>::max();

// g(s) = (1 + s)^(-alpha); 1 when alpha is 0.
double staleness_factor(uint64_t staleness, float staleness_alpha);

// tokens * (tokens / inner_steps) * g(staleness), in double; 0 when inner_steps is 0.
double delta_weight(uint64_t tokens, uint32_t inner_steps, uint64_t staleness,
                    float staleness_alpha);

// The staleness scale of a merge: the mean of g(s_i) over its inputs, weighted by the alpha-free
// weights tokens_i * (tokens_i / inner_steps_i). The weights above only shift a merge towards its
// fresher inputs and are normalised per merge, so alone they leave a single-input merge as it
// is; the merger also multiplies the merge's share (its update) by this scale. In (0, 1]; exactly
// 1 when alpha is 0, and 1 when no input has a positive weight.
double staleness_scale(std::span<const DeltaRef> inputs, float staleness_alpha);

// CGAD's age factor (merger/outer_optimizer.h): exp(-decay * s) * (1 + cos(pi * s / cutoff)) / 2
// below the cutoff age, 0 at and beyond it; 1 at s = 0.
double cgad_age_factor(uint64_t staleness, float decay, uint32_t cutoff);

// The age factor of a merge: cgad_age_factor over its inputs, averaged with the weights of
// staleness_scale. In [0, 1].
double cgad_age_scale(std::span<const DeltaRef> inputs, float decay, uint32_t cutoff);

// Whether a delta this stale must be dropped (TooStale) under `max_staleness`.
bool too_stale(uint64_t staleness, uint32_t max_staleness);

// Fills ref.staleness = version - ref.base_version and ref.weight for a merge onto `version`,
// with hyper.staleness_alpha. The caller checks the base first: throws InternalError if
// ref.base_version > version.
void weigh(DeltaRef& ref, uint64_t version, const OuterHyper& hyper);

}  // namespace diloco
