// Codec throughput and size on 64 MiB of fp32 deltas, one thread. Prints a Markdown table.
//
//   bench-codec [--runs N] [--seed S] [--deltas FILE.safetensors]... [--topk K] [--block B]
//
// Data: gaussian deltas in five tensors of transformer-like shapes, each with its own standard
// deviation (seeded, deterministic); or, with --deltas, the fp32 tensors of a safetensors file
// (e.g. a real outer gradient from `diloco-replay dump`; repeat --deltas to join the fragments of
// one round), as one fragment. Top-k rows keep K of
// each block of B (default 96 of 1024, configs/demo.toml) with error feedback, in the dense form
// (zstd removes the zeros) and in the sparse form (core/codec/sparse.h). Encode = quantize + byte-shuffle + FlatBuffer + zstd
// (encode_delta on dense tensors, level 1); decode = bounded zstd + verify + all strict checks +
// unshuffle + dequantize (decode_delta into a reused Delta, as a merger decoding delta after
// delta does; "fresh" = the allocating decode_delta, which page-faults its 64 MiB every time).
// Throughput is fp32 bytes per second (input of encode, output of decode), MB = 10^6 bytes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/codec/compress.h"
#include "core/codec/messages.h"
#include "core/errors.h"
#include "core/files/safetensors.h"

using namespace diloco;

namespace {

struct Shape {
  const char* name;
  std::vector<int64_t> dims;
  float stddev;
};

// 16 Mi values = 64 MiB of fp32.
const std::vector<Shape> kShapes = {
    {"tok_embed", {8192, 512}, 2e-3f},   {"attn_qkv", {2048, 2048}, 8e-4f},
    {"attn_out", {2048, 1024}, 5e-4f},   {"mlp_in", {1024, 2048}, 6e-4f},
    {"mlp_out", {4096, 1024}, 3e-4f},
};

struct Stats {
  double best = 0, median = 0;  // seconds
};

template <typename F>
Stats time_runs(int runs, F&& f) {
  std::vector<double> t;
  for (int r = 0; r < runs; ++r) {
    const auto start = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return {t.front(), t[t.size() / 2]};
}

double mbps(size_t bytes, double seconds) { return static_cast<double>(bytes) / seconds / 1e6; }

}  // namespace

int main(int argc, char** argv) {
  int runs = 7;
  unsigned seed = 42;
  std::vector<std::string> deltas_files;
  uint32_t topk = 96, topk_block = 1024;
  const char* usage = "usage: bench-codec [--runs N] [--seed S] [--deltas FILE.safetensors]... [--topk K] [--block B]\n";
  if (argc % 2 == 0) {  // every option takes a value: an odd one out is --help or a mistake
    const bool help = !std::strcmp(argv[argc - 1], "--help") || !std::strcmp(argv[argc - 1], "-h");
    std::fputs(usage, help ? stdout : stderr);
    return help ? 0 : 2;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--runs")) runs = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--seed")) seed = static_cast<unsigned>(std::atoi(argv[i + 1]));
    else if (!std::strcmp(argv[i], "--deltas")) deltas_files.emplace_back(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--topk")) topk = static_cast<uint32_t>(std::atoi(argv[i + 1]));
    else if (!std::strcmp(argv[i], "--block")) topk_block = static_cast<uint32_t>(std::atoi(argv[i + 1]));
    else {
      std::fprintf(stderr, "unknown option %s\n%s", argv[i], usage);
      return 2;
    }
  }

  FragmentLayout layout;
  layout.fingerprint = 0x5eed;
  layout.fragments.emplace_back();
  std::vector<DenseTensor> tensors;
  size_t numel = 0;
  const auto add_tensor = [&](std::string name, std::vector<int64_t> shape, std::vector<float> values) {
    layout.fragments[0].push_back({std::move(name), shape});
    tensors.push_back({static_cast<uint32_t>(tensors.size()), std::move(shape), std::move(values)});
    numel += tensors.back().values.size();
  };
  if (!deltas_files.empty()) {
    for (const auto& file : deltas_files) {
      for (auto& t : load_safetensors(file).tensors)
        if (!t.values.empty()) add_tensor(t.name, t.shape, std::move(t.values));
      std::printf("deltas from %s\n", file.c_str());
    }
  } else {
    std::mt19937_64 rng(seed);
    for (const auto& s : kShapes) {
      int64_t n = 1;
      for (auto d : s.dims) n *= d;
      std::vector<float> values(static_cast<size_t>(n));
      std::normal_distribution<float> dist(0.0f, s.stddev);
      for (auto& v : values) v = dist(rng);
      add_tensor(s.name, s.dims, std::move(values));
    }
    std::printf("gaussian deltas, seed %u\n", seed);
  }
  const size_t fp32_bytes = numel * 4;

  DeltaHeader header;
  header.run_id = "bench";
  header.fingerprint = layout.fingerprint;
  header.learner_id = "learner-0";
  header.region = "local";
  header.seq = 1;
  header.inner_steps = 100;
  header.tokens = 100 * 4096;
  DecodeLimits limits;
  limits.run_id = header.run_id;
  limits.fingerprint = layout.fingerprint;
  limits.layout = &layout;

  // Ceiling: copy the same bytes between two pre-faulted buffers.
  std::vector<float> copy(numel, 1.0f);
  const Stats memcpy_time = time_runs(runs, [&] {
    size_t off = 0;
    for (const auto& t : tensors) {
      std::memcpy(copy.data() + off, t.values.data(), t.values.size() * 4);
      off += t.values.size();
    }
  });

  std::printf("%zu values (%.1f MiB fp32) in %zu tensors, %d runs, single thread\n\n", numel,
              fp32_bytes / 1048576.0, tensors.size(), runs);
  std::printf("| codec | shuffle | wire bytes | bytes/param | wire/fp32 "
              "| encode MB/s best (median) | decode MB/s best (median) | decode fresh MB/s |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---:|\n");
  std::printf("| memcpy (ceiling) | - | %zu | 4.000 | 1.000 | %.0f (%.0f) | - | - |\n", fp32_bytes,
              mbps(fp32_bytes, memcpy_time.best), mbps(fp32_bytes, memcpy_time.median));

  const std::span<const DenseTensor> dense(tensors);
  for (DType dtype : {DType::F32, DType::BF16, DType::INT8, DType::INT4}) {
    for (bool shuffle : {false, true}) {
      CodecOptions options;
      options.dtype = dtype;
      options.byte_shuffle = shuffle;
      std::vector<uint8_t> wire;
      const Stats enc = time_runs(runs, [&] { wire = encode_delta(header, dense, options); });
      Delta reused;
      const Stats dec = time_runs(runs, [&] { decode_delta(wire, limits, reused); });
      const Stats fresh =
          time_runs(std::max(1, runs / 2), [&] { (void)decode_delta(wire, limits); });
      std::printf("| %s | %s | %zu | %.3f | %.4f | %.0f (%.0f) | %.0f (%.0f) | %.0f |\n",
                  dtype_name(dtype), shuffle ? "yes" : "no", wire.size(),
                  static_cast<double>(wire.size()) / numel,
                  static_cast<double>(wire.size()) / fp32_bytes, mbps(fp32_bytes, enc.best),
                  mbps(fp32_bytes, enc.median), mbps(fp32_bytes, dec.best),
                  mbps(fp32_bytes, dec.median), mbps(fp32_bytes, fresh.best));
    }
  }

  // The learner's path: error feedback (quantize + dequantize into the residual), then encode
  // the quantized tensors; decode = decode_delta into a reused Delta (fp32 out).
  // The same with top-k (configs/demo.toml: 96 of each block of 1024, int4, zstd 15): in the dense
  // form (as before the sparse form existed: zstd removes the zeros) and in the sparse form.
  struct FeedbackRow {
    DType dtype;
    uint32_t block_size, topk;
    int zstd_level;
    bool sparse;
  };
  const CodecOptions defaults;
  const std::vector<FeedbackRow> feedback_rows = {
      {DType::INT8, defaults.block_size, 0, defaults.zstd_level, false},
      {DType::INT4, defaults.block_size, 0, defaults.zstd_level, false},
      {DType::INT4, topk_block, topk, 15, false},
      {DType::INT4, topk_block, topk, 3, false},
      {DType::INT4, topk_block, topk, 1, false},
      {DType::INT4, topk_block, topk, 15, true},
      {DType::INT4, topk_block, topk, 3, true},
      {DType::INT4, topk_block, topk, 1, true},
      {DType::INT8, topk_block, topk, 1, true}};
  for (const FeedbackRow& row : feedback_rows) {
    CodecOptions options;
    options.dtype = row.dtype;
    options.block_size = row.block_size;
    options.topk = row.sparse ? row.topk : 0;  // quantized tensors with topk > 0 travel sparse
    options.zstd_level = row.zstd_level;
    std::vector<ErrorFeedback> feedback;
    for (const auto& t : tensors) feedback.emplace_back(static_cast<int64_t>(t.values.size()));
    std::vector<uint8_t> wire;
    std::vector<QuantizedTensor> q(tensors.size());
    const Stats enc = time_runs(runs, [&] {
      for (size_t k = 0; k < tensors.size(); ++k)
        q[k] = feedback[k].push(tensors[k].index, tensors[k].shape, tensors[k].values, row.dtype, row.block_size,
                                row.topk);
      wire = encode_delta(header, std::span<const QuantizedTensor>(q), options);
    });
    Delta reused;
    const Stats dec = time_runs(runs, [&] { decode_delta(wire, limits, reused); });
    // The decoded values are the quantized ones, bit for bit, whatever the form.
    for (size_t k = 0; k < tensors.size(); ++k) {
      std::vector<float> want(tensors[k].values.size());
      dequantize(q[k], want);
      if (std::memcmp(want.data(), reused.tensors[k].values.data(), want.size() * 4) != 0) {
        std::fprintf(stderr, "tensor %zu decodes to other values\n", k);
        return 1;
      }
    }
    const std::string name =
        row.topk ? detail::concat(dtype_name(row.dtype), " + error feedback, top-k ", row.topk, "/", row.block_size,
                                  row.sparse ? ", sparse" : ", dense", ", zstd ", row.zstd_level)
                 : detail::concat(dtype_name(row.dtype), " + error feedback");
    std::printf("| %s | no | %zu | %.4f | %.4f | %.0f (%.0f) | %.0f (%.0f) | - |\n", name.c_str(), wire.size(),
                static_cast<double>(wire.size()) / numel, static_cast<double>(wire.size()) / fp32_bytes,
                mbps(fp32_bytes, enc.best), mbps(fp32_bytes, enc.median), mbps(fp32_bytes, dec.best),
                mbps(fp32_bytes, dec.median));
  }

  // Where top-k time goes (int4, sparse, zstd 1): error feedback with the selection alone, then
  // encode_delta of its result (sparse packing + FlatBuffer + zstd), MB/s of fp32.
  {
    std::vector<ErrorFeedback> feedback;
    for (const auto& t : tensors) feedback.emplace_back(static_cast<int64_t>(t.values.size()));
    std::vector<QuantizedTensor> q(tensors.size());
    const Stats select_time = time_runs(runs, [&] {
      for (size_t k = 0; k < tensors.size(); ++k)
        q[k] = feedback[k].push(tensors[k].index, tensors[k].shape, tensors[k].values, DType::INT4, topk_block, topk);
    });
    CodecOptions options;
    options.dtype = DType::INT4;
    options.block_size = topk_block;
    options.topk = topk;
    std::vector<uint8_t> wire;
    const Stats pack_time =
        time_runs(runs, [&] { wire = encode_delta(header, std::span<const QuantizedTensor>(q), options); });
    std::printf("\ntop-k %u/%u int4 stages, MB/s of fp32:\n\n", topk, topk_block);
    std::printf("| error feedback + selection + quantize | sparse pack + FlatBuffer + zstd 1 |\n|---:|---:|\n");
    std::printf("| %.0f | %.0f |\n\n", mbps(fp32_bytes, select_time.best), mbps(fp32_bytes, pack_time.best));
  }

  // Where int4 time goes: each stage alone, MB/s of fp32 values (best of the runs).
  CodecOptions int4;
  const auto frame = encode_delta(header, dense, int4);
  const auto flatbuffer = zstd_decompress_bounded(frame, 1ull << 30);
  std::vector<std::vector<float>> scales(tensors.size());
  std::vector<std::vector<uint8_t>> payload(tensors.size());
  for (size_t k = 0; k < tensors.size(); ++k) {
    const auto n = static_cast<int64_t>(tensors[k].values.size());
    scales[k].resize(num_blocks(DType::INT4, int4.block_size, n));
    payload[k].resize(payload_bytes(DType::INT4, n));
  }
  const Stats quantize_time = time_runs(runs, [&] {
    for (size_t k = 0; k < tensors.size(); ++k)
      quantize_into(tensors[k].values, DType::INT4, int4.block_size, scales[k], payload[k]);
  });
  const Stats dequantize_time = time_runs(runs, [&] {
    size_t off = 0;
    for (size_t k = 0; k < tensors.size(); ++k) {
      const std::span<float> out(copy.data() + off, tensors[k].values.size());
      dequantize_into(DType::INT4, int4.block_size, scales[k], payload[k], out);
      off += out.size();
    }
  });
  const Stats compress_time = time_runs(runs, [&] { (void)zstd_compress(flatbuffer, 1); });
  std::vector<uint8_t> out;
  const Stats decompress_time =
      time_runs(runs, [&] { zstd_decompress_bounded_into(frame, 1ull << 30, out); });
  std::printf("\nint4 stages (block %u, %zu-byte FlatBuffer, %zu-byte frame), MB/s of fp32:\n\n",
              int4.block_size, flatbuffer.size(), frame.size());
  std::printf("| quantize | zstd level 1 compress | zstd decompress | dequantize |\n");
  std::printf("|---:|---:|---:|---:|\n");
  std::printf("| %.0f | %.0f | %.0f | %.0f |\n", mbps(fp32_bytes, quantize_time.best),
              mbps(fp32_bytes, compress_time.best), mbps(fp32_bytes, decompress_time.best),
              mbps(fp32_bytes, dequantize_time.best));
  return 0;
}
