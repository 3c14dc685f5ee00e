// Audits a run from its logs alone (invariants 1 and 2 of ARCHITECTURE.md section 8, as far as
// the merge log shows them): every delta in a region topic is accounted for exactly once (merged
// into one version, dropped for good with a reason, or rejected by a merger in the `rejected`
// topic) or recorded as pending at a clean stop; no delta is merged twice; no learner has two
// merged deltas on the same base of a fragment (its progress would count twice); per fragment,
// versions only move forward by one.
#pragma once

#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "core/kafka/consumer.h"
#include "core/kafka/topics.h"
#include "core/train/model_setup.h"

namespace diloco::testing {

struct RunAudit {
  using Position = std::tuple<std::string, int32_t, int64_t>;
  std::set<Position> deltas;                 // every delta in the region topics
  std::map<Position, int> final_count;       // merged or dropped for good
  std::map<Position, int> merged_count;
  std::set<Position> pending_at_stop;
  std::set<Position> rejected;               // named by the `rejected` topic
  // (fragment, learner, base version) -> merged deltas
  std::map<std::tuple<uint32_t, std::string, uint64_t>, int> merged_on_base;
  std::map<uint32_t, std::vector<uint64_t>> versions;  // per fragment, in log order (merges only)
  size_t merges = 0;
  std::vector<std::string> problems;

  bool ok() const { return problems.empty(); }
  std::string report() const {
    std::ostringstream out;
    out << deltas.size() << " deltas, " << merges << " merge records; ";
    for (const auto& p : problems) out << "\n  " << p;
    return out.str();
  }
};

inline RunAudit audit_run(const KafkaOptions& kafka, const RunConfig& config, const std::vector<std::string>& regions) {
  ModelSetup setup = build_model(config);
  DecodeLimits limits{.run_id = config.run.id, .fingerprint = setup.layout.fingerprint, .layout = &setup.layout};
  RunTopics topics{config.run.id};
  RunAudit audit;
  std::vector<std::string> delta_topics;
  for (const auto& r : regions) delta_topics.push_back(topics.deltas(r));
  read_to_end(kafka, delta_topics, [&](const ConsumedMessage& m) { audit.deltas.insert({m.topic, m.partition, m.offset}); },
              60000);
  read_to_end(kafka, {topics.rejected()}, [&](const ConsumedMessage& m) {
    const RejectedInput r = decode_rejected(m.value, limits);
    audit.rejected.insert({r.source.topic, r.source.partition, r.source.offset});
  }, 60000);
  // The last commit's markers, or a killed merger's transaction until the broker aborts it, can
  // still hold back the end a read_committed reader sees.
  std::vector<TopicPartitionOffset> merge_partitions;
  {
    Consumer probe(ConsumerOptions{.kafka = kafka});
    for (int p = 0; p < probe.partition_count(topics.merges(), 10000); ++p) merge_partitions.push_back({topics.merges(), p, 0});
  }
  for (const auto& u : wait_until_stable(kafka, merge_partitions, 60000))
    audit.problems.push_back(u.topic + "[" + std::to_string(u.partition) + "] has a transaction open at " +
                             std::to_string(u.stable) + " (end " + std::to_string(u.high) + ")");
  read_to_end(
      kafka, {topics.merges()},
      [&](const ConsumedMessage& m) {
        MergeRecord r = decode_merge_record(m.value, limits);
        auto key = [](const DeltaRef& d) { return RunAudit::Position{d.position.topic, d.position.partition, d.position.offset}; };
        if (!r.inputs.empty()) {
          ++audit.merges;
          auto& v = audit.versions[r.fragment];
          if (r.version != r.prev_version + 1)
            audit.problems.push_back("record " + std::to_string(m.offset) + " jumps from " + std::to_string(r.prev_version) +
                                     " to " + std::to_string(r.version));
          if (!v.empty() && r.prev_version != v.back())
            audit.problems.push_back("fragment " + std::to_string(r.fragment) + ": version " + std::to_string(r.version) +
                                     " follows " + std::to_string(v.back()));
          v.push_back(r.version);
        }
        for (const auto& in : r.inputs) {
          ++audit.final_count[key(in)];
          ++audit.merged_count[key(in)];
          ++audit.merged_on_base[{r.fragment, in.learner_id, in.base_version}];
        }
        for (const auto& d : r.dropped) {
          if (d.reason == DropReason::PendingAtStop)
            audit.pending_at_stop.insert(key(d.delta));
          else
            ++audit.final_count[key(d.delta)];
        }
      },
      60000);
  for (const auto& [pos, n] : audit.merged_count)
    if (n > 1) audit.problems.push_back("delta " + std::get<0>(pos) + "@" + std::to_string(std::get<2>(pos)) + " merged " + std::to_string(n) + " times");
  for (const auto& [pos, n] : audit.final_count)
    if (n > 1) audit.problems.push_back("delta " + std::get<0>(pos) + "@" + std::to_string(std::get<2>(pos)) + " accounted " + std::to_string(n) + " times");
  for (const auto& [key, n] : audit.merged_on_base)
    if (n > 1)
      audit.problems.push_back("learner " + std::get<1>(key) + " has " + std::to_string(n) + " merged deltas on base " +
                               std::to_string(std::get<2>(key)) + " of fragment " + std::to_string(std::get<0>(key)));
  for (const auto& pos : audit.rejected)
    if (audit.final_count.count(pos))
      audit.problems.push_back("delta " + std::get<0>(pos) + "@" + std::to_string(std::get<2>(pos)) + " both rejected and in a record");
  for (const auto& pos : audit.deltas)
    if (!audit.final_count.count(pos) && !audit.pending_at_stop.count(pos) && !audit.rejected.count(pos))
      audit.problems.push_back("delta " + std::get<0>(pos) + "[" + std::to_string(std::get<1>(pos)) + "]@" +
                               std::to_string(std::get<2>(pos)) + " is neither merged, dropped nor recorded pending");
  return audit;
}

}  // namespace diloco::testing
