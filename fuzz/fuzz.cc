#include "fuzz/fuzz.h"

#include <cstdio>
#include <cstdlib>

#include "core/codec/compress.h"
#include "core/config/run_config.h"
#include "core/fragments/message_budget.h"
#include "core/fragments/partition.h"

namespace diloco::fuzz {

const FragmentLayout& layout() {
  static const FragmentLayout layout = [] {
    const std::vector<TensorSpec> tensors{
        {"blocks.0.attn", {4, 33}}, {"blocks.0.norm", {7}}, {"blocks.0.mlp", {3, 1, 5}}, {"head", {2, 2}}};
    return partition_tensors(tensors, 2);
  }();
  return layout;
}

std::shared_ptr<const FragmentLayout> shared_layout() {
  return std::shared_ptr<const FragmentLayout>(&layout(), [](const FragmentLayout*) {});
}

const DecodeLimits& limits(bool with_layout) {
  static const auto both = [] {
    RunConfig config;
    config.run.id = "run-1";
    std::pair<DecodeLimits, DecodeLimits> out{run_decode_limits(config, layout()), {}};
    out.second = out.first;
    out.second.layout = nullptr;
    return out;
  }();
  return with_layout ? both.first : both.second;
}

Framed frame(const uint8_t* data, size_t size) {
  Framed out;
  if (size == 0) return out;
  out.mode = data[0];
  const std::span<const uint8_t> rest(data + 1, size - 1);
  if (out.mode & kCompressHere) out.bytes = zstd_compress(rest, 1);
  else out.bytes.assign(rest.begin(), rest.end());
  return out;
}

std::vector<uint8_t> seed(std::span<const uint8_t> message, uint8_t mode) {
  std::vector<uint8_t> out{mode};
  if (mode & kCompressHere) {
    const auto plain = zstd_decompress_bounded(message, limits().max_decompressed_bytes);
    out.insert(out.end(), plain.begin(), plain.end());
  } else {
    out.insert(out.end(), message.begin(), message.end());
  }
  return out;
}

void finding(const std::string& what) {
  std::fprintf(stderr, "\n==fuzz finding== %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace diloco::fuzz
