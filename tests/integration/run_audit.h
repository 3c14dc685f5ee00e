// Audits a run from its logs alone with `diloco-replay audit`'s code (tools/replay/audit.cc):
// every delta accounted for exactly once or recorded pending at a clean stop, no delta merged
// twice, no learner with two merged deltas on the same base of a fragment, versions moving
// forward by one (invariants 1 and 2 of ARCHITECTURE.md section 8, as far as the logs show them).
#pragma once

#include <catch2/catch.hpp>

#include <sstream>
#include <string>
#include <vector>

#include "core/kafka/consumer.h"
#include "tools/replay/replay.h"

namespace diloco::testing {

struct AuditResult : RunAudit {
  std::string report() const {
    std::ostringstream out;
    print_audit(*this, false, out);
    return out.str();
  }
};

inline AuditResult audit_run(const KafkaOptions& kafka, const RunConfig& config, const std::vector<std::string>& regions) {
  RunTopics topics{config.run.id};
  std::vector<std::string> delta_topics;
  for (const auto& r : regions) delta_topics.push_back(topics.deltas(r));
  auto reader = std::make_shared<LogReader>(kafka);
  const int partitions = reader->partition_count(topics.merges(), 10000);
  // The run's layout, as diloco-replay reads it: from the checkpoints.
  auto layout = read_run_layout(kafka, topics, config, 60000);
  REQUIRE(layout != nullptr);
  ReplayRun run{.config = config, .layout = std::move(layout), .kafka = kafka, .topics = topics,
                .delta_topics = delta_topics, .partitions = partitions, .timeout_ms = 60000,
                .reader = std::move(reader)};
  return AuditResult{audit(run)};
}

}  // namespace diloco::testing
