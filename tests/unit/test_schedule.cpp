// Streaming schedule: one fragment every H/P inner steps, each fragment every H steps.
#include <catch2/catch.hpp>

#include <map>

#include "core/errors.h"
#include "core/fragments/schedule.h"

using namespace diloco;

TEST_CASE("with offset 0 fragments come in order, one every H/P steps", "[schedule]") {
  const StreamingSchedule s{.sync_interval = 12, .num_fragments = 4, .offset = 0};
  REQUIRE(fragment_period(s) == 3);
  CHECK_FALSE(fragment_due(s, 0));
  CHECK_FALSE(fragment_due(s, 1));
  CHECK_FALSE(fragment_due(s, 2));
  CHECK(fragment_due(s, 3) == 0u);
  CHECK(fragment_due(s, 6) == 1u);
  CHECK(fragment_due(s, 9) == 2u);
  CHECK(fragment_due(s, 12) == 3u);
  CHECK(fragment_due(s, 15) == 0u);
}

TEST_CASE("every fragment is due exactly once in any H consecutive steps", "[schedule]") {
  for (uint32_t H : {1u, 4u, 12u, 24u}) {
    for (uint32_t P : {1u, 2u, 4u, 12u, 24u}) {
      if (P > H || H % P != 0) continue;
      for (uint32_t offset : {0u, 1u, 5u, H - 1, 3 * H + 2}) {
        const StreamingSchedule s{H, P, offset};
        for (uint64_t start = 1; start < 3ull * H; start += 7) {
          std::map<uint32_t, int> due;
          for (uint64_t t = start; t < start + H; ++t)
            if (auto p = fragment_due(s, t)) {
              REQUIRE(*p < P);
              ++due[*p];
            }
          REQUIRE(due.size() == P);
          for (const auto& [p, n] : due) REQUIRE(n == 1);
        }
        // The same fragment comes back exactly H steps later.
        for (uint64_t t = 1; t < 2ull * H; ++t)
          REQUIRE(fragment_due(s, t) == fragment_due(s, t + H));
      }
    }
  }
}

TEST_CASE("the offset shifts when a learner syncs", "[schedule]") {
  const StreamingSchedule a{12, 4, 0}, b{12, 4, 1};
  CHECK(fragment_due(a, 3) == 0u);
  CHECK_FALSE(fragment_due(b, 3));
  CHECK(fragment_due(b, 2) == 0u);
  CHECK(fragment_due(b, 5) == 1u);
}

TEST_CASE("stagger offsets spread learners over one H cycle", "[schedule]") {
  CHECK(stagger_offset(0, 4, 24) == 0u);
  CHECK(stagger_offset(1, 4, 24) == 6u);
  CHECK(stagger_offset(3, 4, 24) == 18u);
  CHECK(stagger_offset(2, 3, 10) == 6u);
  CHECK_THROWS_AS(stagger_offset(4, 4, 24), InvalidInput);
  CHECK_THROWS_AS(stagger_offset(0, 0, 24), InvalidInput);
}

TEST_CASE("H must be a positive multiple of P", "[schedule]") {
  CHECK_THROWS_AS(fragment_due(StreamingSchedule{10, 4, 0}, 5), InvalidInput);
  CHECK_THROWS_AS(fragment_due(StreamingSchedule{10, 0, 0}, 5), InvalidInput);
  CHECK_THROWS_AS(fragment_due(StreamingSchedule{0, 1, 0}, 5), InvalidInput);
  CHECK_THROWS_AS(validate_schedule(StreamingSchedule{2, 4, 0}), InvalidInput);
  CHECK_NOTHROW(validate_schedule(StreamingSchedule{24, 24, 0}));
}
