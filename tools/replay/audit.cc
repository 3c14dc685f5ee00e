// diloco-replay audit: the run's invariants checked from its logs (replay.h).
#include <map>
#include <optional>
#include <ostream>
#include <tuple>

#include <nlohmann/json.hpp>

#include "core/kafka/chunk_assembler.h"
#include "core/kafka/consumer.h"
#include "core/kafka/log_reader.h"
#include "tools/replay/replay.h"

namespace diloco {

namespace {

std::string where(const Position& p) {
  return std::get<0>(p) + "[" + std::to_string(std::get<1>(p)) + "]@" + std::to_string(std::get<2>(p));
}

}  // namespace

RunAudit audit(const ReplayRun& run) {
  const DecodeLimits limits = run.limits();
  RunAudit a;
  // Chunked deltas count once, at their first piece; pieces that do not make a whole message are
  // positions the merger must have rejected.
  read_to_end(
      *run.reader, run.delta_topics, [&](const ConsumedMessage& m) { a.deltas.insert({m.topic, m.partition, m.offset}); },
      run.timeout_ms, &limits,
      [&](const ChunkProblem& p) { a.deltas.insert({p.position.topic, p.position.partition, p.position.offset}); });
  // A streamed proposal counts once, at its segment 0 (where its genesis record or its rejection
  // names it); a message that does not open as a proposal must have been rejected where it is.
  read_to_end(
      *run.reader, {run.topics.genesis()},
      [&](const ConsumedMessage& m) {
        uint32_t segment = 0;
        try {
          segment = genesis_proposal_segment(m.value, limits);
        } catch (const Rejection&) {
        }
        if (segment == 0) a.proposals.insert({m.topic, m.partition, m.offset});
      },
      run.timeout_ms, &limits,
      [&](const ChunkProblem& p) { a.proposals.insert({p.position.topic, p.position.partition, p.position.offset}); });
  read_to_end(*run.reader, {run.topics.rejected()}, [&](const ConsumedMessage& m) {
    try {
      a.rejected.insert(position_key(decode_rejected(m.value, limits).source));
    } catch (const InvalidInput& e) {
      a.problems.push_back("rejected@" + std::to_string(m.offset) + " does not decode: " + e.what());
    }
  }, run.timeout_ms);
  // Every version a process announced in `members` (a merger's owned versions with their
  // checksums, a learner's held versions): read before the merges, so each was announced before
  // the merge log is read, and must be in it, with the same checksum. A version announced from
  // a state the log does not hold (a merge whose commit failed) is a problem even if a version of
  // that number was committed later from other inputs.
  struct Announced {
    std::string who;
    int64_t stamp_ms = 0;
    std::optional<uint64_t> checksum;
  };
  std::map<std::tuple<uint32_t, uint64_t, std::optional<uint64_t>>, Announced> announced;
  read_to_end(*run.reader, {run.topics.members()}, [&](const ConsumedMessage& m) {
    if (m.tombstone) return;
    Member member;
    try {
      member = decode_member(m.value, limits);
    } catch (const InvalidInput& e) {
      a.problems.push_back("members@" + std::to_string(m.offset) + " does not decode: " + e.what());
      return;
    }
    for (size_t i = 0; i < member.owned_fragments.size(); ++i) {
      std::optional<uint64_t> checksum;
      if (i < member.fragment_checksums.size()) checksum = member.fragment_checksums[i];
      announced.try_emplace({member.owned_fragments[i], member.fragment_versions[i], checksum},
                            Announced{std::string(role_name(member.role)) + " " + member.instance_id,
                                      m.timestamp_ms, checksum});
    }
  }, run.timeout_ms);
  // The last commit's markers, or a killed merger's transaction until the broker aborts it, can
  // still hold back the end a read_committed reader sees.
  std::vector<TopicPartitionOffset> merge_partitions;
  for (int p = 0; p < run.partitions; ++p) merge_partitions.push_back({run.topics.merges(), p, 0});
  for (const auto& u : run.reader->wait_until_stable(merge_partitions, run.timeout_ms))
    a.problems.push_back(u.topic + "[" + std::to_string(u.partition) + "] has a transaction open at " +
                         std::to_string(u.stable) + " (end " + std::to_string(u.high) + ")");
  read_to_end(
      *run.reader, {run.topics.merges()},
      [&](const ConsumedMessage& m) {
        MergeRecord r;
        try {
          r = decode_merge_record(m.value, limits);
        } catch (const InvalidInput& e) {
          a.problems.push_back("merges[" + std::to_string(m.partition) + "]@" + std::to_string(m.offset) +
                               " does not decode: " + e.what());
          return;
        }
        if (r.genesis) {
          auto& v = a.versions[r.fragment];
          if (!v.empty())
            a.problems.push_back("fragment " + std::to_string(r.fragment) + ": a second genesis record at " +
                                 std::to_string(m.offset) + ", after version " + std::to_string(v.back().version));
          v.push_back({0, r.checksum, m.timestamp_ms});
          ++a.final_count[position_key(r.inputs.front().position)];
          ++a.genesis;
          return;
        }
        if (!r.inputs.empty()) {
          ++a.merges;
          auto& v = a.versions[r.fragment];
          if (r.version != r.prev_version + 1)
            a.problems.push_back("record " + std::to_string(m.offset) + " of fragment " + std::to_string(r.fragment) +
                                 " jumps from " + std::to_string(r.prev_version) + " to " + std::to_string(r.version));
          if (!v.empty() && r.prev_version != v.back().version)
            a.problems.push_back("fragment " + std::to_string(r.fragment) + ": version " + std::to_string(r.version) +
                                 " follows " + std::to_string(v.back().version));
          v.push_back({r.version, r.checksum, m.timestamp_ms});
        } else {
          // An accounting-only record is written at the version its merger held, which is the
          // log's latest: one ahead of it was written from a state the log does not hold (a stop
          // after a merge whose commit failed), and a merger restarted on it cannot continue.
          const auto& v = a.versions[r.fragment];
          const uint64_t reached = v.empty() ? 0 : v.back().version;
          if (r.version != r.prev_version || r.version != reached)
            a.problems.push_back("record " + std::to_string(m.offset) + " of fragment " + std::to_string(r.fragment) +
                                 " (accounting only) continues version " + std::to_string(r.version) +
                                 " but the log reached only version " + std::to_string(reached));
        }
        for (const auto& in : r.inputs) {
          const Position key = position_key(in.position);
          ++a.final_count[key];
          ++a.merged_count[key];
          ++a.merged_on_base[{r.fragment, in.learner_id, in.base_version}];
        }
        for (const auto& d : r.dropped) {
          if (d.reason == DropReason::PendingAtStop) {
            a.pending_at_stop.insert(position_key(d.delta.position));
          } else {
            ++a.final_count[position_key(d.delta.position)];
            ++a.dropped[drop_reason_name(d.reason)];
          }
        }
      },
      run.timeout_ms);
  for (const auto& [pos, n] : a.merged_count)
    if (n > 1) a.problems.push_back("delta " + where(pos) + " merged " + std::to_string(n) + " times");
  for (const auto& [pos, n] : a.final_count)
    if (n > 1) a.problems.push_back("delta " + where(pos) + " accounted " + std::to_string(n) + " times");
  for (const auto& [key, n] : a.merged_on_base)
    if (n > 1)
      a.problems.push_back("learner " + std::get<1>(key) + " has " + std::to_string(n) + " merged deltas on base " +
                           std::to_string(std::get<2>(key)) + " of fragment " + std::to_string(std::get<0>(key)));
  for (const auto& pos : a.rejected)
    if (a.final_count.contains(pos)) a.problems.push_back("delta " + where(pos) + " both rejected and in a record");
  for (const auto& pos : a.deltas)
    if (!a.final_count.contains(pos) && !a.pending_at_stop.contains(pos) && !a.rejected.contains(pos))
      a.problems.push_back("delta " + where(pos) + " is neither merged, dropped, rejected nor recorded pending");
  for (const auto& pos : a.proposals)
    if (!a.final_count.contains(pos) && !a.rejected.contains(pos))
      a.problems.push_back("proposal " + where(pos) + " is neither version 0 of its fragment nor rejected");
  for (const auto& [fragment, list] : a.versions)
    if (list.empty() || list.front().version != 0)
      a.problems.push_back("fragment " + std::to_string(fragment) + " has merges but no genesis record");
  for (const auto& [key, who] : announced) {
    const auto& [fragment, version, checksum] = key;
    ++a.announcements;
    const auto it = a.versions.find(fragment);
    const AuditedVersion* committed = nullptr;
    if (it != a.versions.end())
      for (const auto& v : it->second)
        if (v.version == version) committed = &v;
    const std::string what = who.who + " announced version " + std::to_string(version) + " of fragment " +
                             std::to_string(fragment) + " (members, time " + std::to_string(who.stamp_ms) + " ms)";
    if (!committed)
      a.problems.push_back(what + ", which the merge log does not hold");
    else if (checksum && *checksum != committed->checksum)
      a.problems.push_back(what + " with checksum " + std::to_string(*checksum) + "; the log's version has checksum " +
                           std::to_string(committed->checksum));
  }
  return a;
}

int print_audit(const RunAudit& a, bool json, std::ostream& out) {
  size_t merged = 0;
  for (const auto& [pos, n] : a.merged_count) merged += n > 0;
  size_t dropped = 0;
  for (const auto& [reason, n] : a.dropped) dropped += n;
  if (json) {
    nlohmann::json versions = nlohmann::json::object();
    for (const auto& [fragment, list] : a.versions) {
      auto& v = versions[std::to_string(fragment)] = nlohmann::json::array();
      for (const auto& x : list) v.push_back({{"version", x.version}, {"checksum", x.checksum}, {"time_ms", x.time_ms}});
    }
    out << nlohmann::json{{"ok", a.ok()},
                          {"deltas", a.deltas.size()},
                          {"merge_records", a.merges},
                          {"merged", merged},
                          {"dropped", a.dropped},
                          {"pending_at_stop", a.pending_at_stop.size()},
                          {"rejected", a.rejected.size()},
                          {"proposals", a.proposals.size()},
                          {"genesis_records", a.genesis},
                          {"problems", a.problems},
                          {"versions", versions}}
               .dump()
        << "\n";
  } else {
    out << a.deltas.size() << " deltas: " << merged << " merged, " << dropped << " dropped";
    for (const auto& [reason, n] : a.dropped) out << (reason == a.dropped.begin()->first ? " (" : ", ") << reason << " " << n;
    out << (a.dropped.empty() ? "" : ")") << ", " << a.pending_at_stop.size() << " pending at a clean stop, "
        << a.rejected.size() << " rejected; " << a.merges << " merges over " << a.versions.size() << " fragments; "
        << a.proposals.size() << " proposals of version 0, " << a.genesis << " committed\n";
    for (const auto& p : a.problems) out << "PROBLEM " << p << "\n";
    out << (a.ok() ? "PASS" : "FAIL") << "\n";
  }
  return a.ok() ? 0 : 1;
}

}  // namespace diloco
