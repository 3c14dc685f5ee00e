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
