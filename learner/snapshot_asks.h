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
#include <optional>
#include <vector>

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

// When a fragment that lags behind the version its merger announces counts as stalled, so that a
// snapshot is asked for. Behind is not enough: on a slow or congested link the announcements (small
// Kafka records) arrive seconds before the updates they announce (queued behind other bytes on the
// same link), yet the updates still come, in order. Asking for a snapshot then makes it worse: a
// whole fragment joins the queue, the next updates arrive later still, and each ask brings the next
// (a link of 2.86 Mbit/s restored after a cut stayed saturated by snapshots to the end of the run).
// So a fragment is stalled when it is behind and no usable version of it arrived for
//     clamp(lag_factor x lag, delay, max)
// where lag is a moving average of how long the recent versions took from their first
// announcement to their arrival (0 for one that arrived before it was announced). A version lost
// for good (nothing after it to show the gap) is asked for after `delay` on a quick link, and
// after at most `max` however slow the link looked. Until a first version arrived the lag is
// unknown: a fragment of which a version is held (updates will apply to it) then waits `max`,
// one of which none is held `delay`. Pure: the caller passes the clock.
class StallClock {
 public:
  using Clock = std::chrono::steady_clock;

  StallClock(std::chrono::duration<double> delay, std::chrono::duration<double> max, double lag_factor = 2.0);

  // A merger announced `version` of p (each announcement, also repeats).
  void announced(uint32_t p, uint64_t version, Clock::time_point now);
  // A usable `version` of p arrived (an update applied, or a snapshot): progress.
  void arrived(uint32_t p, uint64_t version, Clock::time_point now);
  // The fragments some merger announced.
  std::vector<uint32_t> fragments() const;
  // Whether p, of which `held` is held (nullopt: none), is behind its newest announcement.
  bool behind(uint32_t p, std::optional<uint64_t> held) const;
  // Whether p is behind and made no progress for threshold(p).
  bool stalled(uint32_t p, std::optional<uint64_t> held, Clock::time_point now) const;
  // How long p may make no progress before it counts as stalled; `holding`: some version of p is held.
  std::chrono::duration<double> threshold(uint32_t p, bool holding = false) const;

 private:
  struct Track {
    bool any = false;  // some version was announced
    uint64_t announced = 0;
    std::map<uint64_t, Clock::time_point> first_seen;  // announced versions not yet arrived
    std::optional<Clock::time_point> progress;         // the last arrival, or when it fell behind
    double lag_s = 0;                                  // moving average
    bool measured = false;                             // some version arrived
  };
  std::chrono::duration<double> delay_, max_;
  double lag_factor_;
  std::map<uint32_t, Track> tracks_;
};

}  // namespace diloco
