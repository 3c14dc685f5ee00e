// Synchronous DiLoCo by configuration: merger.quorum = number of learners and diloco.wait_steps = 0
// on the same loop. Real broker, one merger and two learner processes: every merge combines both
// learners' deltas on the same base (the schedules meet), and the learners report time waited.
#include <catch2/catch.hpp>

#include "tests/integration/run_fixture.h"

using namespace diloco;
using namespace std::chrono_literals;

TEST_CASE("2 learners with wait_steps 0 and quorum 2: every merge has both, the learners wait", "[learner][sync]") {
  KafkaOptions kafka = testing::require_broker();
  const std::string run = testing::unique_run_id("sync");
  testing::create_run(kafka, run, {"r0"}, 2);
  const std::string dir = testing::temp_dir("sync");
  const std::vector<std::string> sets = {"--set", "run.id=\"" + run + "\"", "--set", "merger.quorum=2",
                                         "--set", "diloco.wait_steps=0", "--set", "diloco.H=8",
                                         "--set", "train.eval_every=0", "--set", "diloco.wait_timeout_seconds=60"};
  testing::run_small_cluster(kafka, dir, sets, 2, 40, 90s);

  size_t merges = 0;
  for (const auto& j : testing::read_json_lines(dir + "/M0/metrics.jsonl")) {
    if (j.value("event", "") != "merge") continue;
    ++merges;
    INFO(j.dump());
    REQUIRE(j["inputs"].size() == 2);
    for (const auto& in : j["inputs"]) CHECK(in["staleness"] == 0);  // both cut on the same base
  }
  // 40 steps, one cut every H / P = 2 steps: 20 rounds, the last one or two may miss the stop.
  CHECK(merges >= 16);
  for (const char* id : {"L0", "L1"}) {
    const std::string metrics = dir + "/" + id + "/metrics.jsonl";
    size_t waits = 0;
    for (const auto& j : testing::read_json_lines(metrics))
      if (j.value("event", "") == "wait") ++waits;
    CHECK(waits >= 16);
    CHECK_FALSE(testing::last_event(metrics, "wait_timeout"));
    auto stop = testing::last_event(metrics, "stop");
    REQUIRE(stop.has_value());
    CHECK(stop->at("wait_seconds").get<double>() > 0);
    CHECK(stop->at("compute_seconds").get<double>() > 0);
    auto step = testing::last_event(metrics, "step");
    REQUIRE(step.has_value());
    CHECK(step->contains("wait_seconds"));
  }
}

TEST_CASE("A synchronous learner whose merge never comes gives up each wait after wait_timeout_seconds and trains on",
          "[learner][sync]") {
  KafkaOptions kafka = testing::require_broker();
  const std::string run = testing::unique_run_id("syncto");
  testing::create_run(kafka, run, {"r0"}, 2);
  const std::string dir = testing::temp_dir("syncto");
  // Quorum 2 with one learner: no merge can happen, so every wait ends by the timeout.
  const double timeout_s = 1.0;
  const int steps = 10;
  const std::vector<std::string> sets = {"--set", "run.id=\"" + run + "\"", "--set", "merger.quorum=2",
                                         "--set", "diloco.wait_steps=0", "--set", "diloco.H=8",
                                         "--set", "train.eval_every=0", "--set",
                                         "diloco.wait_timeout_seconds=" + std::to_string(timeout_s)};
  testing::run_small_cluster(kafka, dir, sets, 1, steps, 90s);

  const std::string metrics = dir + "/L0/metrics.jsonl";
  size_t timeouts = 0, timed_out_waits = 0;
  for (const auto& j : testing::read_json_lines(metrics)) {
    const std::string event = j.value("event", "");
    INFO(j.dump());
    if (event == "wait_timeout") {
      ++timeouts;
      CHECK(j["seconds"].get<double>() >= timeout_s);
    }
    if (event == "wait" && j.value("timed_out", false)) {
      ++timed_out_waits;
      CHECK(j["seconds"].get<double>() >= timeout_s);
      CHECK(j["seconds"].get<double>() < timeout_s + 5);  // gave up, did not hang on
    }
  }
  // One cut every H / P = 2 steps: a wait after each, all given up.
  CHECK(timeouts >= 3);
  CHECK(timed_out_waits == timeouts);
  auto stop = testing::last_event(metrics, "stop");
  REQUIRE(stop.has_value());
  CHECK(stop->at("step").get<uint64_t>() == static_cast<uint64_t>(steps));  // trained to the budget
  CHECK(stop->at("wait_seconds").get<double>() >= timeouts * timeout_s);
  for (const auto& j : testing::read_json_lines(dir + "/M0/metrics.jsonl")) CHECK(j.value("event", "") != "merge");
}
