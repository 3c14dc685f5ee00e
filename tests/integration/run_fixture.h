// A run for integration tests: the tiny config under a fresh run id, its topics on the real
// broker, learners' models without libtorch (seeded host buffers of the built-in model's
// tensors), and version 0 of every fragment: proposed to a running merger as a learner does, or
// (when no merger is part of the test) written to `state` as a merger would.
#pragma once

#include <chrono>
#include <csignal>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "core/config/run_config.h"
#include "core/kafka/producer.h"
#include "core/model/builtin_specs.h"
#include "learner/runtime.h"
#include "merger/recovery.h"
#include "tests/integration/broker_fixture.h"
#include "tests/integration/child_process.h"

namespace diloco::testing {

inline std::string tiny_config_path() { return DILOCO_SOURCE_DIR "/configs/tiny.toml"; }

inline RunConfig tiny_config(const std::string& run_id, std::vector<std::string> extra = {}) {
  std::vector<std::string> overrides = {"run.id=\"" + run_id + "\""};
  overrides.insert(overrides.end(), extra.begin(), extra.end());
  return load_run_config(tiny_config_path(), overrides);
}

// A run of the tiny config under a fresh run id: its topics (`regions`, `partitions` each; with 2,
// fragments 0 and 2 live in partition 0), a folder for its processes' logs and run folders, and
// the --set arguments that give the binaries the same config.
struct TinyRun {
  KafkaOptions kafka = require_broker();
  std::string run;
  RunTopics topics;
  std::string dir;
  RunConfig config;
  std::vector<std::string> sets;

  TinyRun(const std::string& name, const std::vector<std::string>& extra = {},
          const std::vector<std::string>& regions = {"r0"}, int partitions = 2)
      : run(unique_run_id(name)), topics(create_run(kafka, run, regions, partitions)), dir(temp_dir(name)),
        config(tiny_config(run, extra)) {
    sets = {"--set", "run.id=\"" + run + "\""};
    for (const auto& e : extra) sets.insert(sets.end(), {"--set", e});
  }
};

// A learner's model without a model: the built-in tensors (core/model/builtin_specs.h) in host
// buffers with seeded values, N(0, 0.02) per tensor from (seed, tensor position). Two models of
// one seed hold the same values, of two seeds different ones.
struct HostModel {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<float>> values;  // per tensor, in registration order

  HostModel(std::vector<TensorSpec> specs_, uint32_t seed) : specs(std::move(specs_)) {
    for (size_t i = 0; i < specs.size(); ++i) {
      std::mt19937 rng(seed * 7919u + static_cast<uint32_t>(i));
      std::normal_distribution<float> normal(0.0f, 0.02f);
      values.emplace_back(static_cast<size_t>(specs[i].numel()));
      for (auto& v : values.back()) v = normal(rng);
    }
  }
  HostModel(const RunConfig& config, uint32_t seed) : HostModel(builtin_tensor_specs(model_options(config.model)), seed) {}

  // What a learner registers: the buffers themselves (keep the model alive and unmoved).
  std::vector<RegisteredTensor> registered() {
    std::vector<RegisteredTensor> out;
    for (size_t i = 0; i < specs.size(); ++i) out.push_back({specs[i].name, specs[i].shape, values[i].data()});
    return out;
  }
  // Fragment p's tensors in layout order.
  std::vector<DenseTensor> fragment(const FragmentLayout& layout, uint32_t p) const {
    std::vector<DenseTensor> out;
    for (const auto& spec : layout.fragments.at(p))
      for (size_t i = 0; i < specs.size(); ++i)
        if (specs[i].name == spec.name)
          out.push_back(DenseTensor{static_cast<uint32_t>(out.size()), spec.shape, values[i]});
    return out;
  }
};

// Version 0 of every fragment of the built-in model in `state`, as a merger commits it from a
// learner's proposal (seeded values), for tests that run learners without a merger. No genesis
// record is written: replay's audit and verify want a run whose merger committed version 0
// (propose_genesis).
inline std::shared_ptr<const FragmentLayout> write_genesis(const KafkaOptions& kafka, const RunConfig& config,
                                                           int partitions, uint32_t seed = 1) {
  auto layout = std::make_shared<const FragmentLayout>(builtin_layout(config));
  const HostModel model(config, seed);
  RunTopics topics{config.run.id};
  int failed = 0;
  Producer producer({.kafka = kafka}, [&](const DeliveryReport& r) { failed += r.ok ? 0 : 1; });
  for (uint32_t p = 0; p < layout->num_fragments(); ++p) {
    auto bytes = encode_fragment_state(genesis_state(config, layout, p, model.fragment(*layout, p)));
    producer.produce({.topic = topics.state(), .partition = static_cast<int32_t>(p % static_cast<uint32_t>(partitions)),
                      .key = std::to_string(p), .value = bytes},
                     p, 10000);
  }
  REQUIRE(producer.flush(30000) == 0);
  REQUIRE(failed == 0);
  return layout;
}

// Options of an in-process learner (LearnerRuntime) of `config` in `region`, against `kafka`.
inline RuntimeOptions runtime_options(const KafkaOptions& kafka, const RunConfig& config, const std::string& id,
                                      const std::string& region = "r0") {
  RuntimeOptions o{.config = config, .learner_id = id, .region = region, .kafka = kafka};
  o.kafka.client_id = id;
  o.genesis_timeout = std::chrono::seconds(60);
  o.heartbeat_interval_s = 0.5;
  return o;
}

// Version 0 of every fragment that has none, proposed by an in-process learner `id` (seeded
// values, no deltas) and committed by the run's merger, which must be running. Returns the
// learner's values after start(): the run's version 0.
inline HostModel propose_genesis(const KafkaOptions& kafka, const RunConfig& config, const std::string& region = "r0",
                                 const std::string& id = "genesis", uint32_t seed = 1) {
  HostModel model(config, seed);
  RuntimeOptions o = runtime_options(kafka, config, id, region);
  o.mode = LearnerMode::NoPublish;
  LearnerRuntime learner(o, model.registered());
  REQUIRE(learner.start());
  learner.close();
  return model;
}

inline std::string learner_binary() { return DILOCO_BINARY_DIR "/bin/diloco-learner"; }
inline std::string merger_binary() { return DILOCO_BINARY_DIR "/bin/diloco-merger"; }
inline std::string replay_binary() { return DILOCO_BINARY_DIR "/bin/diloco-replay"; }

// A diloco-merger process `id` of the tiny config with `sets` (--set pairs), its run folder
// dir/folder (default: the id) and its output in dir/folder.log.
inline std::unique_ptr<ChildProcess> start_merger(const KafkaOptions& kafka, const std::string& dir,
                                                  const std::string& id, const std::vector<std::string>& sets,
                                                  std::string folder = "") {
  if (folder.empty()) folder = id;
  std::vector<std::string> args = {merger_binary(), "-c", tiny_config_path(), "--id", id, "--bootstrap",
                                   kafka.bootstrap_servers, "--run-dir", dir + "/" + folder, "--session-timeout-ms",
                                   "6000"};
  args.insert(args.end(), sets.begin(), sets.end());
  return std::make_unique<ChildProcess>(args, dir + "/" + folder + ".log");
}

// `diloco-replay <command>` (verify, audit) of the run (tiny config with `sets`, which name the
// run id): PASS and exit 0, or the test fails with its output.
inline void require_replay_pass(const KafkaOptions& kafka, const std::string& dir, const std::vector<std::string>& sets,
                                const std::string& command) {
  std::vector<std::string> args = {replay_binary(), "-c", tiny_config_path(), "--bootstrap", kafka.bootstrap_servers};
  args.insert(args.end(), sets.begin(), sets.end());
  args.push_back(command);
  ChildProcess replay(args, dir + "/" + command + ".log");
  const auto code = replay.wait_exit(std::chrono::seconds(120));
  INFO(replay.log());
  REQUIRE(code == std::optional<int>(0));
  CHECK(replay.log().find("PASS") != std::string::npos);
}

inline void require_verify_pass(const KafkaOptions& kafka, const std::string& dir, const std::vector<std::string>& sets) {
  require_replay_pass(kafka, dir, sets, "verify");
}

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
