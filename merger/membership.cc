#include "merger/membership.h"

#include <algorithm>

namespace diloco {

Membership::Membership(double liveness_seconds) : window_us_(static_cast<int64_t>(liveness_seconds * 1e6)) {}

std::optional<float> Membership::observe(const std::string& key, int64_t stamp_ms, const std::optional<Member>& member) {
  const int64_t stamp_us = stamp_ms * 1000;
  now_us_ = std::max(now_us_, stamp_us);
  if (member && member->role == Role::Learner && member->batch > 0 && member->context > 0)
    declared_[member->instance_id] = DeclaredBatch{.batch = member->batch, .context = member->context};
  // A tombstone, or the last announcement of a clean stop: the learner left.
  if (!member || member->leaving) {
    heard_.erase(member ? member->instance_id : key);
    trains_.erase(member ? member->instance_id : key);
    return std::nullopt;
  }
  if (member->role != Role::Learner) return std::nullopt;
  heard_[member->instance_id] = stamp_us;
  trains_[member->instance_id] = member->owned_fragments;
  if (now_us_ - stamp_us < window_us_) return member->step_time_s;
  return std::nullopt;
}

std::vector<std::string> Membership::live_learners() const {
  std::vector<std::string> out;
  for (const auto& [id, stamp] : heard_)
    if (stamp >= now_us_ - window_us_) out.push_back(id);
  return out;
}

std::vector<std::string> Membership::live_learners(uint32_t fragment) const {
  std::vector<std::string> out;
  for (const auto& id : live_learners()) {
    const auto it = trains_.find(id);
    if (it == trains_.end() || it->second.empty() ||
        std::find(it->second.begin(), it->second.end(), fragment) != it->second.end())
      out.push_back(id);
  }
  return out;
}

std::optional<DeclaredBatch> Membership::declared(const std::string& learner) const {
  auto it = declared_.find(learner);
  if (it == declared_.end()) return std::nullopt;
  return it->second;
}

}  // namespace diloco
