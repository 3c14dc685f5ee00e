// A learner for bench/scale.sh --learner runtime: the real learner runtime (learner/runtime.h, what
// the Python Session and diloco-learner drive) over a model of the bench's layout, with a fake
// inner step. It registers host buffers for the tensors its fragments hold (zero pages, touched
// only where its fragments lie: a 12B layout costs only the fragments taken part in), fills them
// with seeded values, which the runtime proposes as version 0, and then runs --rounds x diloco.H
// inner steps; the first step of each round adds seeded noise (uniform, +-1e-3) to every value of
// its fragments, the others change nothing. The
// runtime cuts, quantizes with error feedback, publishes, adopts and announces, as for a real
// model.
//
//   bench-runtime_learner -c configs/tiny.toml --set run.id="X" [--tensors SPEC] [--only LIST]
//                         [--rounds 2] [--learner-id rt-0] [--region r0] [--bootstrap HOST:PORT]
//                         [--run-dir DIR] [--summary FILE] [--linger 600]
//
// After the last step it polls until it holds as many versions as it cut deltas (one learner,
// merger.quorum 1: one version per delta), or --linger seconds pass, then closes. With
// diloco.wait_steps = 0 (synchronous) every cut waits for its merge, so each delta is on the
// version its previous one made and none is superseded. Each version adopted is checked where it
// lands: the checksum of the fragment's values in the model's buffers right after adoption
// (overwrite, or a rebase with nothing trained since the cut: the received values exactly)
// against the merge log's (bench/scale.sh compares them with the audit). --summary writes what bench/scale.sh reads of bench-produce_deltas
// (deltas, wire bytes per delta, fp32 bytes per fragment) and of bench-subscribe (versions held
// with their checksums), plus the process's peak RSS.
#include <CLI/CLI.hpp>
#include <sys/resource.h>
#include <xxhash.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <thread>

#include <nlohmann/json.hpp>

#include "bench/bench_layout.h"
#include "core/config/run_config.h"
#include "core/errors.h"
#include "core/metrics/metrics.h"
#include "core/process.h"
#include "learner/runtime.h"

using namespace diloco;

namespace {

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};

// xorshift64*: a cheap seeded stream, uniform in [-1, 1) after scaling.
struct Noise {
  uint64_t s;
  float next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return static_cast<float>(static_cast<int64_t>(s * 0x2545F4914F6CDD1Dull) >> 40) * (1.0f / 8388608.0f);
  }
};

// XXH64 of fragment p's values in the buffers, in layout order: checksum_fp32 of its tensors.
uint64_t fragment_checksum(const FragmentLayout& layout, uint32_t p, const std::vector<RegisteredTensor>& tensors) {
  std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)> state(XXH64_createState(), &XXH64_freeState);
  XXH64_reset(state.get(), 0);
  for (const auto& piece : layout.pieces[p])
    if (piece.numel > 0) XXH64_update(state.get(), tensors[piece.tensor].host + piece.offset, piece.numel * 4);
  return XXH64_digest(state.get());
}

long max_rss_kib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench-runtime_learner: the learner runtime over a bench layout, with a fake inner step"};
  std::string config_file, region = "r0", summary, run_dir, tensors, only, learner_id = "rt-0", spill_dir;
  std::string bootstrap = default_bootstrap_servers();
  std::vector<std::string> overrides;
  uint64_t rounds = 2;
  double linger = 600;
  app.add_option("-c,--config", config_file, "run config (TOML)")->required()->check(CLI::ExistingFile);
  app.add_option("-s,--set", overrides, "override a config value: section.key=value (repeatable)");
  app.add_option("--tensors", tensors, "the model as NAME=D0xD1,... instead of the config's built-in one");
  app.add_option("--only", only, "take part in these fragments only (e.g. 0,3; default: all)");
  app.add_option("--rounds", rounds, "inner steps: rounds x diloco.H")->capture_default_str();
  app.add_option("--learner-id", learner_id, "learner id")->capture_default_str();
  app.add_option("--region", region, "region: deltas go to diloco.<run>.deltas.<region>")->capture_default_str();
  app.add_option("--bootstrap", bootstrap, "Kafka bootstrap servers")->capture_default_str();
  app.add_option("--run-dir", run_dir, "the runtime's metrics.jsonl goes here");
  app.add_option("--summary", summary, "write a JSON summary here");
  app.add_option("--spill-dir", spill_dir,
                 "keep the residuals and the values at a cut in files here, not in memory (RuntimeOptions::spill_dir)");
  app.add_option("--linger", linger, "seconds to wait after the last step for the versions of the last cuts")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  install_stop_handlers();
  return_large_buffers();
  try {
    const RunConfig config = load_run_config(config_file, overrides);
    const FragmentLayout layout = bench::bench_layout(config, tensors);
    const std::vector<uint32_t> fragments = bench::bench_fragments(layout, only);
    // Buffers for the tensors of the fragments taken part in only; calloc's zero pages cost
    // nothing until written.
    std::vector<bool> needed(layout.tensors.size(), false);
    for (uint32_t p : fragments)
      for (const auto& piece : layout.pieces[p]) needed[piece.tensor] = true;
    std::vector<std::unique_ptr<float, FreeDeleter>> memory;
    std::vector<RegisteredTensor> registered;
    for (size_t t = 0; t < layout.tensors.size(); ++t) {
      const auto& spec = layout.tensors[t];
      float* host = nullptr;
      if (needed[t]) {
        host = static_cast<float*>(std::calloc(static_cast<size_t>(spec.numel()), sizeof(float)));
        if (host == nullptr) throw InvalidInput("cannot allocate tensor '" + spec.name + "'");
        memory.emplace_back(host);
      }
      registered.push_back(RegisteredTensor{spec.name, spec.shape, host});
    }
    Noise noise{static_cast<uint64_t>(config.run.seed) * 0x9E3779B97F4A7C15ull + 1};
    int64_t parameters = 0;
    for (uint32_t p : fragments) {
      parameters += layout.fragment_numel(p);
      for (const auto& piece : layout.pieces[p]) {
        float* v = registered[piece.tensor].host + piece.offset;
        for (int64_t i = 0; i < piece.numel; ++i) v[i] = 0.02f * noise.next();
      }
    }
    std::cerr << "bench-runtime_learner: " << parameters << " parameters in " << fragments.size()
              << " fragment(s), peak RSS " << max_rss_kib() / 1024 << " MiB before the runtime\n";

    RuntimeOptions options{.config = config, .learner_id = learner_id, .region = region,
                           .kafka = {.bootstrap_servers = bootstrap, .client_id = learner_id},
                           .steps = static_cast<int64_t>(rounds * config.diloco.H),
                           .run_dir = run_dir, .client = "bench-runtime_learner",
                           .should_stop = [] { return stop_requested().load(); }, .fragments = fragments,
                           .spill_dir = spill_dir};
    LearnerRuntime runtime(std::move(options), registered);
    if (!runtime.start()) return 0;
    const uint64_t tokens = static_cast<uint64_t>(config.train.batch) * static_cast<uint64_t>(config.model.context);
    std::map<std::string, std::vector<nlohmann::json>> versions;  // fragment -> [version, checksum in the buffers]
    std::vector<uint64_t> known = runtime.versions();
    auto check_adopted = [&] {
      const std::vector<uint64_t> now = runtime.versions();
      for (uint32_t p : fragments) {
        if (now[p] == known[p]) continue;
        versions[std::to_string(p)].push_back({now[p], fragment_checksum(layout, p, registered)});
        known[p] = now[p];
      }
    };
    const auto t0 = std::chrono::steady_clock::now();
    double step_seconds = 0;
    const uint64_t steps = rounds * config.diloco.H;
    for (uint64_t s = 0; s < steps && !stop_requested(); ++s) {
      const auto s0 = std::chrono::steady_clock::now();
      if (s % config.diloco.H == 0)  // the training of a round, in its first step (touching 3 GB per step is slow)
        for (uint32_t p : fragments)
          for (const auto& piece : layout.pieces[p]) {
            float* v = registered[piece.tensor].host + piece.offset;
            for (int64_t i = 0; i < piece.numel; ++i) v[i] += 1e-3f * noise.next();
          }
      step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
      runtime.step({.tokens = tokens, .loss = 2.0f});
      check_adopted();
    }
    // With one learner and merger.quorum 1 every delta makes one version: wait for as many
    // versions (above version 0) as deltas were cut.
    auto waiting = [&] {
      uint64_t made = 0;
      for (uint32_t p : fragments) made += runtime.versions()[p];
      return static_cast<double>(made) < runtime.metrics().value("deltas_submitted_total");
    };
    const auto l0 = std::chrono::steady_clock::now();
    while (!stop_requested() && waiting() &&
           std::chrono::duration<double>(std::chrono::steady_clock::now() - l0).count() < linger) {
      runtime.poll();
      check_adopted();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const bool complete = !waiting();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double submitted = runtime.metrics().value("deltas_submitted_total");
    const double wire = runtime.metrics().value("delta_wire_bytes_total");
    runtime.close(stop_requested() ? "signal" : "budget");
    std::vector<int64_t> fp32_bytes;
    for (uint32_t p : fragments) fp32_bytes.push_back(layout.fragment_numel(p) * 4);
    nlohmann::json out{{"run", config.run.id},
                       {"learner", learner_id},
                       {"rounds", rounds},
                       {"steps", steps},
                       {"fragments", fragments.size()},
                       {"fragment_ids", fragments},
                       {"layout_fragments", layout.num_fragments()},
                       {"parameters", parameters},
                       {"fp32_bytes_per_fragment", fp32_bytes},
                       {"deltas", static_cast<uint64_t>(submitted)},
                       {"wire_bytes", static_cast<uint64_t>(wire)},
                       {"wire_bytes_per_delta", submitted > 0 ? static_cast<uint64_t>(wire / submitted) : 0},
                       {"versions", versions},
                       {"complete", complete},
                       {"fake_step_seconds", step_seconds},
                       {"seconds", seconds},
                       {"max_rss_kib", max_rss_kib()},
                       {"bytes_per_parameter", parameters > 0 ? max_rss_kib() * 1024.0 / static_cast<double>(parameters) : 0}};
    if (!summary.empty()) std::ofstream(summary) << out.dump() << "\n";
    std::cerr << "bench-runtime_learner: " << static_cast<uint64_t>(submitted) << " deltas, "
              << versions.size() << " fragment(s) adopted, peak RSS " << max_rss_kib() / 1024 << " MiB\n";
    return complete ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "bench-runtime_learner: error: " << e.what() << "\n";
    return 1;
  }
}
