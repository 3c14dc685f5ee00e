// The streaming schedule (Streaming DiLoCo): instead of syncing the whole model every H inner
// steps, a learner syncs one fragment every H/P steps, rotating over the P fragments, so each
// fragment is still synced every H steps but the bytes on the wire are spread evenly over time.
// By default every learner uses offset 0: fragment p is due at steps (p+1)*H/P + k*H of each
// learner's own step count, so the deltas of one fragment from several learners arrive together
// and meet in one merge (DiLoCo's gain comes from averaging them). An optional learner-specific
// offset (diloco.stagger, stagger_offset below) spreads learners over the cycle instead; the
// deltas of one fragment then reach the merger H/M steps apart and rarely share a merge.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace diloco {

struct StreamingSchedule {
  uint32_t sync_interval = 0;  // H: inner steps between two syncs of the same fragment
  uint32_t num_fragments = 0;  // P; H must be a multiple of P
  uint32_t offset = 0;         // this learner's stagger, in inner steps (0 unless diloco.stagger)
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
// Only used with diloco.stagger = true.
uint32_t stagger_offset(uint32_t learner_index, uint32_t num_learners, uint32_t sync_interval);

// The schedule a learner follows: the step at which each fragment is next due. It starts on the
// fixed phase schedule above (the first step at which fragment_due names p) and, after a cut of p
// at step s, regular or early (a cut before an overwrite, diloco.cut_on_arrival), p is next due at
// s + H. Without early cuts, due() names exactly the fragment fragment_due names, step by step.
class CutSchedule {
 public:
  // Starting after `start_step` inner steps (a learner resuming a run, learner/resume.h): each
  // fragment is next due at the first step above start_step at which fragment_due names it.
  explicit CutSchedule(const StreamingSchedule& schedule, uint64_t start_step = 0);

  // The fragments whose next due step is at or before `step`, lowest first (several only after
  // early cuts moved two fragments onto the same step).
  std::vector<uint32_t> due(uint64_t step) const;
  // Fragment p was cut at `step`: it is next due H steps later.
  void cut(uint32_t p, uint64_t step);
  uint64_t next_due(uint32_t p) const { return next_due_.at(p); }

 private:
  uint32_t sync_interval_;
  std::vector<uint64_t> next_due_;
};

}  // namespace diloco
