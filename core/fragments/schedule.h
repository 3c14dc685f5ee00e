// The streaming schedule (Streaming DiLoCo): instead of syncing the whole model every H inner
// steps, a learner syncs one fragment every H/P steps, rotating over the P fragments, so each
// fragment is still synced every H steps but the bytes on the wire are spread evenly over time.
// A learner-specific offset staggers learners so that the merger of a fragment does not receive
// every learner's delta at the same moment.
#pragma once

#include <cstdint>
#include <optional>

namespace diloco {

struct StreamingSchedule {
  uint32_t sync_interval = 0;  // H: inner steps between two syncs of the same fragment
  uint32_t num_fragments = 0;  // P; H must be a multiple of P
  uint32_t offset = 0;         // this learner's stagger, in inner steps
};

// Throws InvalidInput unless P >= 1, H >= 1 and H is a multiple of P.
void validate_schedule(const StreamingSchedule& schedule);

// H / P: inner steps between two consecutive syncs of a learner (of different fragments).
uint32_t fragment_period(const StreamingSchedule& schedule);

// `step` counts the inner steps the learner has completed (1 right after its first step).
// With u = step + offset and period = H / P, a fragment is due iff step > 0 and u % period == 0,
// and it is fragment (u / period - 1) mod P. So with offset 0 fragment 0 is due at step H/P,
// fragment 1 at 2H/P, ..., fragment P-1 at H, fragment 0 again at H + H/P; every fragment is due
// exactly once in any H consecutive steps. At most one fragment is due per step.
std::optional<uint32_t> fragment_due(const StreamingSchedule& schedule, uint64_t step);

// An offset that spreads M learners evenly over one H-step cycle: learner m gets m * H / M, so
// the deltas of one fragment arrive from the learners H / M steps apart rather than together.
uint32_t stagger_offset(uint32_t learner_index, uint32_t num_learners, uint32_t sync_interval);

}  // namespace diloco
