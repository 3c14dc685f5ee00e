// A run for integration tests: the tiny config under a fresh run id, its topics on the real
// broker, and (when no merger is part of the test) version 0 of every fragment in `state`.
#pragma once

#include <chrono>
#include <csignal>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "core/config/run_config.h"
#include "core/kafka/producer.h"
#include "core/train/model_setup.h"
#include "tests/integration/broker_fixture.h"
#include "tests/integration/child_process.h"

namespace diloco::testing {

inline std::string tiny_config_path() { return DILOCO_SOURCE_DIR "/configs/tiny.toml"; }

inline RunConfig tiny_config(const std::string& run_id, std::vector<std::string> extra = {}) {
  std::vector<std::string> overrides = {"run.id=\"" + run_id + "\""};
  overrides.insert(overrides.end(), extra.begin(), extra.end());
  return load_run_config(tiny_config_path(), overrides);
}

// Writes genesis states of every fragment, as a merger would, and waits for acknowledgement.
inline void write_genesis(const KafkaOptions& kafka, const RunConfig& config, int partitions) {
  ModelSetup setup = build_model(config);
  RunTopics topics{config.run.id};
  int failed = 0;
  Producer producer({.kafka = kafka}, [&](const DeliveryReport& r) { failed += r.ok ? 0 : 1; });
  for (uint32_t p = 0; p < setup.layout.num_fragments(); ++p) {
    auto bytes = encode_fragment_state(genesis_state(config, setup, p));
    producer.produce({.topic = topics.state(), .partition = static_cast<int32_t>(p % static_cast<uint32_t>(partitions)),
                      .key = std::to_string(p), .value = bytes},
                     p, 10000);
  }
  REQUIRE(producer.flush(30000) == 0);
  REQUIRE(failed == 0);
}

inline std::string learner_binary() { return DILOCO_BINARY_DIR "/bin/diloco-learner"; }
inline std::string merger_binary() { return DILOCO_BINARY_DIR "/bin/diloco-merger"; }

// One merger ("M0") and `learners` learners ("L0", ...) of tiny in one region "r0" of `run`, each
// with `sets` (--set pairs) and its run folder under `dir`; the learners train `steps` steps, with
// `learner_args` added to their command lines. Waits for every learner to exit 0 (within
// `timeout`), then stops the merger with SIGTERM.
inline void run_small_cluster(const KafkaOptions& kafka, const std::string& dir, const std::vector<std::string>& sets,
                              int learners, int steps, std::chrono::seconds timeout,
                              const std::vector<std::string>& learner_args = {}) {
  auto start = [&](std::vector<std::string> args, const std::string& id) {
    args.insert(args.end(), {"-c", tiny_config_path(), "--id", id, "--bootstrap", kafka.bootstrap_servers,
                             "--run-dir", dir + "/" + id});
    args.insert(args.end(), sets.begin(), sets.end());
    return std::make_unique<ChildProcess>(args, dir + "/" + id + ".log");
  };
  auto merger = start({merger_binary()}, "M0");
  std::vector<std::unique_ptr<ChildProcess>> children;
  for (int i = 0; i < learners; ++i) {
    std::vector<std::string> args = {learner_binary(), "--index", std::to_string(i), "--learners", std::to_string(learners),
                                     "--region", "r0", "--regions", "r0", "--steps", std::to_string(steps), "--log-every",
                                     "10"};
    args.insert(args.end(), learner_args.begin(), learner_args.end());
    children.push_back(start(std::move(args), "L" + std::to_string(i)));
  }
  for (auto& l : children) {
    auto code = l->wait_exit(timeout);
    INFO(l->log());
    REQUIRE(code.has_value());
    CHECK(*code == 0);
  }
  merger->signal(SIGTERM);
  REQUIRE(merger->wait_exit(std::chrono::seconds(30)).has_value());
}

}  // namespace diloco::testing
