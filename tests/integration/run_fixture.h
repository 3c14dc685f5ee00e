// A run for integration tests: the tiny config under a fresh run id, its topics on the real
// broker, and (when no merger is part of the test) version 0 of every fragment in `state`.
#pragma once

#include <string>
#include <vector>

#include "core/config/run_config.h"
#include "core/kafka/producer.h"
#include "core/train/model_setup.h"
#include "tests/integration/broker_fixture.h"

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

}  // namespace diloco::testing
