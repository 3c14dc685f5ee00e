// diloco-learner: one island of compute training the built-in model. See
// learner/builtin/builtin_learner.h, learner/runtime.h and ARCHITECTURE.md section 5.
#include <CLI/CLI.hpp>

#include <iostream>
#include <sstream>

#include "core/config/config_json.h"
#include "core/errors.h"
#include "core/process.h"
#include "learner/builtin/builtin_learner.h"

using namespace diloco;

namespace {

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "diloco-learner: trains the shared model on its own data shard, publishes per-fragment deltas\n"
      "(outer gradients) to Kafka on the streaming schedule, and adopts global fragments from the\n"
      "mergers at step boundaries. It never waits for the network.\n"};
  std::string config_file, regions = "region0", endpoints, bootstrap = default_bootstrap_servers();
  std::vector<std::string> overrides;
  BuiltinLearnerOptions b;
  RuntimeOptions& o = b.runtime;
  bool standalone = false, no_publish = false, eval_only = false;
  app.add_option("-c,--config", config_file, "run config (TOML), e.g. configs/tiny.toml")->required()->check(CLI::ExistingFile);
  app.add_option("-s,--set", overrides, "override a config value: section.key=value (repeatable), e.g. --set train.lr=1e-3");
  app.add_option("--id", o.learner_id, "learner id, unique in the run (Kafka header, membership key)")->capture_default_str();
  app.add_option("--region", o.region, "this learner's region: its deltas go to topic diloco.<run>.deltas.<region>")->capture_default_str();
  app.add_option("--regions", regions, "every region of the run, comma-separated (data.split=region gives each its own books)")->capture_default_str();
  app.add_option("--index", o.index, "this learner's index in [0, --learners): data shard (and schedule stagger with diloco.stagger)")->capture_default_str();
  app.add_option("--learners", o.learners, "number of learners sharing the training data")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--bootstrap", bootstrap, "Kafka bootstrap servers (default: $DILOCO_BOOTSTRAP or 127.0.0.1:19092)")->capture_default_str();
  double connect_timeout_s = o.kafka.connect_timeout_ms / 1000.0;
  app.add_option("--connect-timeout", connect_timeout_s, "seconds to wait for the broker at start before failing")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--merger", endpoints, "extra merger ZeroMQ endpoints, comma-separated (normally learned from the members topic)");
  app.add_flag("--standalone", standalone, "no Kafka, no ZeroMQ: train alone (the single-learner baseline)");
  app.add_flag("--no-publish", no_publish, "train and adopt global fragments but never send deltas (to measure publishing overhead)");
  app.add_flag("--eval-only", eval_only, "never train: follow the global fragments and report the global model's held-out loss");
  app.add_option("--eval-interval", b.eval_interval_s, "--eval-only: seconds between evaluations")->capture_default_str();
  app.add_option("--speed-factor", b.speed_factor, "slow every step by this factor (2 = half speed) to emulate older hardware")->capture_default_str()->check(CLI::Range(1.0, 1000.0));
  app.add_option("--steps", b.steps, "stop after this many inner steps (default: train.total_steps)");
  app.add_option("--max-seconds", b.max_seconds, "stop after this many seconds (0: no limit)")->capture_default_str();
  app.add_option("--spill-dir", o.spill_dir, "keep the error-feedback residuals and the values at each cut in files in this existing directory (8 bytes per parameter) instead of memory");
  app.add_option("--run-dir", o.run_dir, "folder for metrics.jsonl (created if missing; empty: no file)");
  app.add_option("--export", b.export_path, "write the model to this safetensors file at stop (--eval-only: the global model, refreshed after every evaluation); read it with diloco-sample");
  app.add_option("--metrics-port", o.metrics_port, "serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: off)")->capture_default_str();
  app.add_option("--log-every", o.log_every, "inner steps between metrics lines")->capture_default_str();
  bool print_config = false;
  app.add_flag("--print-config", print_config, "print the resolved config (file, --set, defaults) as JSON and exit");
  CLI11_PARSE(app, argc, argv);
  if (print_config) {
    try {
      std::cout << run_config_json(load_run_config(config_file, overrides)).dump(1) << "\n";
      return 0;
    } catch (const Error& e) {
      std::cerr << "diloco-learner: error: " << e.what() << "\n";
      return 1;
    }
  }

  int modes = standalone + no_publish + eval_only;
  if (modes > 1) {
    std::cerr << "error: --standalone, --no-publish and --eval-only exclude each other\n";
    return 2;
  }
  o.mode = standalone ? LearnerMode::Standalone
           : no_publish ? LearnerMode::NoPublish
           : eval_only  ? LearnerMode::EvalOnly
                        : LearnerMode::Train;
  b.regions = split_list(regions);
  o.merger_endpoints = split_list(endpoints);
  o.kafka.bootstrap_servers = bootstrap;
  o.kafka.connect_timeout_ms = static_cast<int>(connect_timeout_s * 1000);
  o.kafka.client_id = o.learner_id;
  if (o.index >= o.learners) {
    std::cerr << "error: --index " << o.index << " must be below --learners " << o.learners << "\n";
    return 2;
  }
  install_stop_handlers();
  try {
    o.config = load_run_config(config_file, overrides);
    return run_builtin_learner(b, stop_requested());
  } catch (const Error& e) {
    std::cerr << "diloco-learner: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "diloco-learner: internal error: " << e.what() << "\n";
    return 3;
  }
}
