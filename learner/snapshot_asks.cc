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

StallClock::StallClock(std::chrono::duration<double> delay, std::chrono::duration<double> max, double lag_factor)
    : delay_(delay), max_(std::max(delay, max)), lag_factor_(lag_factor) {}

void StallClock::announced(uint32_t p, uint64_t version, Clock::time_point now) {
  auto& t = tracks_[p];
  if (t.any && version <= t.announced) return;
  t.any = true;
  t.announced = version;
  t.first_seen.emplace(version, now);
  // Announcements of versions that never arrive one by one (a snapshot skips them) are bounded.
  while (t.first_seen.size() > 64) t.first_seen.erase(t.first_seen.begin());
}

void StallClock::arrived(uint32_t p, uint64_t version, Clock::time_point now) {
  auto& t = tracks_[p];
  // The first announcement of this version or a newer one: how long it took to come.
  double lag = 0;
  if (auto it = t.first_seen.lower_bound(version); it != t.first_seen.end())
    lag = std::max(0.0, std::chrono::duration<double>(now - it->second).count());
  t.first_seen.erase(t.first_seen.begin(), t.first_seen.upper_bound(version));
  constexpr double kWeight = 0.25;  // of the newest lag in the average
  t.lag_s = t.measured ? t.lag_s + kWeight * (lag - t.lag_s) : lag;
  t.measured = true;
  t.progress = now;
}

std::chrono::duration<double> StallClock::threshold(uint32_t p, bool holding) const {
  const auto it = tracks_.find(p);
  // Holding a version but no arrival measured yet: how long this link and this fragment's updates
  // take is unknown, so the cap applies (a fragment of hundreds of millions of parameters takes
  // seconds to be encoded, sent and decoded: asking sooner sends a whole snapshot in vain). With
  // nothing held no update can help: the delay.
  if (holding && (it == tracks_.end() || !it->second.measured)) return max_;
  const std::chrono::duration<double> lag(it == tracks_.end() ? 0.0 : lag_factor_ * it->second.lag_s);
  return std::clamp(lag, delay_, max_);
}

std::vector<uint32_t> StallClock::fragments() const {
  std::vector<uint32_t> out;
  for (const auto& [p, t] : tracks_)
    if (t.any) out.push_back(p);
  return out;
}

bool StallClock::behind(uint32_t p, std::optional<uint64_t> held) const {
  const auto it = tracks_.find(p);
  return it != tracks_.end() && it->second.any && (!held || *held < it->second.announced);
}

bool StallClock::stalled(uint32_t p, std::optional<uint64_t> held, Clock::time_point now) const {
  if (!behind(p, held)) return false;
  const auto it = tracks_.find(p);
  // Behind since the oldest announcement of a version above the one held (a version held from the
  // start never arrives, yet was announced), or since the last progress if later.
  const auto& seen = it->second.first_seen;
  const auto first = held ? seen.upper_bound(*held) : seen.begin();
  if (first == seen.end()) return false;  // not when behind: the newest stays until it arrives
  auto since = first->second;
  if (it->second.progress && *it->second.progress > since) since = *it->second.progress;
  return now - since >= threshold(p, held.has_value());
}

}  // namespace diloco
