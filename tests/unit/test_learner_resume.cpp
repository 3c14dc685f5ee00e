// Where a restarted learner continues (learner/resume.h), and the cut schedule started there.
#include <catch2/catch.hpp>

#include "core/fragments/schedule.h"
#include "learner/resume.h"

using namespace diloco;

namespace {

MemberRecord learner(const std::string& id, int64_t stamp_ms, uint64_t step, Role role = Role::Learner) {
  Member m;
  m.instance_id = id;
  m.role = role;
  m.step = step;
  return MemberRecord{.key = id, .stamp_ms = stamp_ms, .member = m};
}

MemberRecord merger(const std::string& id, int64_t stamp_ms, std::vector<uint32_t> owned, std::vector<uint64_t> versions) {
  Member m;
  m.instance_id = id;
  m.role = Role::Merger;
  m.owned_fragments = std::move(owned);
  m.fragment_versions = std::move(versions);
  return MemberRecord{.key = id, .stamp_ms = stamp_ms, .member = m};
}

}  // namespace

TEST_CASE("a learner new to the run starts at step 0 whatever its peers do", "[learner][resume]") {
  std::vector<MemberRecord> records = {learner("a", 1000, 120), learner("b", 1100, 130), merger("m", 1100, {0}, {7})};
  for (bool sync : {false, true}) {
    ResumePoint r = resume_point("c", records, 15000, sync);
    CHECK_FALSE(r.restarted);
    CHECK(r.step == 0);
  }
  CHECK(resume_point("c", {}, 15000, false).step == 0);
}

TEST_CASE("a restarted learner continues at its own last step, or synchronously one below its slowest live peer",
          "[learner][resume]") {
  std::vector<MemberRecord> records = {
      learner("a", 1000, 40),  learner("b", 1000, 38), learner("eval", 1000, 0, Role::Evaluator),
      learner("a", 30000, 95),  // a's newest announcement
      learner("b", 31000, 96),  learner("c", 31500, 99),
      learner("old", 2000, 3),  // not live: 31.5 s - 2 s > 15 s
      merger("m0", 31000, {0, 2}, {11, 9}), merger("m1", 31200, {1, 3}, {10, 12}),
      merger("m0", 31400, {0, 2}, {12, 9}),  // newer announcement of m0
  };
  ResumePoint r = resume_point("a", records, 15000, false);
  CHECK(r.restarted);
  CHECK(r.step == 95);  // Decoupled: its own last announced step
  CHECK(r.live_peers == 2);  // b and c; not the evaluator, not `old`
  CHECK(r.versions == std::map<uint32_t, uint64_t>{{0, 12}, {1, 10}, {2, 9}, {3, 12}});
  ResumePoint s = resume_point("a", records, 15000, true);
  CHECK(s.step == 95);  // synchronous: one below the slowest live peer (b at 96)
  records.push_back(learner("b", 31600, 200));
  CHECK(resume_point("a", records, 15000, true).step == 98);  // b moved on: the slowest is c at 99
}

TEST_CASE("a tombstone removes an announcement, and a restarted learner with no live peer keeps its own step", "[learner][resume]") {
  std::vector<MemberRecord> records = {learner("a", 1000, 50), learner("b", 1000, 60)};
  records.push_back(MemberRecord{.key = "b", .stamp_ms = 1500, .member = std::nullopt});  // b left
  ResumePoint r = resume_point("a", records, 15000, true);
  CHECK(r.restarted);
  CHECK(r.live_peers == 0);
  CHECK(r.step == 50);
  records.push_back(MemberRecord{.key = "a", .stamp_ms = 1600, .member = std::nullopt});  // a left cleanly
  CHECK_FALSE(resume_point("a", records, 15000, true).restarted);
}

TEST_CASE("a learner that stopped cleanly is no live peer, and continues at the step its last announcement names",
          "[learner][resume]") {
  auto left = [](MemberRecord r) {
    r.member->leaving = true;
    return r;
  };
  std::vector<MemberRecord> records = {learner("a", 1000, 50), learner("b", 1000, 60), learner("c", 1000, 70),
                                       left(learner("a", 2000, 57)),  // a's clean stop, at its real step
                                       left(learner("b", 2100, 61))};
  ResumePoint r = resume_point("a", records, 15000, false);
  CHECK(r.restarted);
  CHECK(r.step == 57);
  CHECK(r.live_peers == 1);  // c; b left although its announcement is recent
  CHECK(resume_point("a", records, 15000, true).step == 69);  // one below c, the only live peer
  records.push_back(learner("b", 2200, 62));  // b restarted: live again
  CHECK(resume_point("a", records, 15000, false).live_peers == 2);
  CHECK(resume_point("a", records, 15000, true).step == 61);
}

TEST_CASE("a cut schedule started after s steps names the same fragments at the same steps as one started at 0",
          "[schedule][resume]") {
  const StreamingSchedule s{.sync_interval = 8, .num_fragments = 4, .offset = 0};
  for (uint64_t start : {0u, 1u, 5u, 8u, 13u, 31u}) {
    INFO("start " << start);
    CutSchedule from_start(s, start);
    for (uint64_t step = start + 1; step <= start + 24; ++step) {
      std::vector<uint32_t> want;
      if (auto p = fragment_due(s, step)) want.push_back(*p);
      CHECK(from_start.due(step) == want);
      for (uint32_t p : from_start.due(step)) from_start.cut(p, step);
    }
  }
}
