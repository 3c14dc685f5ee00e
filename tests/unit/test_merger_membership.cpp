// Liveness on the broker's clock: stamps, the newest stamp as "now", tombstones.
#include <catch2/catch.hpp>

#include "merger/membership.h"

using namespace diloco;

namespace {

Member member(const std::string& id, Role role, int64_t own_clock_us, float step_time = 0.5f) {
  Member m;
  m.instance_id = id;
  m.role = role;
  m.time_us = own_clock_us;
  m.step_time_s = step_time;
  return m;
}

}  // namespace

TEST_CASE("membership judges liveness by broker stamps, not by the learners' clocks", "[merger]") {
  Membership m(15);
  // Learner a's own clock is an hour behind, b's a day ahead: neither matters.
  CHECK(m.observe("a", 1'000'000, member("a", Role::Learner, 1)) == 0.5f);
  CHECK(m.observe("b", 1'005'000, member("b", Role::Learner, int64_t{1} << 60)) == 0.5f);
  CHECK(m.live_learners() == std::vector<std::string>{"a", "b"});
  CHECK(m.now_us() == 1'005'000'000);

  // A merger's announcement moves "now" on but is not a learner.
  CHECK_FALSE(m.observe("M0", 1'016'500, member("M0", Role::Merger, 0)));
  CHECK(m.live_learners() == std::vector<std::string>{"b"});  // a was heard 16.5 s ago, b 11.5 s

  // A heartbeat read late (its stamp is old) says the learner was alive then, no more.
  CHECK_FALSE(m.observe("c", 1'000'500, member("c", Role::Learner, 0)));
  CHECK(m.live_learners() == std::vector<std::string>{"b"});

  // A tombstone removes the learner at once.
  CHECK_FALSE(m.observe("b", 1'017'000, std::nullopt));
  CHECK(m.live_learners().empty());
  CHECK(m.observe("a", 1'017'100, member("a", Role::Learner, 0, 0.25f)) == 0.25f);
  CHECK(m.live_learners() == std::vector<std::string>{"a"});
}

TEST_CASE("a learner's last announcement of a clean stop removes it at once; a restart brings it back", "[merger]") {
  Membership m(15);
  CHECK(m.observe("a", 1'000'000, member("a", Role::Learner, 0)) == 0.5f);
  CHECK(m.observe("b", 1'000'100, member("b", Role::Learner, 0)) == 0.5f);
  Member leaving = member("a", Role::Learner, 0);
  leaving.leaving = true;
  CHECK_FALSE(m.observe("a", 1'000'200, leaving));  // its step time says nothing about a round
  CHECK(m.live_learners() == std::vector<std::string>{"b"});
  CHECK(m.observe("a", 1'003'000, member("a", Role::Learner, 0, 0.75f)) == 0.75f);
  CHECK(m.live_learners() == std::vector<std::string>{"a", "b"});
}

TEST_CASE("membership keeps each learner's newest declared batch and context, past its leaving", "[merger]") {
  Membership m(15);
  Member a = member("a", Role::Learner, 0);
  m.observe("a", 1'000'000, a);  // an older binary: declares nothing
  CHECK_FALSE(m.declared("a"));
  a.batch = 8;
  a.context = 128;
  m.observe("a", 1'001'000, a);
  REQUIRE(m.declared("a"));
  CHECK(m.declared("a")->tokens_per_step() == 1024);
  Member b = member("b", Role::Learner, 0);
  b.batch = 64;
  b.context = 128;
  m.observe("b", 1'001'100, b);
  CHECK(m.declared("b")->batch == 64);
  CHECK(m.declared("a")->batch == 8);
  // A restart with another batch: the newest counts.
  a.batch = 16;
  m.observe("a", 1'002'000, a);
  CHECK(m.declared("a")->batch == 16);
  // Leaving keeps the declaration (deltas sent before the stop may still come); a tombstone too.
  a.leaving = true;
  m.observe("a", 1'003'000, a);
  m.observe("b", 1'003'100, std::nullopt);
  CHECK(m.declared("a")->batch == 16);
  CHECK(m.declared("b")->batch == 64);
  // A merger's announcement declares nothing of a learner.
  Member merger = member("M0", Role::Merger, 0);
  merger.batch = 1;
  merger.context = 1;
  m.observe("M0", 1'003'200, merger);
  CHECK_FALSE(m.declared("M0"));
}

TEST_CASE("a learner of some fragments is live for those alone", "[merger]") {
  Membership m(15);
  Member some = member("some", Role::Learner, 0);
  some.owned_fragments = {2, 3};
  Member all = member("all", Role::Learner, 0);
  all.owned_fragments = {0, 1, 2, 3};
  Member unlisted = member("old", Role::Learner, 0);  // lists no fragment: counts for every one
  m.observe("some", 1'000'000, some);
  m.observe("all", 1'000'000, all);
  m.observe("old", 1'000'000, unlisted);
  CHECK(m.live_learners() == std::vector<std::string>{"all", "old", "some"});
  CHECK(m.live_learners(0) == std::vector<std::string>{"all", "old"});
  CHECK(m.live_learners(3) == std::vector<std::string>{"all", "old", "some"});
  // Its next heartbeat lists other fragments: those count from then on.
  some.owned_fragments = {0};
  m.observe("some", 1'001'000, some);
  CHECK(m.live_learners(0) == std::vector<std::string>{"all", "old", "some"});
  CHECK(m.live_learners(3) == std::vector<std::string>{"all", "old"});
  // Gone (a tombstone): live for none.
  m.observe("some", 1'002'000, std::nullopt);
  CHECK(m.live_learners(0) == std::vector<std::string>{"all", "old"});
}
