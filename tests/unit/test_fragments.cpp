// Fragment layout: greedy LPT bin-packing of the model's tensors into P fragments, and its
// fingerprint.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <random>

#include "core/errors.h"
#include "core/fragments/partition.h"

using namespace diloco;

namespace {

// A GPT-like list: embeddings, per-layer matrices and vectors, a head.
std::vector<TensorSpec> gpt_like(int layers, int64_t width) {
  std::vector<TensorSpec> t{{"token_embedding", {96, width}}, {"position_embedding", {64, width}}};
  for (int i = 0; i < layers; ++i) {
    const std::string p = diloco::detail::concat("blocks.", i, ".");
    t.push_back({p + "attn_norm.weight", {width}});
    t.push_back({p + "attn.qkv.weight", {3 * width, width}});
    t.push_back({p + "attn.out.weight", {width, width}});
    t.push_back({p + "mlp.up.weight", {4 * width, width}});
    t.push_back({p + "mlp.down.weight", {width, 4 * width}});
  }
  t.push_back({"head.weight", {96, width}});
  return t;
}

int64_t total_numel(const std::vector<TensorSpec>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.numel();
  return n;
}

int64_t max_numel(const std::vector<TensorSpec>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) n = std::max(n, t.numel());
  return n;
}

}  // namespace

TEST_CASE("every tensor lands in exactly one fragment, in model order", "[fragments]") {
  const auto tensors = gpt_like(3, 32);
  for (uint32_t parts : {1u, 2u, 3u, 5u, 8u, static_cast<uint32_t>(tensors.size())}) {
    const auto layout = partition_tensors(tensors, parts, "arch");
    REQUIRE(layout.num_fragments() == parts);
    std::map<std::string, int> seen;
    for (uint32_t p = 0; p < parts; ++p) {
      REQUIRE_FALSE(layout.fragments[p].empty());
      size_t previous = 0;
      for (size_t i = 0; i < layout.fragments[p].size(); ++i) {
        const auto& spec = layout.fragments[p][i];
        ++seen[spec.name];
        const auto pos = static_cast<size_t>(
            std::find(tensors.begin(), tensors.end(), spec) - tensors.begin());
        REQUIRE(pos < tensors.size());  // name and shape are the model's
        if (i > 0) REQUIRE(pos > previous);
        previous = pos;
      }
    }
    REQUIRE(seen.size() == tensors.size());
    for (const auto& [name, count] : seen) REQUIRE(count == 1);
  }
}

TEST_CASE("fragments are balanced within the greedy LPT bound", "[fragments]") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<TensorSpec> tensors;
    const int n = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i)
      tensors.push_back({diloco::detail::concat("t", i), {1 + static_cast<int64_t>(rng() % 1000),
                                                   1 + static_cast<int64_t>(rng() % 8)}});
    const auto parts = 1 + static_cast<uint32_t>(rng() % n);
    const auto layout = partition_tensors(tensors, parts, "random");
    int64_t sum = 0;
    for (uint32_t p = 0; p < parts; ++p) {
      sum += layout.fragment_numel(p);
      REQUIRE(layout.fragment_numel(p) <= total_numel(tensors) / parts + max_numel(tensors));
    }
    REQUIRE(sum == total_numel(tensors));
  }
}

TEST_CASE("LPT places largest first into the smallest fragment, ties by name and index",
          "[fragments]") {
  // Taken as a(8), b(5), c(5), d(4), e(3): a -> 0; b -> 1 (0 < 8); c -> 1 (5 < 8);
  // d -> 0 (8 < 10); e -> 1 (10 < 12). Each fragment then lists its tensors in model order.
  const std::vector<TensorSpec> tensors{
      {"e", {3}}, {"c", {5}}, {"a", {8}}, {"d", {4}}, {"b", {5}}};
  const auto layout = partition_tensors(tensors, 2, "x");
  const auto names = [&](uint32_t p) {
    std::vector<std::string> out;
    for (const auto& t : layout.fragments[p]) out.push_back(t.name);
    return out;
  };
  CHECK(names(0) == std::vector<std::string>{"a", "d"});
  CHECK(names(1) == std::vector<std::string>{"e", "c", "b"});
}

TEST_CASE("layout and fingerprint are stable and sensitive", "[fragments]") {
  const auto tensors = gpt_like(2, 16);
  const auto a = partition_tensors(tensors, 4, "arch v1");
  const auto b = partition_tensors(tensors, 4, "arch v1");
  REQUIRE(a.fragments == b.fragments);
  REQUIRE(a.fingerprint == b.fingerprint);
  REQUIRE(a.fingerprint != 0);

  SECTION("another shape changes it") {
    auto changed = tensors;
    changed[3].shape[0] += 1;
    CHECK(partition_tensors(changed, 4, "arch v1").fingerprint != a.fingerprint);
  }
  SECTION("another name changes it") {
    auto changed = tensors;
    changed[3].name += "_";
    CHECK(partition_tensors(changed, 4, "arch v1").fingerprint != a.fingerprint);
  }
  SECTION("another architecture description changes it") {
    CHECK(partition_tensors(tensors, 4, "arch v2").fingerprint != a.fingerprint);
  }
  SECTION("another number of fragments changes it") {
    CHECK(partition_tensors(tensors, 3, "arch v1").fingerprint != a.fingerprint);
  }
  SECTION("another model order changes it") {
    auto changed = tensors;
    std::swap(changed[2], changed[3]);
    CHECK(partition_tensors(changed, 4, "arch v1").fingerprint != a.fingerprint);
  }
}

TEST_CASE("bad fragment counts and duplicate names are invalid input", "[fragments]") {
  const auto tensors = gpt_like(1, 8);
  CHECK_THROWS_AS(partition_tensors(tensors, 0, "x"), InvalidInput);
  CHECK_THROWS_AS(partition_tensors(tensors, static_cast<uint32_t>(tensors.size()) + 1, "x"),
                  InvalidInput);
  CHECK_THROWS_AS(partition_tensors({}, 1, "x"), InvalidInput);
  auto duplicated = tensors;
  duplicated.push_back(tensors.front());
  CHECK_THROWS_AS(partition_tensors(duplicated, 2, "x"), InvalidInput);
}
