// Shared by the integration tests: where the real broker is, a fresh run id per test, and topic
// creation for it. Every test starts by requiring a live broker, so with none running each one
// fails within the connect timeout with the same clear message.
#pragma once

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/errors.h"
#include "core/kafka/consumer.h"
#include "core/kafka/options.h"
#include "core/kafka/topics.h"
#include "tests/integration/child_process.h"

namespace diloco::testing {

inline KafkaOptions broker_options() {
  KafkaOptions options;
  if (const char* servers = std::getenv("DILOCO_BOOTSTRAP")) options.bootstrap_servers = servers;
  options.connect_timeout_ms = 20000;
  options.client_id = "diloco-test";
  return options;
}

// Fails the test (not crashes) with the broker's own explanation when none answers.
inline KafkaOptions require_broker() {
  KafkaOptions options = broker_options();
  try {
    wait_for_broker(options);
  } catch (const Unavailable& e) {
    FAIL(e.what());
  }
  return options;
}

inline std::string unique_run_id(const std::string& prefix) {
  std::random_device rd;
  auto now = std::chrono::system_clock::now().time_since_epoch().count();
  return prefix + "-" + std::to_string(now % 100000000) + "-" + std::to_string(rd() % 10000);
}

// Creates the run's topics from broker_config/topics.def and waits until the broker's metadata
// shows them (a broker that just started can answer CreateTopics before its metadata has them).
inline RunTopics create_run(const KafkaOptions& options, const std::string& run_id,
                            const std::vector<std::string>& regions, int partitions) {
  const auto specs = run_topic_specs(builtin_topic_definitions(), run_id, regions, partitions, options.max_message_bytes);
  create_topics(options, specs, 30000);
  Consumer probe(ConsumerOptions{.kafka = options});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (const auto& spec : specs)
    for (;;) {
      try {
        if (probe.partition_count(spec.name, 5000) == spec.partitions) break;
      } catch (const InvalidInput&) {
        // not in the metadata yet
      }
      if (std::chrono::steady_clock::now() > deadline) FAIL("topic " << spec.name << " not in the metadata after 30 s");
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  return RunTopics{run_id};
}

// The first port of a test's own broker: `fallback`, or the environment variable `name` when set
// (two builds testing on one machine give their tests' brokers other ports, as
// DILOCO_TEST_BROKER_PORT and DILOCO_TEST_CHAOS_PORT do for the shell tests).
inline int test_port(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value && *value ? std::atoi(value) : fallback;
}

// A broker of the test's own (folder, ports and node count), for tests that stop or kill broker
// nodes without disturbing the shared one; stopped and removed when the test ends. Node i of
// `nodes` listens on port + 2 (i - 1) (scripts/broker).
struct PrivateBroker {
  std::string dir;
  int port;
  int nodes;
  PrivateBroker(const std::string& name, int port_, int nodes_ = 1)
      : dir(temp_dir(name + "-broker")), port(port_), nodes(nodes_) {}
  PrivateBroker(const PrivateBroker&) = delete;
  PrivateBroker& operator=(const PrivateBroker&) = delete;
  ~PrivateBroker() {
    run("stop");
    std::filesystem::remove_all(dir);
  }
  // scripts/broker with `args`, its output appended to dir/script.log; the exit status.
  int run(const std::string& args) const {
    const std::string env = "DILOCO_BROKER_DIR=" + dir + " DILOCO_BROKER_PORT=" + std::to_string(port) +
                            " KAFKA_HEAP_OPTS='-Xms128m -Xmx512m' ";
    return std::system((env + DILOCO_SOURCE_DIR "/scripts/broker " + args + " >>" + dir + "/script.log 2>&1").c_str());
  }
  int start(const std::string& args) const { return run("start --nodes " + std::to_string(nodes) + " " + args); }
  std::string servers() const {
    std::string out;
    for (int i = 0; i < nodes; ++i) out += (i ? ",127.0.0.1:" : "127.0.0.1:") + std::to_string(port + 2 * i);
    return out;
  }
};

}  // namespace diloco::testing
