// The adaptive grace window: gamma * max(0, tau * step_time - quorum_time - sync_time), capped,
// from moving averages of the learners' step times and the merger's own merge durations.
#include <catch2/catch.hpp>

#include <limits>

#include "core/errors.h"
#include "merger/grace_window.h"

using namespace diloco;

namespace {
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
}  // namespace

TEST_CASE("grace is a share of the slack the overlap leaves", "[merger]") {
  const GraceWindowOptions o;  // gamma 0.5, tau 2, cap 1 step time
  // slack = 2 * 1.0 - 0.3 - 0.2 = 1.5
  CHECK(grace_seconds(o, 1.0, 0.3, 0.2) == Approx(0.75));
  GraceWindowOptions g = o;
  g.gamma = 0.2;
  CHECK(grace_seconds(g, 1.0, 0.3, 0.2) == Approx(0.3));
  g.gamma = 0;
  CHECK(grace_seconds(g, 1.0, 0.3, 0.2) == 0.0);
}

TEST_CASE("grace is 0 when the quorum and the merge use up the slack", "[merger]") {
  const GraceWindowOptions o;
  CHECK(grace_seconds(o, 1.0, 2.0, 0.0) == 0.0);
  CHECK(grace_seconds(o, 1.0, 3.0, 0.5) == 0.0);
  CHECK(grace_seconds(o, 1.0, 0.0, 5.0) == 0.0);
  CHECK(grace_seconds(o, 0.0, 0.0, 0.0) == 0.0);
}

TEST_CASE("grace is capped at cap_step_times step times and at cap_seconds", "[merger]") {
  GraceWindowOptions o;
  o.gamma = 1;
  o.tau = 4;
  CHECK(grace_seconds(o, 1.0, 0.0, 0.0) == 1.0);  // 4 s of slack, capped at one step
  o.cap_step_times = 0.5;
  CHECK(grace_seconds(o, 2.0, 0.0, 0.0) == 1.0);
  o.cap_step_times = 10;
  CHECK(grace_seconds(o, 2.0, 1.0, 1.0) == 6.0);  // under the cap: plain formula
  o.cap_seconds = 0.25;
  CHECK(grace_seconds(o, 2.0, 1.0, 1.0) == 0.25);
  o.cap_seconds = 0;
  CHECK(grace_seconds(o, 2.0, 1.0, 1.0) == 0.0);
}

TEST_CASE("grace window options are validated", "[merger]") {
  CHECK_NOTHROW(validate_grace_window({}));
  auto with = [](auto change) {
    GraceWindowOptions o;
    change(o);
    return o;
  };
  CHECK_THROWS_AS(validate_grace_window(with([](auto& o) { o.gamma = -0.1; })), InvalidInput);
  CHECK_THROWS_AS(validate_grace_window(with([](auto& o) { o.gamma = kNaN; })), InvalidInput);
  CHECK_THROWS_AS(validate_grace_window(with([](auto& o) { o.tau = -1; })), InvalidInput);
  CHECK_THROWS_AS(validate_grace_window(with([](auto& o) { o.cap_step_times = -1; })),
                  InvalidInput);
  CHECK_THROWS_AS(validate_grace_window(with([](auto& o) { o.cap_seconds = kNaN; })),
                  InvalidInput);
  CHECK_THROWS_AS(validate_grace_window(with([](auto& o) { o.smoothing = 0; })), InvalidInput);
  CHECK_THROWS_AS(validate_grace_window(with([](auto& o) { o.smoothing = 1.5; })), InvalidInput);
  CHECK_NOTHROW(validate_grace_window(with([](auto& o) { o.smoothing = 1; })));
  CHECK_THROWS_AS(GraceWindow(with([](auto& o) { o.tau = -1; })), InvalidInput);
}

TEST_CASE("no grace before any step time is known", "[merger]") {
  GraceWindow window;
  CHECK(window.grace(0.0) == 0.0);
  CHECK(window.observe_sync_time(0.1));
  CHECK(window.grace(0.0) == 0.0);
  CHECK(window.observe_step_time(1.0));
  CHECK(window.grace(0.0) == Approx(0.5 * (2.0 - 0.1)));
}

TEST_CASE("step and sync times are exponential moving averages", "[merger]") {
  GraceWindowOptions o;
  o.smoothing = 0.5;
  GraceWindow window(o);
  CHECK(window.observe_step_time(1.0));
  CHECK(window.step_time() == 1.0);  // the first observation starts the average
  CHECK(window.observe_step_time(2.0));
  CHECK(window.step_time() == 1.5);
  CHECK(window.observe_step_time(2.0));
  CHECK(window.step_time() == 1.75);

  CHECK(window.sync_time() == 0.0);
  CHECK(window.observe_sync_time(0.4));
  CHECK(window.sync_time() == Approx(0.4));
  CHECK(window.observe_sync_time(0.0));
  CHECK(window.sync_time() == Approx(0.2));
  // gamma 0.5 * (2 * 1.75 - 0.3 - 0.2) = 1.5, capped at one step time 1.75.
  CHECK(window.grace(0.3) == Approx(1.5));
  CHECK(window.grace(0.0) == Approx(1.65));
  CHECK(window.grace(10.0) == 0.0);
}

TEST_CASE("meaningless time observations are ignored", "[merger]") {
  GraceWindow window;
  CHECK(window.observe_step_time(1.0));
  for (double bad : {0.0, -1.0, kNaN, kInf, -kInf}) CHECK_FALSE(window.observe_step_time(bad));
  CHECK(window.step_time() == 1.0);
  for (double bad : {-0.5, kNaN, kInf}) CHECK_FALSE(window.observe_sync_time(bad));
  CHECK(window.sync_time() == 0.0);
}
