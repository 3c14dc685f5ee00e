// How much a learner's delta counts in a merge: "quantity times quality" (Decoupled DiLoCo)
// times a staleness discount (our design card):
//   w = tokens * (tokens / inner_steps) * g(s),   g(s) = (1 + s)^(-alpha),
// where the staleness s is the version merged onto minus the delta's base version. A delta of
// 0 inner steps weighs 0. alpha = 0 recovers the paper.
#pragma once

#include <cstdint>
#include <limits>

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

// Whether a delta this stale must be dropped (TooStale) under `max_staleness`.
bool too_stale(uint64_t staleness, uint32_t max_staleness);

// Fills ref.staleness = version - ref.base_version and ref.weight for a merge onto `version`,
// with hyper.staleness_alpha. The caller checks the base first: throws InternalError if
// ref.base_version > version.
void weigh(DeltaRef& ref, uint64_t version, const OuterHyper& hyper);

}  // namespace diloco
