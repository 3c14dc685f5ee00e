// The bench tools' --tensors option (bench/bench_layout.h): the shapes a user writes, and the
// layout a learner registering them would make. Expected values are worked out by hand.
#include <catch2/catch.hpp>

#include "bench/bench_layout.h"
#include "core/errors.h"

using namespace diloco;
using Catch::Matchers::Contains;

TEST_CASE("--tensors reads NAME=D0xD1 items, comma-separated", "[bench]") {
  const auto specs = bench::parse_tensors("embed=128256x4096,final_norm=4096,scale=1");
  REQUIRE(specs.size() == 3);
  CHECK(specs[0] == TensorSpec{"embed", {128256, 4096}});
  CHECK(specs[1] == TensorSpec{"final_norm", {4096}});
  CHECK(specs[2] == TensorSpec{"scale", {1}});
  CHECK(specs[0].numel() == 525336576);
}

TEST_CASE("--tensors refuses an item that is not NAME=D0xD1 with positive dimensions", "[bench]") {
  for (const char* bad : {"embed", "=4x4", "a=", "a=4,", ",a=4", "a=4xx4", "a=4x", "a=-1", "a=4.5", "a=1234567890123"}) {
    INFO(bad);
    CHECK_THROWS_AS(bench::parse_tensors(bad), InvalidInput);
  }
  // A dimension of 0 is not a positive integer: such a tensor holds nothing to train.
  CHECK_THROWS_WITH(bench::parse_tensors("a=4x0"), Contains("dimension '0' is not a positive integer"));
}

TEST_CASE("a --tensors tensor larger than a fragment is cut into blocks of rows", "[bench]") {
  RunConfig config;
  config.diloco.fragments = 3;
  // 12 x 4 = 48 parameters and 4 more: 52 over 3 fragments; the 12 rows of "embed" cannot sit in
  // one fragment of a balanced layout, so it is cut, and every row is held exactly once.
  const FragmentLayout layout = bench::bench_layout(config, "embed=12x4,norm=4");
  REQUIRE(layout.num_fragments() == 3);
  CHECK(layout.numel() == 52);
  int64_t held = 0, embed_rows = 0;
  for (uint32_t p = 0; p < 3; ++p) {
    held += layout.fragment_numel(p);
    for (const auto& piece : layout.pieces[p])
      if (piece.tensor == 0) embed_rows += piece.rows;
  }
  CHECK(held == 52);
  CHECK(embed_rows == 12);
  CHECK(layout.fragments[0].front().name.starts_with("embed["));
}

TEST_CASE("--only lists fragments of the layout, each once; empty is every fragment", "[bench]") {
  const FragmentLayout layout =
      partition_tensors(std::vector<TensorSpec>{{"a", {8, 4}}, {"b", {8, 4}}, {"c", {8, 4}}, {"d", {8, 4}}}, 4);
  REQUIRE(layout.num_fragments() == 4);
  CHECK(bench::bench_fragments(layout, "") == std::vector<uint32_t>{0, 1, 2, 3});
  CHECK(bench::bench_fragments(layout, "3,0") == std::vector<uint32_t>{3, 0});
  for (const char* bad : {"4", "a", "0,", ",1", "-1", "1.0", "1234567890", "0,,1"}) {
    INFO(bad);
    CHECK_THROWS_WITH(bench::bench_fragments(layout, bad), Contains("is not a fragment of the layout (0 to 3)"));
  }
  CHECK_THROWS_WITH(bench::bench_fragments(layout, "1,2,1"), Contains("--only: fragment 1 is listed twice"));
}
