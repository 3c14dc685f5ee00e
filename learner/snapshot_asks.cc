#include "learner/snapshot_asks.h"

#include <algorithm>

namespace diloco {

SnapshotAsks::SnapshotAsks(std::chrono::duration<double> first_interval, std::chrono::duration<double> max_interval)
    : first_(first_interval), max_(std::max(first_interval, max_interval)) {}

std::chrono::duration<double> SnapshotAsks::wait(uint32_t p) const {
  const auto it = asks_.find(p);
  if (it == asks_.end()) return std::chrono::duration<double>(0);
  auto interval = first_;
  for (uint32_t i = 1; i < it->second.count && interval < max_; ++i) interval *= 2;
  return std::min(interval, max_);
}

bool SnapshotAsks::due(uint32_t p, Clock::time_point now) const {
  const auto it = asks_.find(p);
  return it == asks_.end() || now - it->second.at >= wait(p);
}

void SnapshotAsks::asked(uint32_t p, Clock::time_point now) {
  auto& a = asks_[p];
  a.at = now;
  ++a.count;
}

}  // namespace diloco
