// Shared by the integration tests: where the real broker is, a fresh run id per test, and topic
// creation for it. Every test starts by requiring a live broker, so with none running each one
// fails within the connect timeout with the same clear message.
#pragma once

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/kafka/options.h"
#include "core/kafka/topics.h"

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

// Creates the run's topics from broker_config/topics.def.
inline RunTopics create_run(const KafkaOptions& options, const std::string& run_id,
                            const std::vector<std::string>& regions, int partitions) {
  create_topics(options,
                run_topic_specs(builtin_topic_definitions(), run_id, regions, partitions, options.max_message_bytes),
                30000);
  return RunTopics{run_id};
}

}  // namespace diloco::testing
