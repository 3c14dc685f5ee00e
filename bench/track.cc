// What a spill directory costs a learner: a cut (FragmentTrack::cut_from: anchor - model plus the
// carried residual, int4 with error feedback, the values at the cut kept) and the adoption after
// it (rebase_into: the residual of the cut computed again, the model rebased onto the next
// version), on one fragment of --params values, with the residual and the values at the cut in
// memory and in --spill-dir, alternating (memory, spill, memory, spill, ...) for --runs pairs.
// Prints each run's seconds and the process's peak RSS, and checks that both give the same bits.
//
//   bench-track --spill-dir DIR [--params N] [--runs R] [--tensors T]
//
// Data: T tensors of N / T values (default 2^27 = 128 Mi values, 512 MiB of fp32, in 4 tensors),
// gaussian (seeded). Time = wall clock of one call, one thread. A spilled store's written pages go
// to the page cache and are written back by the kernel: that writeback happens after the call
// and is not in its time (it is in the disk's time, and in the next call's when memory is short).
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/codec/messages.h"
#include "core/errors.h"
#include "learner/fragment_track.h"

using namespace diloco;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

long max_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024;
}

uint64_t bits_of(const std::vector<std::vector<float>>& values) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& v : values)
    for (float x : v) {
      uint32_t b;
      std::memcpy(&b, &x, 4);
      h = (h ^ b) * 1099511628211ull;
    }
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  size_t params = size_t{1} << 27, tensors = 4;
  int runs = 2;
  std::string spill_dir;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--params") params = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--runs") runs = std::atoi(argv[i + 1]);
    else if (a == "--tensors") tensors = std::strtoull(argv[i + 1], nullptr, 10);
    else if (a == "--spill-dir") spill_dir = argv[i + 1];
    else {
      std::fprintf(stderr, "bench-track: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (spill_dir.empty() || tensors == 0 || params < tensors || runs < 1) {
    std::fprintf(stderr, "usage: bench-track --spill-dir DIR [--params N] [--runs R] [--tensors T]\n");
    return 2;
  }
  const size_t per = params / tensors;
  std::mt19937_64 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  auto make = [&](float scale) {
    std::vector<DenseTensor> out;
    for (uint32_t t = 0; t < tensors; ++t) {
      DenseTensor d{t, {static_cast<int64_t>(per)}, std::vector<float>(per)};
      for (auto& v : d.values) v = scale * dist(rng);
      out.push_back(std::move(d));
    }
    return out;
  };
  const auto anchor = make(1.0f), next = make(1.0f);
  std::vector<DenseTensor> model = make(1.0f);
  const auto trained = model;
  std::printf("bench-track: %zu values in %zu tensors (%.0f MiB of fp32), int4 blocks of 64; spill dir %s\n\n",
              per * tensors, tensors, static_cast<double>(per * tensors) * 4 / (1 << 20), spill_dir.c_str());
  std::printf("| run | where | cut s | adoption (rebase) s | checksum of the model after |\n|---|---|---|---|---|\n");
  uint64_t expected = 0;
  for (int r = 0; r < 2 * runs; ++r) {
    const bool spill = r % 2 == 1;
    for (size_t t = 0; t < tensors; ++t) model[t].values = trained[t].values;
    FragmentTrack f(anchor, 0, 0, spill ? spill_dir : std::string());
    f.count_step(1);
    FragmentTrack::Model view;
    for (auto& t : model) view.emplace_back(t.values);
    auto t0 = std::chrono::steady_clock::now();
    const CutDelta d = f.cut_from(view, DType::INT4, 64);
    const double cut_s = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    f.rebase_into(1, 0, std::make_shared<const std::vector<DenseTensor>>(next), view);
    const double adopt_s = seconds_since(t0);
    std::vector<std::vector<float>> after;
    for (const auto& t : model) after.push_back(t.values);
    for (const auto& c : f.carried_residual()) after.push_back(c);
    const uint64_t sum = bits_of(after);
    if (r == 0) expected = sum;
    std::printf("| %d | %s | %.3f | %.3f | %016llx%s |\n", r / 2 + 1, spill ? "spilled" : "memory", cut_s, adopt_s,
                static_cast<unsigned long long>(sum), sum == expected ? "" : " DIFFERS");
    if (sum != expected) return 1;
    (void)d;
  }
  std::printf("\npeak RSS %ld MiB\n", max_rss_mib());
  return 0;
}
