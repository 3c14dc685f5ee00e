// With the only broker stopped mid-run the learner keeps stepping, its memory stays bounded (new
// deltas supersede unsent ones), and it publishes again once the broker is back. The test runs
// its own broker (separate folder and port) so stopping it disturbs no other test.
#include <catch2/catch.hpp>

#include <cstdlib>

#include "core/kafka/consumer.h"
#include "core/kafka/log_reader.h"
#include "tests/integration/child_process.h"
#include "tests/integration/run_fixture.h"

using namespace diloco;
using namespace std::chrono_literals;

TEST_CASE("learner trains through a broker outage with bounded memory and publishes again after", "[learner][outage]") {
  testing::require_broker();  // the shared broker must be up too: its absence is a setup error
  testing::PrivateBroker broker("outage", testing::test_port("DILOCO_TEST_OUTAGE_PORT", 29292));
  std::string run = testing::unique_run_id("outage");
  REQUIRE(broker.start("--run " + run + " --regions r0 --partitions 2") == 0);
  KafkaOptions kafka = testing::broker_options();
  kafka.bootstrap_servers = broker.servers();
  RunConfig config = testing::tiny_config(run, {"diloco.H=8"});
  testing::write_genesis(kafka, config, 2);

  std::string dir = testing::temp_dir("learner-outage");
  std::string metrics = dir + "/metrics.jsonl";
  testing::ChildProcess learner({testing::learner_binary(), "-c", testing::tiny_config_path(), "--set",
                                 "run.id=\"" + run + "\"", "--set", "diloco.H=8", "--set", "train.eval_every=0",
                                 "--bootstrap", kafka.bootstrap_servers, "--id", "L0", "--region", "r0", "--regions",
                                 "r0", "--steps", "1000000", "--max-seconds", "240", "--log-every", "10",
                                 "--run-dir", dir},
                                dir + "/learner.log");
  auto step_record = [&] { return testing::last_event(metrics, "step"); };
  if (!testing::eventually([&] { auto s = step_record(); return s && s->value("deltas_delivered", 0) >= 5; }, 120s))
    FAIL("the learner delivered no deltas within 120 s; its log:\n" << learner.log());

  REQUIRE(broker.run("stop") == 0);
  auto at_stop = *step_record();
  uint64_t delivered_at_stop = at_stop["deltas_delivered"];
  long rss_at_stop = learner.rss_kb();
  std::this_thread::sleep_for(15s);
  auto during = *step_record();
  INFO("at stop: " << at_stop.dump() << "\nduring: " << during.dump());
  CHECK(learner.running());
  CHECK(during["step"].get<uint64_t>() > at_stop["step"].get<uint64_t>() + 100);  // kept stepping
  CHECK(during["deltas_delivered"].get<uint64_t>() <= delivered_at_stop + 4);      // nothing got through
  CHECK(during["deltas_superseded"].get<uint64_t>() > at_stop["deltas_superseded"].get<uint64_t>());
  CHECK(during["deltas_waiting"].get<uint64_t>() <= config.diloco.fragments);       // bounded queue
  CHECK(during["deltas_in_flight"].get<uint64_t>() <= config.diloco.fragments);
  CHECK(learner.rss_kb() < rss_at_stop + 64 * 1024);                                // no growth with the backlog

  REQUIRE(broker.run("start") == 0);
  bool resumed = testing::eventually(
      [&] { return step_record()->value("deltas_delivered", uint64_t{0}) > delivered_at_stop + 4; }, 90s);
  CHECK(resumed);

  learner.signal(SIGTERM);
  auto code = learner.wait_exit(30s);
  REQUIRE(code.has_value());
  CHECK(*code == 0);

  // Every delta the learner counted as delivered is in the topic.
  uint64_t delivered = testing::last_event(metrics, "shutdown")->value("delivered", uint64_t{0});
  uint64_t in_topic = 0;
  read_to_end(kafka, {RunTopics{run}.deltas("r0")}, [&](const ConsumedMessage&) { ++in_topic; }, 60000);
  CHECK(in_topic == delivered);
}
