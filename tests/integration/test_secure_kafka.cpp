// A secured run end to end, on a broker of the test's own started the way users start one
// (scripts/secure init, scripts/broker start --secure: mutual TLS, ACLs per principal): a merger
// and two learners of regions eu and us train, each process speaking as the principal its own
// certificate names, set in [security] (and CURVE on the parameters). While they run, every write
// outside a principal's ACLs is refused: learner-0 of eu writing us's delta topic, learner-0
// forging a `state` record, the read-only `replay` principal writing `state`, a client without a
// certificate, a plaintext client; and the run goes on merging. Then audit and verify pass,
// read as `replay`.
#include <catch2/catch.hpp>

#include <csignal>
#include <filesystem>

#include "core/kafka/log_reader.h"
#include "core/kafka/producer.h"
#include "core/kafka/security.h"
#include "tests/integration/child_process.h"
#include "tests/integration/run_fixture.h"

using namespace diloco;
using namespace std::chrono_literals;

namespace {

// The Kafka options of principal `name` of the secured broker at `servers`.
KafkaOptions principal(const std::string& servers, const std::string& secure, const std::string& name) {
  KafkaOptions kafka;
  kafka.bootstrap_servers = servers;
  kafka.connect_timeout_ms = 15000;
  kafka.client_id = name;
  RunConfig config;
  config.security.kafka_protocol = "ssl";
  config.security.kafka_ca = secure + "/ca.pem";
  config.security.kafka_certificate = secure + "/tls/" + name + ".pem";
  apply_kafka_security(kafka, config.security);
  return kafka;
}

// Produces one record as `kafka` and returns its delivery report (not ok: the broker's refusal).
DeliveryReport produce_one(const KafkaOptions& kafka, const std::string& topic, const std::string& key,
                           const std::vector<uint8_t>& value) {
  std::optional<DeliveryReport> report;
  Producer producer(ProducerOptions{.kafka = kafka, .delivery_timeout_ms = 15000},
                    [&](const DeliveryReport& r) { report = r; });
  producer.produce(Record{.topic = topic, .partition = 0, .key = key, .value = value}, 1, 5000);
  producer.flush(20000);
  REQUIRE(report.has_value());
  return *report;
}

}  // namespace

TEST_CASE("on a secured broker each principal writes only what its ACLs allow, the run trains through refusals, "
          "and audit and verify pass",
          "[secure][security][kafka-security]") {
  const int port = testing::test_port("DILOCO_TEST_SECURE_PORT", 19392);
  testing::PrivateBroker broker("secure", port);
  const std::string secure = testing::temp_dir("secure-keys");  // not in broker.dir: scripts/broker's own files are
  const std::string run = testing::unique_run_id("secure");
  const std::string init = DILOCO_SOURCE_DIR "/scripts/secure init " + secure +
                           " --learners 2 --mergers 1 --regions eu,us --keys-bin " DILOCO_BINARY_DIR "/bin/diloco-keys";
  REQUIRE(std::system((init + " >>" + broker.dir + "/script.log 2>&1").c_str()) == 0);
  INFO("scripts/broker output: " << broker.dir << "/script.log");
  REQUIRE(broker.start("--secure " + secure + " --run " + run + " --regions eu,us --partitions 2") == 0);
  const std::string servers = broker.servers();
  const std::string dir = testing::temp_dir("secure-run");
  struct Remove {
    std::string path;
    ~Remove() { std::filesystem::remove_all(path); }
  } remove_keys{secure};

  // Every process: the run, TLS with the CA, CURVE; then its own principal and keys.
  const std::vector<std::string> run_sets = {
      "--set", "run.id=\"" + run + "\"", "--set", "train.eval_every=0", "--set", "diloco.H=4",
      "--set", "security.kafka_protocol=\"ssl\"", "--set", "security.kafka_ca=\"" + secure + "/ca.pem\"",
      "--set", "security.merger_public_key=\"" + secure + "/curve/merger.key\""};
  auto as = [&](const std::string& name) {
    std::vector<std::string> sets = run_sets;
    sets.insert(sets.end(), {"--set", "security.kafka_certificate=\"" + secure + "/tls/" + name + ".pem\""});
    return sets;
  };
  auto merger_sets = as("merger-0");
  merger_sets.insert(merger_sets.end(), {"--set", "security.merger_secret_key=\"" + secure + "/curve/merger.key_secret\"",
                                         "--set", "security.allowed_learners=\"" + secure + "/curve/learners\""});
  const KafkaOptions any{.bootstrap_servers = servers};
  auto merger = testing::start_merger(any, dir, "merger-0", merger_sets);
  auto learner = [&](int index, const std::string& region) {
    const std::string id = "learner-" + std::to_string(index);
    std::vector<std::string> args = {testing::learner_binary(), "-c", testing::tiny_config_path(), "--id", id,
                                     "--index", std::to_string(index), "--learners", "2", "--region", region,
                                     "--regions", "eu,us", "--bootstrap", servers, "--steps", "100000",
                                     "--run-dir", dir + "/" + id};
    const auto sets = as(id);
    args.insert(args.end(), sets.begin(), sets.end());
    args.insert(args.end(), {"--set", "security.learner_key=\"" + secure + "/curve/learners/" + id + ".key_secret\""});
    return std::make_unique<testing::ChildProcess>(args, dir + "/" + id + ".log");
  };
  auto eu = learner(0, "eu");
  auto us = learner(1, "us");
  const std::string eu_metrics = dir + "/learner-0/metrics.jsonl";
  {
    INFO(eu->log() << "\n" << merger->log());
    REQUIRE(testing::eventually([&] { return testing::count_events(eu_metrics, "adopt") >= 3; }, 180s));
  }

  const RunTopics topics{run};
  const KafkaOptions eu_learner = principal(servers, secure, "learner-0");
  {  // Writes outside a principal's ACLs are refused, and the run goes on.
    // learner-0 of eu may write its own region's topic, not us's.
    const std::vector<uint8_t> junk = {1, 2, 3};
    const auto own = produce_one(eu_learner, topics.deltas("eu"), "probe", junk);
    CHECK(own.ok);
    const auto other = produce_one(eu_learner, topics.deltas("us"), "probe", junk);
    CHECK_FALSE(other.ok);
    CHECK_THAT(other.error, Catch::Contains("authoriz", Catch::CaseSensitive::No));

    // A forged checkpoint: a real `state` record, written again by a learner principal, and by replay.
    std::optional<ConsumedMessage> checkpoint;
    read_to_end(principal(servers, secure, "replay"), {topics.state()},
                [&](const ConsumedMessage& m) { if (!m.tombstone && !checkpoint) checkpoint = m; }, 30000);
    REQUIRE(checkpoint.has_value());
    for (const std::string name : {"learner-0", "replay"}) {
      INFO(name);
      const auto forged = produce_one(principal(servers, secure, name), topics.state(), checkpoint->key, checkpoint->value);
      CHECK_FALSE(forged.ok);
      // learner-0: the topic's authorization; replay, which may write nowhere, is refused a producer
      // id first (cluster authorization), which purges what it queued.
      CHECK_THAT(forged.error, Catch::Contains("authoriz", Catch::CaseSensitive::No) || Catch::Contains("Purged"));
    }

    // A client without a certificate of the run's CA, and one without TLS at all, reach nothing.
    KafkaOptions impostor = eu_learner;
    impostor.security.certificate_file.clear();
    impostor.connect_timeout_ms = 8000;
    CHECK_THROWS_WITH(wait_for_broker(impostor), Catch::Contains("without a client certificate") &&
                                                     Catch::Contains("last connection error"));
    KafkaOptions plaintext{.bootstrap_servers = servers, .connect_timeout_ms = 5000, .client_id = "plaintext"};
    CHECK_THROWS_AS(wait_for_broker(plaintext), Unavailable);

    // The run trained on through all of it.
    const size_t adopted = testing::count_events(eu_metrics, "adopt");
    CHECK(testing::eventually([&] { return testing::count_events(eu_metrics, "adopt") >= adopted + 2; }, 120s));
  }

  for (auto* l : {eu.get(), us.get()}) l->signal(SIGTERM);
  for (auto* l : {eu.get(), us.get()}) {
    INFO(l->log());
    CHECK(l->wait_exit(60s) == std::optional<int>(0));
  }
  merger->signal(SIGTERM);
  {
    INFO(merger->log());
    REQUIRE(merger->wait_exit(60s) == std::optional<int>(0));
    CHECK_THAT(merger->log(), Catch::Contains("parameters authenticated (CURVE)"));
  }
  // The learner's probe record in eu's topic is not a delta: the merger rejects it, audit counts it so.
  for (const std::string command : {"audit", "verify"}) {
    std::vector<std::string> args = {testing::replay_binary(), "-c", testing::tiny_config_path(), "--bootstrap", servers};
    const auto sets = as("replay");
    args.insert(args.end(), sets.begin(), sets.end());
    args.push_back(command);
    testing::ChildProcess replay(args, dir + "/" + command + ".log");
    const auto code = replay.wait_exit(120s);
    INFO(command << ":\n" << replay.log());
    CHECK(code == std::optional<int>(0));
    CHECK_THAT(replay.log(), Catch::Contains("PASS"));
  }
}
