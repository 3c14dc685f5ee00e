// diloco-merger: a member of the run's merger group. See merger/merger_process.h and
// ARCHITECTURE.md section 6.
#include <CLI/CLI.hpp>

#include <iostream>

#include "core/errors.h"
#include "core/process.h"
#include "merger/merger_process.h"

using namespace diloco;

int main(int argc, char** argv) {
  CLI::App app{
      "diloco-merger: consumes every region's deltas for the fragments it owns (Kafka consumer group,\n"
      "range assignor), merges them with quorum, grace window, token and staleness weighting, commits\n"
      "each merge exactly once (merge record + checkpoint + offsets in one Kafka transaction), then\n"
      "publishes the new fragment to the learners over ZeroMQ. Start more instances to split the\n"
      "fragments; a killed instance's fragments move to the others within the session timeout.\n"};
  std::string config_file, bootstrap = default_bootstrap_servers();
  std::vector<std::string> overrides;
  MergerOptions o;
  app.add_option("-c,--config", config_file, "run config (TOML), e.g. configs/tiny.toml; merge policy in [merger]")->required()->check(CLI::ExistingFile);
  app.add_option("-s,--set", overrides, "override a config value: section.key=value (repeatable), e.g. --set merger.quorum=3");
  app.add_option("--id", o.instance_id, "instance id, stable across restarts (its Kafka transactional id: a restarted instance fences its predecessor)")->capture_default_str();
  app.add_option("--bootstrap", bootstrap, "Kafka bootstrap servers (default: $DILOCO_BOOTSTRAP or 127.0.0.1:19092)")->capture_default_str();
  double connect_timeout_s = o.kafka.connect_timeout_ms / 1000.0;
  app.add_option("--connect-timeout", connect_timeout_s, "seconds to wait for the broker at start before failing")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--bind", o.bind, "ZeroMQ PUB endpoint to bind ('*' as port picks a free one)")->capture_default_str();
  app.add_option("--advertise", o.advertise, "endpoint announced to learners in the members topic (default: the bound one)");
  app.add_option("--run-dir", o.run_dir, "folder for metrics.jsonl (created if missing; empty: no file)");
  app.add_option("--metrics-port", o.metrics_port, "serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: off)")->capture_default_str();
  app.add_option("--session-timeout-ms", o.session_timeout_ms, "consumer-group session timeout: how fast a dead instance's fragments move")->capture_default_str();
  app.add_flag("--static-membership,!--no-static-membership", o.static_membership,
               "join the group as a static member under --id: restarted after a crash it takes its fragments back at once; "
               "a clean stop then hands them over only after the session timeout")->capture_default_str();
  app.add_option("--merge-threads", o.merge_threads, "threads that share each merge's arithmetic (0: one per core); any number gives the same bits")->capture_default_str()->check(CLI::Range(0u, 256u));
  uint64_t snapshot_queue_mib = o.snapshot_queue_bytes >> 20;
  app.add_option("--snapshot-queue-mib", snapshot_queue_mib, "snapshots queued for subscribers and not yet sent, held in memory: past this, further requests wait their turn")->capture_default_str()->check(CLI::Range(uint64_t{1}, uint64_t{1} << 20));
  CLI11_PARSE(app, argc, argv);
  o.snapshot_queue_bytes = snapshot_queue_mib << 20;
  o.kafka.bootstrap_servers = bootstrap;
  o.kafka.client_id = o.instance_id;  // its readers' group ids begin with it (a secured broker's ACLs)
  o.kafka.connect_timeout_ms = static_cast<int>(connect_timeout_s * 1000);
  install_stop_handlers();
  return_large_buffers();
  try {
    o.config = load_run_config(config_file, overrides);
    return run_merger(o, stop_requested());
  } catch (const Error& e) {
    std::cerr << "diloco-merger: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "diloco-merger: internal error: " << e.what() << "\n";
    return 3;
  }
}
