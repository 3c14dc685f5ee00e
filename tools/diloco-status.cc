// diloco-status: what a running (or finished) cluster looks like from its logs: live learners and
// mergers from `members`, fragment ownership and versions, heartbeat ages, and the merger group's
// consumer lag on every delta partition. Works against any broker holding a run's topics.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <map>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/codec/messages.h"
#include "core/errors.h"
#include "core/config/run_config.h"
#include "core/kafka/consumer.h"
#include "core/kafka/log_reader.h"
#include "core/kafka/security.h"
#include "core/kafka/topics.h"
#include "core/process.h"

using namespace diloco;

namespace {

struct StatusOptions {
  KafkaOptions kafka;
  std::string run;
  double live_seconds = 10;  // a member whose last heartbeat is older is shown as gone
  bool json = false;
  double watch_seconds = 0;
};

struct PartitionLag {
  std::string topic;
  int32_t partition = 0;
  int64_t committed = -1;  // -1: the group has not committed here yet
  int64_t high = 0;
  int64_t lag() const { return high - std::max<int64_t>(committed, 0); }
};

struct ClusterStatus {
  std::string run;
  std::map<std::string, Member> members;  // latest announcement per instance
  std::vector<PartitionLag> lag;
  int64_t now_us = 0;
};

const std::string kPrefix = "diloco.";

// Runs on the broker: every <run> with a diloco.<run>.members topic.
std::vector<std::string> list_runs(Consumer& probe) {
  std::vector<std::string> runs;
  const std::string suffix = ".members";
  for (const auto& [name, partitions] : probe.list_topics(10000))
    if (name.starts_with(kPrefix) && name.ends_with(suffix) && name.size() > kPrefix.size() + suffix.size())
      runs.push_back(name.substr(kPrefix.size(), name.size() - kPrefix.size() - suffix.size()));
  return runs;
}

ClusterStatus read_status(const StatusOptions& o) {
  RunTopics topics{o.run};
  ClusterStatus status{.run = o.run};
  ConsumerOptions group{.kafka = o.kafka, .group_id = "diloco." + o.run + ".mergers"};
  Consumer consumer(group);  // never subscribes: only reads the group's committed offsets
  std::vector<TopicPartitionOffset> delta_partitions;
  bool found_members = false;
  const std::string delta_prefix = topics.deltas("");
  for (const auto& [name, partitions] : consumer.list_topics(10000)) {
    if (name == topics.members()) found_members = true;
    if (!name.starts_with(delta_prefix)) continue;
    for (int p = 0; p < partitions; ++p) delta_partitions.push_back({name, p, -1});
  }
  if (!found_members)
    throw InvalidInput("run '" + o.run + "' has no topics on " + o.kafka.bootstrap_servers +
                       " (diloco-status without --run lists the runs there)");
  DecodeLimits limits{.run_id = o.run};
  read_to_end(o.kafka, {topics.members()}, [&](const ConsumedMessage& m) {
    if (m.tombstone) {
      status.members.erase(m.key);
      return;
    }
    try {
      Member member = decode_member(m.value, limits);
      status.members[member.instance_id] = member;
    } catch (const InvalidInput&) {
      // A malformed announcement says nothing about the cluster; the merger logs it to `rejected`.
    }
  }, 30000);
  for (const auto& c : consumer.committed(delta_partitions, 10000)) {
    int64_t high = consumer.watermarks(c.topic, c.partition, 5000).second;
    status.lag.push_back({c.topic, c.partition, c.offset, high});
  }
  status.now_us = unix_us();
  return status;
}

double age_seconds(const ClusterStatus& s, const Member& m) { return static_cast<double>(s.now_us - m.time_us) / 1e6; }

std::string versions_text(const Member& m) {
  std::string out;
  for (size_t i = 0; i < m.owned_fragments.size(); ++i)
    out += (out.empty() ? "" : " ") + std::to_string(m.owned_fragments[i]) + "@v" + std::to_string(m.fragment_versions[i]);
  return out.empty() ? "-" : out;
}

void print_table(const ClusterStatus& s, const StatusOptions& o) {
  std::cout << "run " << s.run << " on " << o.kafka.bootstrap_servers << "\n\n";
  std::cout << std::left << std::setw(16) << "MERGER" << std::setw(8) << "STATE" << std::setw(10) << "HEARTBEAT"
            << std::setw(28) << "ENDPOINT" << "FRAGMENTS@VERSION\n";
  size_t mergers = 0;
  for (const auto& [id, m] : s.members) {
    if (m.role != Role::Merger) continue;
    ++mergers;
    double age = age_seconds(s, m);
    bool live = age <= o.live_seconds && !m.owned_fragments.empty();
    std::ostringstream heartbeat;
    heartbeat << std::fixed << std::setprecision(1) << age << "s";
    std::cout << std::setw(16) << id << std::setw(8) << (live ? "live" : "gone") << std::setw(10) << heartbeat.str()
              << std::setw(28) << m.endpoint << versions_text(m) << "\n";
  }
  if (mergers == 0) std::cout << "(no merger has announced itself)\n";
  std::cout << "\n"
            << std::setw(16) << "LEARNER" << std::setw(8) << "STATE" << std::setw(10) << "HEARTBEAT" << std::setw(8)
            << "REGION" << std::setw(9) << "STEP" << std::setw(11) << "BATCH" << std::setw(9) << "LOSS" << std::setw(10)
            << "TOK/S" << std::setw(12)
            << "SENT" << std::setw(12) << "RECEIVED" << "VERSIONS\n";
  size_t learners = 0;
  for (const auto& [id, m] : s.members) {
    if (m.role == Role::Merger) continue;
    ++learners;
    double age = age_seconds(s, m);
    std::ostringstream heartbeat, batch, loss, sent, received, versions;
    heartbeat << std::fixed << std::setprecision(1) << age << "s";
    if (m.batch > 0) batch << m.batch << "x" << m.context;  // sequences x tokens per step
    else batch << "-";
    loss << std::fixed << std::setprecision(3) << m.loss;
    sent << std::fixed << std::setprecision(2) << static_cast<double>(m.bytes_sent) / 1e6 << " MB";
    received << std::fixed << std::setprecision(2) << static_cast<double>(m.bytes_received) / 1e6 << " MB";
    for (size_t i = 0; i < m.fragment_versions.size(); ++i) versions << (i ? " " : "") << m.fragment_versions[i];
    std::string name = m.role == Role::Evaluator ? id + " (eval)" : id;
    std::cout << std::setw(16) << name << std::setw(8) << (age <= o.live_seconds ? "live" : "gone") << std::setw(10)
              << heartbeat.str() << std::setw(8) << m.region << std::setw(9) << m.step << std::setw(11) << batch.str()
              << std::setw(9) << loss.str()
              << std::setw(10) << static_cast<int64_t>(m.tokens_per_s) << std::setw(12) << sent.str() << std::setw(12) << received.str() << versions.str()
              << "\n";
  }
  if (learners == 0) std::cout << "(no learner has sent a heartbeat)\n";
  int64_t total = 0;
  std::cout << "\nconsumer lag of group diloco." << s.run << ".mergers (deltas not yet read by a merger):\n";
  for (const auto& l : s.lag) {
    total += l.lag();
    std::cout << "  " << l.topic << "[" << l.partition << "]: " << l.lag()
              << (l.committed < 0 ? " (nothing committed yet)" : "") << "\n";
  }
  std::cout << "  total: " << total << "\n";
}

nlohmann::json to_json(const ClusterStatus& s, const StatusOptions& o) {
  nlohmann::json members = nlohmann::json::array();
  for (const auto& [id, m] : s.members) {
    double age = age_seconds(s, m);
    members.push_back({{"id", id}, {"role", role_name(m.role)}, {"region", m.region}, {"endpoint", m.endpoint},
                       {"epoch", m.epoch}, {"heartbeat_age_s", age},
                       {"live", age <= o.live_seconds && (m.role != Role::Merger || !m.owned_fragments.empty())},
                       {"fragments", m.owned_fragments}, {"versions", m.fragment_versions}, {"step", m.step},
                       {"loss", m.loss}, {"tokens_per_s", m.tokens_per_s}, {"tokens", m.tokens},
                       {"batch", m.batch}, {"context", m.context},
                       {"bytes_sent", m.bytes_sent}, {"bytes_received", m.bytes_received}});
  }
  nlohmann::json lag = nlohmann::json::array();
  for (const auto& l : s.lag)
    lag.push_back({{"topic", l.topic}, {"partition", l.partition}, {"committed", l.committed}, {"high", l.high}, {"lag", l.lag()}});
  return {{"run", s.run}, {"members", members}, {"consumer_lag", lag}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "diloco-status: shows a cluster from its Kafka topics: live learners and mergers, which merger\n"
      "owns which fragment at which version, heartbeat ages, and the mergers' consumer lag.\n"
      "Without --run it lists the runs on the broker.\n"};
  StatusOptions o;
  o.kafka.bootstrap_servers = default_bootstrap_servers();
  app.add_option("-r,--run", o.run, "run id (the <id> in the topic names diloco.<id>.*)");
  app.add_option("--bootstrap", o.kafka.bootstrap_servers, "Kafka bootstrap servers (default: $DILOCO_BOOTSTRAP or 127.0.0.1:19092)")
      ->capture_default_str();
  app.add_option("--live-seconds", o.live_seconds, "a member whose last heartbeat is older than this is shown as gone")
      ->capture_default_str();
  std::string config_file;
  std::vector<std::string> overrides;
  app.add_option("-c,--config", config_file,
                 "a run config whose [security] section says how to reach a secured broker (TLS, SCRAM credentials); "
                 "nothing else of it is read")
      ->check(CLI::ExistingFile);
  app.add_option("-s,--set", overrides, "override a config field, e.g. --set security.kafka_credentials=PATH (repeatable)");
  app.add_flag("--json", o.json, "print one JSON object instead of tables");
  app.add_option("-w,--watch", o.watch_seconds, "refresh every N seconds until Ctrl-C (0: print once)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  install_stop_handlers();
  o.kafka.connect_timeout_ms = 10000;
  o.kafka.client_id = "diloco-status";  // its reader's group id begins with it (a secured broker's ACLs)
  try {
    if (!config_file.empty()) apply_kafka_security(o.kafka, load_run_config(config_file, overrides).security);
    wait_for_broker(o.kafka);
    if (o.run.empty()) {
      ConsumerOptions probe_options{.kafka = o.kafka};
      Consumer probe(probe_options);
      auto runs = list_runs(probe);
      if (runs.empty()) std::cout << "no runs on " << o.kafka.bootstrap_servers << "\n";
      for (const auto& r : runs) std::cout << r << "\n";
      return 0;
    }
    do {
      ClusterStatus status = read_status(o);
      if (o.json) {
        std::cout << to_json(status, o).dump() << std::endl;
      } else {
        if (o.watch_seconds > 0) std::cout << "\x1b[H\x1b[2J";
        print_table(status, o);
        std::cout << std::flush;
      }
      for (double waited = 0; waited < o.watch_seconds && !stop_requested(); waited += 0.1)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    } while (o.watch_seconds > 0 && !stop_requested());
    return 0;
  } catch (const InvalidInput& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  } catch (const Error& e) {  // Unavailable (no broker), IoError (a config or credentials file)
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
