// A subscriber's repeated asks for a missing snapshot back off (learner/snapshot_asks.h): at once,
// then after 1, 2, 4, ... intervals up to the cap; a usable version resets the fragment; fragments
// are independent.
#include <catch2/catch.hpp>

#include "learner/snapshot_asks.h"

using namespace diloco;
using namespace std::chrono_literals;

TEST_CASE("asks for a missing snapshot wait twice as long each time, up to the cap", "[learner][snapshots]") {
  SnapshotAsks asks(1s, 8s);
  const SnapshotAsks::Clock::time_point t0{};
  CHECK(asks.due(0, t0));
  CHECK(asks.wait(0) == 0s);
  asks.asked(0, t0);
  CHECK_FALSE(asks.due(0, t0 + 999ms));
  CHECK(asks.due(0, t0 + 1s));
  // Ask whenever allowed: the gaps are 1, 2, 4, 8, 8 s.
  auto t = t0;
  std::vector<double> gaps;
  for (int i = 0; i < 5; ++i) {
    const auto wait = std::chrono::duration_cast<SnapshotAsks::Clock::duration>(asks.wait(0));
    CHECK_FALSE(asks.due(0, t + wait - 1ms));
    CHECK(asks.due(0, t + wait));
    gaps.push_back(std::chrono::duration<double>(wait).count());
    t += wait;
    asks.asked(0, t);
  }
  CHECK(gaps == std::vector<double>{1, 2, 4, 8, 8});

  // Another fragment is not held back by fragment 0's asks.
  CHECK(asks.due(1, t));
  // A usable version of fragment 0 arrived: its next gap is asked for at once, then after 1 s.
  asks.satisfied(0);
  CHECK(asks.due(0, t));
  asks.asked(0, t);
  CHECK(asks.wait(0) == 1s);
}

TEST_CASE("a cap below the first interval is the first interval", "[learner][snapshots]") {
  SnapshotAsks asks(2s, 1s);
  asks.asked(3, {});
  asks.asked(3, {});
  CHECK(asks.wait(3) == 2s);
}

// StallClock: behind the announced version is not stalled while versions still arrive; a version
// lost for good is.
TEST_CASE("a version announced and never arriving stalls after the delay on a quick link", "[learner][snapshots]") {
  StallClock stall(500ms, 16s);
  const StallClock::Clock::time_point t0{};
  CHECK_FALSE(stall.stalled(0, std::nullopt, t0));  // nothing announced
  // Versions 1..5 arrive 10 ms after their announcement: a quick link.
  auto t = t0;
  for (uint64_t v = 1; v <= 5; ++v) {
    stall.announced(0, v, t);
    stall.arrived(0, v, t + 10ms);
    t += 1s;
  }
  CHECK(stall.threshold(0) == 500ms);
  CHECK_FALSE(stall.stalled(0, 5, t));
  // Version 6 is announced and lost (no later update shows the gap).
  stall.announced(0, 6, t);
  CHECK_FALSE(stall.stalled(0, 5, t + 499ms));
  CHECK(stall.stalled(0, 5, t + 500ms));
  // Holding the announced version (or newer) is never stalled.
  CHECK_FALSE(stall.stalled(0, 6, t + 10s));
  CHECK_FALSE(stall.stalled(0, 7, t + 10s));
}

TEST_CASE("a congested link whose updates lag their announcements by seconds does not stall", "[learner][snapshots]") {
  StallClock stall(500ms, 16s);
  const StallClock::Clock::time_point t0{};
  // A version a second; each arrives 3 s after its announcement, so the learner is always about
  // three versions behind, and the newest usable arrival is never more than 1 s old.
  bool ever = false;
  for (int ms = 0; ms <= 60000; ms += 50) {
    const auto now = t0 + std::chrono::milliseconds(ms);
    if (ms % 1000 == 0) stall.announced(0, 1 + ms / 1000, now);
    std::optional<uint64_t> held;
    if (ms >= 3000) {
      const uint64_t v = 1 + (ms - 3000) / 1000;
      if ((ms - 3000) % 1000 == 0) stall.arrived(0, v, now);
      held = v;
    }
    // Before the first arrival (held: version 0, from the `state` topic) the link's lag is
    // unknown: the cap applies, not the delay (a large fragment's first update takes seconds to
    // be encoded, sent and decoded, and a snapshot asked for meanwhile travels in vain).
    ever = ever || stall.stalled(0, held.value_or(0), now);
  }
  CHECK_FALSE(ever);
  CHECK(stall.threshold(0) > 5s);  // about 2 x 3 s once the average settled
  CHECK(stall.threshold(0) <= 6s);
  // The stream stops (the merger's last update lost): stalled once no version came for the threshold.
  const auto end = t0 + 60s;
  stall.announced(0, 62, end + 1s);
  CHECK_FALSE(stall.stalled(0, 58, end + 1s + std::chrono::duration_cast<StallClock::Clock::duration>(stall.threshold(0) / 2)));
  CHECK(stall.stalled(0, 58, end + 1s + std::chrono::duration_cast<StallClock::Clock::duration>(stall.threshold(0))));
}

TEST_CASE("a version held from the start and announced is not a gap: the wait for the next starts at its announcement",
          "[learner][snapshots]") {
  StallClock stall(500ms, 16s);
  const StallClock::Clock::time_point t0{};
  // Version 0 is held from the `state` topic (it never arrives as an update) and announced at t0.
  stall.announced(0, 0, t0);
  CHECK_FALSE(stall.stalled(0, 0, t0 + 60s));
  // A minute later version 1 is announced: the wait for it starts now, not at version 0's
  // announcement.
  stall.announced(0, 1, t0 + 60s);
  CHECK_FALSE(stall.stalled(0, 0, t0 + 61s));
  CHECK_FALSE(stall.stalled(0, 0, t0 + 75s));
  CHECK(stall.stalled(0, 0, t0 + 76s));  // the cap: no arrival has shown this link's lag yet
}

TEST_CASE("however slow the link looked, a stall is asked for after at most the cap", "[learner][snapshots]") {
  StallClock stall(500ms, 4s);
  const StallClock::Clock::time_point t0{};
  stall.announced(1, 1, t0);
  stall.arrived(1, 1, t0 + 60s);  // a minute late (a cut link)
  stall.announced(1, 2, t0 + 60s);
  CHECK(stall.threshold(1) == 4s);
  CHECK_FALSE(stall.stalled(1, 1, t0 + 63s));
  CHECK(stall.stalled(1, 1, t0 + 64s));
  // A fragment never held whose version 0 is announced stalls after the delay.
  stall.announced(2, 0, t0);
  CHECK(stall.stalled(2, std::nullopt, t0 + 500ms));
  CHECK_FALSE(stall.stalled(2, 0, t0 + 10s));
}
