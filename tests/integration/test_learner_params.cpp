// A real learner process and a test publisher posing as a merger: a FragmentParams with a wrong
// fingerprint is rejected and counted and the model is unchanged; a correct one is adopted at the
// next step boundary, bit for bit (its checksum is what the learner adopted). And in-process, the
// adopted version is what the model's own buffers hold afterwards, compared value by value.
#include <catch2/catch.hpp>

#include <map>
#include <thread>

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

TEST_CASE("an adopted version is in the model's weights, value for value, and a rejected one changes none",
          "[learner]") {
  KafkaOptions kafka = testing::require_broker();
  std::string run = testing::unique_run_id("params-weights");
  RunTopics topics = testing::create_run(kafka, run, {"r0"}, 2);
  RunConfig config = testing::tiny_config(run, {"diloco.adopt=\"overwrite\""});
  const auto layout = testing::write_genesis(kafka, config, 2);

  zmq::context_t context;
  ParamsPublisher publisher(context, "tcp://127.0.0.1:*");
  Member announcement{.run_id = run, .instance_id = "test-merger", .role = Role::Merger,
                      .endpoint = publisher.bound_endpoint()};
  {
    Producer producer({.kafka = kafka}, nullptr);
    producer.produce({.topic = topics.members(), .partition = 0, .key = "test-merger",
                      .value = encode_member(announcement)}, 0, 10000);
    REQUIRE(producer.flush(20000) == 0);
  }
  testing::HostModel model(config, 2);  // other values than the run's version 0 (seed 1)
  RuntimeOptions o = testing::runtime_options(kafka, config, "L0");
  o.mode = LearnerMode::NoPublish;
  LearnerRuntime learner(o, model.registered());
  REQUIRE(learner.start());
  // start() wrote version 0 into the buffers: seed 1's values.
  const testing::HostModel genesis(config, 1);
  CHECK(model.values == genesis.values);

  // Version 5 of fragment 0: version 0's values with 0.25 added to each.
  FragmentParams version5{.run_id = run, .fingerprint = layout->fingerprint, .fragment = 0, .version = 5,
                          .merger_instance = "test-merger", .epoch = 1, .tensors = genesis.fragment(*layout, 0)};
  for (auto& t : version5.tensors)
    for (auto& v : t.values) v += 0.25f;
  FragmentParams wrong = version5;
  wrong.fingerprint ^= 1;
  for (auto& t : wrong.tensors)
    for (auto& v : t.values) v = 7.0f;
  const auto wrong_bytes = encode_fragment_params(wrong);
  const auto bytes = encode_fragment_params(version5);
  for (int i = 0; i < 20; ++i) {  // the subscriber may connect late: send the wrong one a while
    publisher.publish(0, wrong_bytes);
    learner.poll();
    std::this_thread::sleep_for(50ms);
  }
  CHECK(learner.versions()[0] == 0);
  CHECK(model.values == genesis.values);  // nothing of the rejected message reached the weights
  REQUIRE(testing::eventually([&] {
    publisher.publish(0, bytes);
    learner.poll();
    return learner.versions()[0] == 5;
  }, 30s));
  // Fragment 0's tensors hold version 5 exactly; every other tensor is still version 0.
  std::map<std::string, const DenseTensor*> adopted;
  for (size_t t = 0; t < version5.tensors.size(); ++t) adopted[layout->fragments[0][t].name] = &version5.tensors[t];
  size_t checked = 0;
  for (size_t i = 0; i < model.specs.size(); ++i) {
    INFO("tensor " << model.specs[i].name);
    auto it = adopted.find(model.specs[i].name);
    if (it != adopted.end()) {
      CHECK(model.values[i] == it->second->values);
      ++checked;
    } else {
      CHECK(model.values[i] == genesis.values[i]);
    }
  }
  CHECK(checked == version5.tensors.size());
  learner.close();
}
