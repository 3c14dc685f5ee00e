// A subscriber for bench/scale.sh: follows a run's mergers as a learner does (ParamInbox: the
// `members` topic for endpoints, a snapshot per fragment on request, then int4/int8 updates applied
// bit for bit and checked against their checksums), without a model. It records every version it
// holds, with the checksum of its own reconstruction, and when it first held every fragment.
//
//   bench-subscribe -c configs/tiny.toml --set run.id="X" [--bootstrap B] --summary FILE
//
// Runs until SIGINT/SIGTERM, then writes the summary (JSON): seconds from start to holding every
// fragment (the late joiner's snapshot time), versions per fragment as [version, checksum of the
// reconstruction, checksum the merger sent] (a version replaced before it was taken counts as
// skipped), ZeroMQ payload bytes received (all, and those of the snapshots and updates applied),
// messages received and rejected.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <map>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/config/run_config.h"
#include "core/errors.h"
#include "core/fragments/message_budget.h"
#include "core/kafka/topics.h"
#include "core/process.h"
#include "core/model/builtin_specs.h"
#include "bench/bench_layout.h"
#include "learner/param_inbox.h"

using namespace diloco;

int main(int argc, char** argv) {
  CLI::App app{"bench-subscribe: a model-less subscriber that reconstructs every version and records its checksum"};
  std::string config_file, summary, bootstrap = default_bootstrap_servers();
  std::vector<std::string> overrides;
  int poll_ms = 2;
  app.add_option("-c,--config", config_file, "run config (TOML)")->required()->check(CLI::ExistingFile);
  app.add_option("-s,--set", overrides, "override a config value: section.key=value (repeatable)");
  std::string tensors;
  app.add_option("--tensors", tensors, "the model as NAME=D0xD1,... (e.g. embed=128256x4096) instead of the config's built-in one");
  std::string only;
  app.add_option("--only", only, "only these fragments (e.g. 0,3) are expected: holding them is holding the model");
  app.add_option("--bootstrap", bootstrap, "Kafka bootstrap servers")->capture_default_str();
  app.add_option("--summary", summary, "write the JSON summary here at exit")->required();
  app.add_option("--poll-ms", poll_ms, "how often the held versions are taken")->capture_default_str()->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);
  install_stop_handlers();
  return_large_buffers();
  try {
    const RunConfig config = load_run_config(config_file, overrides);
    const FragmentLayout layout = bench::bench_layout(config, tensors);  // the layout only, no model
    const uint32_t P = layout.num_fragments();
    const std::vector<uint32_t> expected = bench::bench_fragments(layout, only);
    int64_t parameters = 0;
    for (uint32_t p : expected) parameters += layout.fragment_numel(p);
    Metrics metrics{"diloco_subscriber_"};
    const auto t0 = std::chrono::steady_clock::now();
    ParamInbox inbox(ParamInboxOptions{.kafka = {.bootstrap_servers = bootstrap, .client_id = "bench-subscribe"},
                                       .topics = RunTopics{config.run.id},
                                       .limits = run_decode_limits(config, layout)},
                     metrics);
    std::vector<uint64_t> known(P, 0);
    std::vector<bool> have(P, false);
    std::map<uint32_t, std::vector<nlohmann::json>> versions;
    uint64_t skipped = 0, mismatched = 0;
    double complete_at = -1;
    while (!stop_requested()) {
      for (const auto& taken : inbox.take(known)) {
        const FragmentParams& params = *taken;
        const uint32_t p = params.fragment;
        if (have[p] && params.version > known[p] + 1) skipped += params.version - known[p] - 1;
        const uint64_t rebuilt = checksum_fp32(params.tensors);
        mismatched += rebuilt != params.checksum;
        versions[p].push_back({params.version, rebuilt, params.checksum});
        known[p] = params.version;
        have[p] = true;
      }
      if (complete_at < 0 && std::all_of(expected.begin(), expected.end(), [&](uint32_t p) { return have[p]; })) {
        complete_at = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::cerr << "bench-subscribe: holding all " << expected.size() << " fragments after " << complete_at << " s\n";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(poll_ms));
    }
    nlohmann::json out{{"fragments", expected.size()},
                       {"layout_fragments", P},
                       {"parameters", parameters},
                       {"complete_seconds", complete_at},
                       {"bytes_received", inbox.bytes_received()},
                       {"snapshots", inbox.snapshots()},
                       {"snapshot_bytes", inbox.snapshot_bytes()},
                       {"updates", inbox.updates()},
                       {"update_bytes", inbox.update_bytes()},
                       {"received", inbox.received()},
                       {"rejected", inbox.rejected()},
                       {"skipped", skipped},
                       {"mismatched", mismatched},
                       {"versions", nlohmann::json::object()}};
    for (const auto& [p, list] : versions) out["versions"][std::to_string(p)] = list;
    std::ofstream(summary) << out.dump() << "\n";
    return mismatched == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "bench-subscribe: " << e.what() << "\n";
    return 2;
  }
}
