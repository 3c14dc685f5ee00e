// When a subscriber asks again for a snapshot it still lacks. The first ask goes at once; while
// the fragment stays missing, each further ask waits twice as long as the one before
// (first_interval, 2x, 4x, ... up to max_interval), and a usable version of the fragment resets
// it. A large snapshot takes longer to arrive and decode than a fixed retry interval, and when
// its fragment moves to another merger meanwhile, the new owner cannot know the old one already
// sent it: without the back-off each retry could make it travel again. Pure: the caller passes
// the clock.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>

namespace diloco {

class SnapshotAsks {
 public:
  using Clock = std::chrono::steady_clock;

  SnapshotAsks(std::chrono::duration<double> first_interval, std::chrono::duration<double> max_interval);

  // Whether fragment p may be asked for at `now`.
  bool due(uint32_t p, Clock::time_point now) const;
  // p was asked for at `now`.
  void asked(uint32_t p, Clock::time_point now);
  // A usable version of p arrived: the next gap is asked for at once.
  void satisfied(uint32_t p) { asks_.erase(p); }
  // How long after the last ask the next one may go (0 before the first).
  std::chrono::duration<double> wait(uint32_t p) const;

 private:
  struct Ask {
    Clock::time_point at;
    uint32_t count = 0;
  };
  std::chrono::duration<double> first_, max_;
  std::map<uint32_t, Ask> asks_;
};

}  // namespace diloco
