// A run that ages: its `members` topic holds the heartbeats of every process that ever took part
// (compaction only runs on closed segments, and the newest ones are not compacted yet). A learner
// starting and a merger recovering must not read through all of them: they start following the
// topic at its recent tail. Two runs in one test, one fresh and one whose `members` already holds
// 100,000 records, each timed from the process's start: a learner to its first inner step, a
// merger restarted on a running fragment to having recovered and read `members` up to its end.
#include <catch2/catch.hpp>

#include <csignal>
#include <thread>

#include "core/kafka/producer.h"
#include "tests/integration/child_process.h"
#include "tests/integration/run_fixture.h"

using namespace diloco;
using namespace std::chrono_literals;

namespace {

using Clock = std::chrono::steady_clock;

// 100,000 heartbeats of 1,000 learners that have left (each key ends with a tombstone), as a run
// of 1,000 learners writes in under two minutes (one heartbeat every 2 s each).
void fill_members(const testing::TinyRun& r, size_t records) {
  const size_t keys = 1000;
  Producer producer({.kafka = r.kafka}, nullptr);
  for (size_t i = 0; i < records; ++i) {
    const std::string key = "gone-" + std::to_string(i % keys);
    const bool last = i + keys >= records;
    std::vector<uint8_t> value;
    if (!last) {
      Member m{.run_id = r.run, .instance_id = key, .role = Role::Learner, .region = "r0",
               .time_us = static_cast<int64_t>(i), .step = i / keys, .batch = 4, .context = 64};
      value = encode_member(m);
    }
    producer.produce({.topic = r.topics.members(), .partition = 0, .key = key, .value = value}, 0, 60000);
  }
  REQUIRE(producer.flush(120000) == 0);
}

struct Timing {
  double learner_start = 0;     // spawn -> first inner step
  double merger_recovery = 0;   // spawn -> recovered and `members` read to its end
};

double seconds_until(Clock::time_point t0, const std::function<bool()>& condition) {
  REQUIRE(testing::eventually(condition, 180s));
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

Timing time_run(testing::TinyRun& r) {
  auto merger = testing::start_merger(r.kafka, r.dir, "M0", r.sets);
  std::vector<std::string> args = {testing::learner_binary(), "-c", testing::tiny_config_path(), "--id", "L0", "--region", "r0", "--regions", "r0",
                                   "--bootstrap", r.kafka.bootstrap_servers, "--steps", "100000",
                                   "--run-dir", r.dir + "/L0", "--log-every", "1"};
  args.insert(args.end(), r.sets.begin(), r.sets.end());
  Timing t;
  const auto spawned = Clock::now();
  testing::ChildProcess learner(args, r.dir + "/L0.log");
  t.learner_start = seconds_until(spawned, [&] { return testing::last_event(r.dir + "/L0/metrics.jsonl", "step").has_value(); });
  INFO(learner.log());
  const auto learner_read = testing::last_event(r.dir + "/L0/metrics.jsonl", "members_read");
  REQUIRE(learner_read.has_value());
  CHECK(learner_read->value("records", uint64_t{0}) < 10000);  // decoded: the tail, not the 100,000
  // A merge of each fragment, then the merger restarts on it.
  REQUIRE(testing::eventually([&] {
    size_t merges = 0;
    for (const auto& j : testing::read_json_lines(r.dir + "/M0/metrics.jsonl")) merges += j.value("event", "") == "merge";
    return merges >= 2;
  }, 120s));
  merger->signal(SIGTERM);
  REQUIRE(merger->wait_exit(60s) == std::optional<int>(0));
  const auto restarted = Clock::now();
  merger = testing::start_merger(r.kafka, r.dir, "M0", r.sets, "M0b");
  const std::string log = r.dir + "/M0b/metrics.jsonl";
  t.merger_recovery = seconds_until(restarted, [&] {
    return testing::last_event(log, "recovered").has_value() && testing::last_event(log, "members_read").has_value();
  });
  const auto read = testing::last_event(log, "members_read");
  INFO(merger->log());
  CHECK(read->value("records", uint64_t{0}) < 10000);  // the tail, not the 100,000
  learner.signal(SIGTERM);
  CHECK(learner.wait_exit(60s) == std::optional<int>(0));
  merger->signal(SIGTERM);
  CHECK(merger->wait_exit(60s) == std::optional<int>(0));
  return t;
}

}  // namespace

TEST_CASE("with 100,000 records in members a learner starts and a merger recovers as fast as on a fresh run",
          "[members][aging]") {
  // members.lookback_seconds: the tail a process reads (every live process heartbeats within it).
  const std::vector<std::string> sets = {"train.eval_every=0", "diloco.H=4", "merger.liveness_seconds=4",
                                         "merger.members_lookback_seconds=5"};
  testing::TinyRun fresh("fresh", sets);
  testing::TinyRun aged("aged", sets);
  fill_members(aged, 100000);
  std::this_thread::sleep_for(6s);  // the filled records are older than the lookback
  const Timing a = time_run(fresh);
  const Timing b = time_run(aged);
  WARN("fresh: learner start " << a.learner_start << " s, merger recovery " << a.merger_recovery
       << " s; 100,000 members records: " << b.learner_start << " s, " << b.merger_recovery << " s");
  CHECK(b.learner_start <= 1.5 * a.learner_start + 1.0);
  CHECK(b.merger_recovery <= 1.5 * a.merger_recovery + 1.0);
}
