// Topic names of a run (ARCHITECTURE.md section 3) and their creation from the definitions in
// broker_config/topics.def, the same file scripts/broker reads.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/kafka/options.h"

namespace diloco {

struct RunTopics {
  std::string run_id;

  std::string deltas(const std::string& region) const { return "diloco." + run_id + ".deltas." + region; }
  // Learners' proposals of version 0 (schemas/genesis.fbs), co-partitioned with the deltas.
  std::string genesis() const { return "diloco." + run_id + ".genesis"; }
  std::string merges() const { return "diloco." + run_id + ".merges"; }
  std::string state() const { return "diloco." + run_id + ".state"; }
  std::string members() const { return "diloco." + run_id + ".members"; }
  std::string rejected() const { return "diloco." + run_id + ".rejected"; }
  // librdkafka regex matching every region's delta topic of the run.
  std::string deltas_pattern() const;
};

struct TopicSpec {
  std::string name;
  int partitions = 1;
  std::vector<std::pair<std::string, std::string>> config;
};

// broker_config/topics.def as it was when this binary was built (embedded by CMake).
std::string_view builtin_topic_definitions();

// Expands topic definitions (the text of topics.def) for a run. Throws InvalidInput naming the
// line on a bad line or a bad run id / region name.
std::vector<TopicSpec> run_topic_specs(std::string_view definitions, const std::string& run_id,
                                       const std::vector<std::string>& regions, int partitions,
                                       uint64_t max_message_bytes);

// Creates the topics that do not exist yet (replication: the broker's default). Existing topics
// are left alone. Throws Unavailable when the broker does not answer, Error on other failures.
void create_topics(const KafkaOptions& options, const std::vector<TopicSpec>& specs, int timeout_ms);

}  // namespace diloco
