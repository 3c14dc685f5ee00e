// Merge arithmetic on 1 and N threads: merge_step_in_place (RadialDirectional + Nesterov, the
// defaults) over one large fragment with K inputs, for an fp32 and an int4 downlink, with the
// inputs held as fp32 (decoded) or as they travel (int4 in blocks of 128, dequantized range by
// range during the merge, as the merger holds them). Prints a Markdown table and checks that
// every thread count and both input forms give the same checksum.
//
//   bench-merge [--params N] [--inputs K] [--runs R] [--threads "1 2"] [--kept-aggregate V]
//
// --kept-aggregate: MergeOptions::kept_aggregate_values (default kKeptAggregateValues, 16 Mi):
// RDA tensors above it are aggregated a range at a time, reading their inputs twice; 0 streams
// every tensor, the cost a fragment of tensors above 16 Mi values pays.
//
// Data: --params values (default 2^25 = 32 Mi, 128 MiB of fp32) in transformer-like tensors
// (an embedding, averaged; the rest RDA), gaussian deltas (seeded) quantized to int4; the fp32
// inputs are their dequantized values, so both forms merge the same numbers. Each timed run merges the same
// K deltas onto a fresh copy of the same state, so every thread count computes the same merge.
// Time = wall clock of one merge_step_in_place: norms, weighted sums, outer step, the downlink's
// quantization with error feedback, the checksum. Decoding and Kafka are not included. The
// checksum (xxh64, one thread) is also timed alone, once, on the last result.
//
// The memory-bandwidth bound, measured in the same run: a triad a[i] = b[i] + s c[i] over three
// arrays of --params floats on the same threads (ranges of 1 Mi values through the same
// WorkPool), 12 bytes per element as STREAM counts it (best of the runs). The least a merge must
// move per parameter: read and write the parameters and the outer momentum (16 bytes), the
// downlink's residual (int4: 8 more), read each input as held, and write the update (fp32: 4
// bytes; int4: half a byte and its scales). bound = bandwidth / those bytes: the merge's rate if
// it touched every byte once at the triad's speed; "x bound" is the merge's rate over it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/codec/messages.h"
#include "core/errors.h"
#include "core/parallel.h"
#include "core/process.h"
#include "merger/delta_tensors.h"
#include "merger/merge_step.h"

using namespace diloco;

namespace {

std::vector<TensorSpec> layout_of(size_t params) {
  // An embedding of 1/8, then square-ish blocks of 1/16 each, the remainder in the last tensor.
  std::vector<TensorSpec> layout{{"token_embedding", {static_cast<int64_t>(params / 8)}}};
  size_t left = params - params / 8;
  for (int i = 0; left > 0; ++i) {
    const size_t n = std::min(left, std::max<size_t>(1, params / 16));
    layout.push_back({"blocks." + std::to_string(i) + ".w", {static_cast<int64_t>(n)}});
    left -= n;
  }
  return layout;
}

std::vector<DenseTensor> random_tensors(const std::vector<TensorSpec>& layout, std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<DenseTensor> out;
  for (uint32_t t = 0; t < layout.size(); ++t) {
    DenseTensor tensor{t, layout[t].shape, std::vector<float>(static_cast<size_t>(layout[t].numel()))};
    for (auto& v : tensor.values) v = dist(rng);
    out.push_back(std::move(tensor));
  }
  return out;
}

// Bytes per second of the triad a = b + s c on `pool`'s threads: best of `runs`.
double triad_bandwidth(size_t n, WorkPool& pool, int runs) {
  std::vector<float> a(n), b(n, 1.0f), c(n, 2.0f);
  constexpr size_t kGrain = size_t{1} << 20;
  double best = 1e30;
  for (int r = 0; r < runs + 1; ++r) {  // the first run touches the pages: not counted
    const auto t0 = std::chrono::steady_clock::now();
    for_ranges(&pool, n, kGrain, [&](size_t, size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) a[i] = b[i] + 0.5f * c[i];
    });
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::min(best, seconds);
  }
  DILOCO_ENFORCE(a[n / 2] == 2.0f, "triad result");
  return static_cast<double>(3 * n * sizeof(float)) / best;
}

}  // namespace

int main(int argc, char** argv) {
  return_large_buffers();  // as the merger does, so its allocations cost here what they cost there
  size_t params = size_t{1} << 25;
  int inputs = 4, runs = 5;
  std::string thread_list = "1 2";
  size_t kept_aggregate = kKeptAggregateValues;
  const char* usage =
      "usage: bench-merge [--params N] [--inputs K] [--runs R] [--threads \"1 2\"] [--kept-aggregate V]\n";
  if (argc % 2 == 0) {  // every option takes a value: an odd one out is --help or a mistake
    const bool help = !std::strcmp(argv[argc - 1], "--help") || !std::strcmp(argv[argc - 1], "-h");
    std::fputs(usage, help ? stdout : stderr);
    return help ? 0 : 2;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--params")) params = std::strtoull(argv[i + 1], nullptr, 10);
    else if (!std::strcmp(argv[i], "--inputs")) inputs = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--runs")) runs = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--threads")) thread_list = argv[i + 1];
    else if (!std::strcmp(argv[i], "--kept-aggregate")) kept_aggregate = std::strtoull(argv[i + 1], nullptr, 10);
    else {
      std::fputs(usage, stderr);
      return 2;
    }
  }
  if (params == 0 || inputs < 1 || runs < 1) {
    std::fprintf(stderr, "bench-merge: --params, --inputs and --runs must be positive\n");
    return 2;
  }
  std::vector<unsigned> thread_counts;
  std::istringstream list(thread_list);
  for (unsigned t; list >> t;) thread_counts.push_back(t);
  if (thread_counts.empty()) thread_counts = {1};

  const auto layout = layout_of(params);
  std::mt19937 rng(42);
  FragmentState start;
  start.run_id = "bench";
  start.version = 10;
  start.params = random_tensors(layout, rng, 1.0f);
  start.momentum = random_tensors(layout, rng, 0.01f);
  constexpr uint32_t kInputBlock = 128;
  std::vector<DeltaTensors> as_sent, decoded;
  for (int i = 0; i < inputs; ++i) {
    std::vector<QuantizedTensor> q;
    std::vector<DenseTensor> dense = random_tensors(layout, rng, 1e-3f);
    for (auto& t : dense) {
      q.push_back(quantize(t.index, t.shape, t.values, DType::INT4, kInputBlock));
      dequantize(q.back(), t.values);
    }
    as_sent.emplace_back(std::move(q));
    decoded.emplace_back(std::move(dense));
  }
  auto merge_inputs = [&](const std::vector<DeltaTensors>& held) {
    std::vector<MergeInput> out;
    for (int i = 0; i < inputs; ++i) {
      DeltaRef ref;
      ref.learner_id = "learner-" + std::to_string(i);
      ref.base_version = start.version;
      ref.weight = 1.0;
      out.push_back({ref, held[static_cast<size_t>(i)]});
    }
    return out;
  };
  struct InputForm {
    const char* name;
    std::vector<MergeInput> inputs;
    size_t bytes;
  };
  const InputForm forms[] = {{"fp32", merge_inputs(decoded), decoded[0].bytes()},
                             {"int4/128 as sent", merge_inputs(as_sent), as_sent[0].bytes()}};

  std::printf("%zu parameters (%.1f MiB fp32) in %zu tensors, %d inputs, RadialDirectional + Nesterov, %d runs "
              "(median), hardware threads %u, RDA aggregates of up to %zu values held whole\n\n",
              params, static_cast<double>(params) * 4 / 1048576.0, layout.size(), inputs, runs,
              std::thread::hardware_concurrency(), kept_aggregate);
  std::vector<double> bandwidth;
  for (unsigned threads : thread_counts) {
    WorkPool pool(threads);
    bandwidth.push_back(triad_bandwidth(params, pool, runs));
    std::printf("triad bandwidth, %zu threads: %.2f GB/s\n", pool.threads(), bandwidth.back() / 1e9);
  }
  std::printf("\n| downlink | inputs | MiB held per input | threads | s per merge | of which checksum (1 thread) | "
              "M params/s | x first row | bytes moved at least per param | bound M params/s | x bound | checksum |\n"
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  bool same = true;
  for (const DownlinkCodec downlink : {DownlinkCodec{DType::F32, 0}, DownlinkCodec{DType::INT4, 64}}) {
    double one_thread = 0;
    uint64_t first_checksum = 0;
    for (const InputForm& form : forms) {
      for (size_t ti = 0; ti < thread_counts.size(); ++ti) {
        WorkPool pool(thread_counts[ti]);
        MergeOptions o{.tensors = layout, .downlink = downlink, .pool = &pool, .kept_aggregate_values = kept_aggregate};
        o.hyper.lr = 0.7f;
        o.hyper.momentum = 0.9f;
        std::vector<double> seconds;
        uint64_t checksum = 0;
        FragmentState state;
        for (int r = 0; r < runs; ++r) {
          state = start;
          const auto t0 = std::chrono::steady_clock::now();
          checksum = merge_step_in_place(state, form.inputs, o).checksum;
          seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(seconds.begin(), seconds.end());
        const double median = seconds[seconds.size() / 2];
        // The checksum's part (one thread whatever the pool): the same call again on the result.
        const auto c0 = std::chrono::steady_clock::now();
        const uint64_t again = checksum_fp32(state.params);
        const double checksum_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
        DILOCO_ENFORCE(again == checksum, "checksum_fp32 disagrees with the merge's checksum");
        if (one_thread == 0) {
          one_thread = median;
          first_checksum = checksum;
        }
        same = same && checksum == first_checksum;
        const bool int4 = downlink.dtype == DType::INT4;
        const double least = 16.0 + (int4 ? 8.0 : 0.0) +
                             inputs * static_cast<double>(form.bytes) / static_cast<double>(params) +
                             (int4 ? 0.5 + 4.0 / downlink.block_size : 4.0);
        const double bound = bandwidth[ti] / least;
        const double rate = static_cast<double>(params) / median;
        std::printf("| %s | %s | %.1f | %zu | %.3f | %.3f | %.1f | %.2f | %.2f | %.1f | %.2f | %016llx%s |\n",
                    dtype_name(downlink.dtype), form.name, static_cast<double>(form.bytes) / 1048576.0, pool.threads(),
                    median, checksum_seconds, rate / 1e6, one_thread / median, least, bound / 1e6, rate / bound,
                    static_cast<unsigned long long>(checksum), checksum == first_checksum ? "" : " DIFFERS");
      }
    }
  }
  std::printf("\n%s\n", same ? "every thread count and input form gave the same checksum"
                               : "CHECKSUMS DIFFER between thread counts or input forms");
  return same ? 0 : 1;
}
