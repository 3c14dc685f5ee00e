// A real learner process and a test publisher posing as a merger: a FragmentParams with a wrong
// fingerprint is rejected and counted and the model is unchanged; a correct one is adopted at the
// next step boundary, bit for bit (its checksum is what the learner adopted).
#include <catch2/catch.hpp>

#include <zmq.hpp>

#include "core/codec/messages.h"
#include "core/kafka/producer.h"
#include "core/zmq/params_channel.h"
#include "tests/integration/child_process.h"
#include "tests/integration/run_fixture.h"

using namespace diloco;
using namespace std::chrono_literals;

TEST_CASE("learner rejects FragmentParams with a wrong fingerprint and adopts a correct one", "[learner]") {
  KafkaOptions kafka = testing::require_broker();
  std::string run = testing::unique_run_id("params");
  RunTopics topics = testing::create_run(kafka, run, {"r0"}, 2);
  RunConfig config = testing::tiny_config(run);
  const auto layout = testing::write_genesis(kafka, config, 2);
  const testing::HostModel model(config, 1);

  // The test's "merger": a PUB socket announced in `members`.
  zmq::context_t context;
  ParamsPublisher publisher(context, "tcp://127.0.0.1:*");
  Member announcement{.run_id = run, .instance_id = "test-merger", .role = Role::Merger,
                      .endpoint = publisher.bound_endpoint()};
  {
    Producer producer({.kafka = kafka}, nullptr);
    auto bytes = encode_member(announcement);
    producer.produce({.topic = topics.members(), .partition = 0, .key = "test-merger", .value = bytes}, 0, 10000);
    REQUIRE(producer.flush(20000) == 0);
  }

  std::string dir = testing::temp_dir("learner-params");
  testing::ChildProcess learner({testing::learner_binary(), "-c", testing::tiny_config_path(), "--set",
                                 "run.id=\"" + run + "\"", "--id", "L0", "--region", "r0", "--regions", "r0",
                                 "--steps", "1000000", "--max-seconds", "150", "--log-every", "5", "--run-dir", dir},
                                dir + "/learner.log");
  std::string metrics = dir + "/metrics.jsonl";
  // A loaded CI machine can be slow to start a libtorch process; the log explains any failure.
  if (!testing::eventually([&] { return testing::last_event(metrics, "step").has_value(); }, 120s))
    FAIL("the learner did not start training within 120 s; its log:\n" << learner.log());

  FragmentParams bad{.run_id = run, .fingerprint = layout->fingerprint ^ 1, .fragment = 0, .version = 5,
                     .merger_instance = "test-merger", .epoch = 1, .tensors = model.fragment(*layout, 0)};
  for (auto& t : bad.tensors)
    for (auto& v : t.values) v += 0.5f;
  auto bad_bytes = encode_fragment_params(bad);
  bool rejected = testing::eventually(
      [&] {
        publisher.publish(0, bad_bytes);
        auto step = testing::last_event(metrics, "step");
        return step && step->value("params_rejected", 0) > 0;
      },
      30s);
  CHECK(rejected);
  CHECK_FALSE(testing::last_event(metrics, "adopt").has_value());  // model unchanged
  auto step = testing::last_event(metrics, "step");
  REQUIRE(step);
  CHECK((*step)["versions"][0] == 0);

  FragmentParams good = bad;
  good.fingerprint = layout->fingerprint;
  good.checksum = 0;  // filled in by the encoder
  auto good_bytes = encode_fragment_params(good);
  uint64_t expected_checksum = checksum_fp32(good.tensors);
  bool adopted = testing::eventually(
      [&] {
        publisher.publish(0, good_bytes);
        return testing::last_event(metrics, "adopt").has_value();
      },
      30s);
  REQUIRE(adopted);
  auto adopt = *testing::last_event(metrics, "adopt");
  CHECK(adopt["fragment"] == 0);
  CHECK(adopt["version"] == 5);
  CHECK(adopt["checksum"].get<uint64_t>() == expected_checksum);

  learner.signal(SIGTERM);
  auto code = learner.wait_exit(30s);
  REQUIRE(code.has_value());
  CHECK(*code == 0);
  CHECK(testing::last_event(metrics, "shutdown").has_value());
}
