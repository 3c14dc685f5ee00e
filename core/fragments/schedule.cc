#include "core/fragments/schedule.h"

#include "core/errors.h"

namespace diloco {

void validate_schedule(const StreamingSchedule& s) {
  if (s.num_fragments == 0 || s.sync_interval == 0 || s.sync_interval % s.num_fragments != 0)
    throw InvalidInput(detail::concat("streaming schedule: H (", s.sync_interval,
                                      ") must be a positive multiple of the number of fragments (",
                                      s.num_fragments, ")"));
}

uint32_t fragment_period(const StreamingSchedule& s) {
  validate_schedule(s);
  return s.sync_interval / s.num_fragments;
}

std::optional<uint32_t> fragment_due(const StreamingSchedule& s, uint64_t step) {
  const uint64_t period = fragment_period(s);
  const uint64_t u = step + s.offset;
  if (step == 0 || u % period != 0) return std::nullopt;
  return static_cast<uint32_t>((u / period - 1) % s.num_fragments);
}

uint32_t stagger_offset(uint32_t learner_index, uint32_t num_learners, uint32_t sync_interval) {
  if (num_learners == 0 || learner_index >= num_learners)
    throw InvalidInput(detail::concat("stagger offset: learner index ", learner_index,
                                      " is not below the number of learners ", num_learners));
  return static_cast<uint32_t>(uint64_t{learner_index} * sync_interval / num_learners);
}

CutSchedule::CutSchedule(const StreamingSchedule& s, uint64_t start_step)
    : sync_interval_(s.sync_interval), next_due_(s.num_fragments, 0) {
  validate_schedule(s);
  // Every fragment is due exactly once in any H consecutive steps.
  for (uint64_t step = start_step + 1; step <= start_step + s.sync_interval; ++step)
    if (auto p = fragment_due(s, step)) next_due_[*p] = step;
}

std::vector<uint32_t> CutSchedule::due(uint64_t step) const {
  std::vector<uint32_t> out;
  for (uint32_t p = 0; p < next_due_.size(); ++p)
    if (next_due_[p] <= step) out.push_back(p);
  return out;
}

void CutSchedule::cut(uint32_t p, uint64_t step) { next_due_.at(p) = step + sync_interval_; }

}  // namespace diloco
