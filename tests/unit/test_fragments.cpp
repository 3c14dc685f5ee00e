// Fragment layout: greedy LPT bin-packing of the model's tensors into P fragments, and its
// fingerprint.
#include <catch2/catch.hpp>
#include <xxhash.h>

#include <algorithm>
#include <map>
#include <random>

#include "core/errors.h"
#include "core/fragments/partition.h"

using namespace diloco;
using Catch::Matchers::Contains;

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

TEST_CASE("every row of every tensor lands in exactly one fragment, in model order", "[fragments]") {
  const auto tensors = gpt_like(3, 32);
  for (uint32_t parts : {1u, 2u, 3u, 5u, 8u, static_cast<uint32_t>(tensors.size()), 40u}) {
    const auto layout = partition_tensors(tensors, parts);
    REQUIRE(layout.num_fragments() == parts);
    REQUIRE(layout.pieces.size() == parts);
    std::vector<std::vector<int>> rows_seen(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) rows_seen[i].assign(static_cast<size_t>(tensors[i].shape[0]), 0);
    for (uint32_t p = 0; p < parts; ++p) {
      REQUIRE_FALSE(layout.fragments[p].empty());
      REQUIRE(layout.pieces[p].size() == layout.fragments[p].size());
      std::pair<uint32_t, int64_t> previous{0, -1};
      for (size_t i = 0; i < layout.fragments[p].size(); ++i) {
        const auto& spec = layout.fragments[p][i];
        const auto& piece = layout.pieces[p][i];
        const TensorSpec& whole = tensors.at(piece.tensor);
        const int64_t per_row = whole.numel() / whole.shape[0];
        if (piece.whole) {
          REQUIRE(spec == whole);
          REQUIRE(piece.rows == whole.shape[0]);
        } else {
          REQUIRE(spec.name == diloco::detail::concat(whole.name, "[", piece.row_begin, ":",
                                                      piece.row_begin + piece.rows, "]"));
          REQUIRE(spec.shape[0] == piece.rows);
          REQUIRE(std::equal(spec.shape.begin() + 1, spec.shape.end(), whole.shape.begin() + 1, whole.shape.end()));
          REQUIRE(piece.rows < whole.shape[0]);
        }
        REQUIRE(piece.offset == piece.row_begin * per_row);
        REQUIRE(piece.numel == piece.rows * per_row);
        REQUIRE(spec.numel() == piece.numel);
        const std::pair<uint32_t, int64_t> here{piece.tensor, piece.row_begin};
        REQUIRE(here > previous);  // model order: by tensor, then by row
        previous = here;
        for (int64_t r = piece.row_begin; r < piece.row_begin + piece.rows; ++r) ++rows_seen[piece.tensor].at(static_cast<size_t>(r));
      }
    }
    for (const auto& rows : rows_seen)
      for (int count : rows) REQUIRE(count == 1);
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
    const auto parts = 1 + static_cast<uint32_t>(rng() % (2 * n));  // more fragments than tensors too
    const auto layout = partition_tensors(tensors, parts);
    int64_t sum = 0;
    for (uint32_t p = 0; p < parts; ++p) {
      sum += layout.fragment_numel(p);
      // No tensor is cut unless it is above the mean fragment, so the bound of whole tensors holds.
      REQUIRE(layout.fragment_numel(p) <= total_numel(tensors) / parts + max_numel(tensors));
      // And with cuts, the bound of the pieces, each at most the mean (rounded up to a row).
      int64_t largest_piece = 0;
      for (const auto& fragment : layout.pieces)
        for (const auto& piece : fragment) largest_piece = std::max(largest_piece, piece.numel);
      REQUIRE(layout.fragment_numel(p) <= total_numel(tensors) / parts + largest_piece);
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
  const auto layout = partition_tensors(tensors, 2);
  const auto names = [&](uint32_t p) {
    std::vector<std::string> out;
    for (const auto& t : layout.fragments[p]) out.push_back(t.name);
    return out;
  };
  CHECK(names(0) == std::vector<std::string>{"a", "d"});
  CHECK(names(1) == std::vector<std::string>{"e", "c", "b"});
}

TEST_CASE("LPT with many ties gives the layout of a scan for the first lightest fragment", "[fragments]") {
  // The reference: whole tensors by size (ties by name), each into the first fragment with the
  // fewest elements, found by scanning every fragment. Sizes from a handful of values make ties
  // in both orders common; fragments fewer than tensors keep every tensor whole.
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<TensorSpec> tensors;
    const int n = 2 + static_cast<int>(rng() % 60);
    for (int i = 0; i < n; ++i)
      tensors.push_back({diloco::detail::concat("t", rng() % 1000, "_", i), {1 + static_cast<int64_t>(rng() % 4)}});
    const auto parts = 1 + static_cast<uint32_t>(rng() % static_cast<uint32_t>(n));
    std::vector<size_t> order(tensors.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      if (tensors[a].numel() != tensors[b].numel()) return tensors[a].numel() > tensors[b].numel();
      return tensors[a].name < tensors[b].name;
    });
    std::vector<int64_t> load(parts, 0);
    std::vector<std::vector<size_t>> expected(parts);
    for (size_t i : order) {
      size_t lightest = 0;
      for (size_t p = 1; p < parts; ++p)
        if (load[p] < load[lightest]) lightest = p;
      load[lightest] += tensors[i].numel();
      expected[lightest].push_back(i);
    }
    const auto layout = partition_tensors(tensors, parts);
    bool any_cut = false;
    for (const auto& fragment : layout.pieces)
      for (const auto& piece : fragment) any_cut = any_cut || !piece.whole;
    if (any_cut) continue;  // cutting made the largest fragment smaller: not the reference's case
    for (uint32_t p = 0; p < parts; ++p) {
      std::sort(expected[p].begin(), expected[p].end());
      std::vector<std::string> want, got;
      for (size_t i : expected[p]) want.push_back(tensors[i].name);
      for (const auto& t : layout.fragments[p]) got.push_back(t.name);
      INFO("trial " << trial << ", fragment " << p << " of " << parts);
      REQUIRE(got == want);
    }
  }
}

TEST_CASE("a tensor of 65,536 rows over the most fragments: one row in each", "[fragments]") {
  // A layout that a message may carry (kMaxFragments fragments, each a one-row block): partition
  // must stay far from fragments x pieces work. Blocks of equal size go by name to fragments 0,
  // 1, ... in turn: "w[0:1]", then "w[10000:10001]" (':' sorts after every digit).
  const std::vector<TensorSpec> tensors{{"w", {int64_t{kMaxFragments}, 3}}};
  const auto layout = partition_tensors(tensors, kMaxFragments);
  REQUIRE(layout.num_fragments() == kMaxFragments);
  std::vector<std::string> names;
  std::vector<int> covered(kMaxFragments, 0);
  for (uint32_t p = 0; p < kMaxFragments; ++p) {
    REQUIRE(layout.pieces[p].size() == 1);
    const TensorPiece& piece = layout.pieces[p][0];
    REQUIRE(piece.rows == 1);
    REQUIRE(piece.numel == 3);
    REQUIRE(piece.offset == 3 * piece.row_begin);
    ++covered.at(static_cast<size_t>(piece.row_begin));
    names.push_back(layout.fragments[p][0].name);
  }
  CHECK(std::all_of(covered.begin(), covered.end(), [](int c) { return c == 1; }));
  CHECK(std::is_sorted(names.begin(), names.end()));
  CHECK(names[0] == "w[0:1]");
  CHECK(names[1] == "w[10000:10001]");
}

TEST_CASE("layout and fingerprint are stable and sensitive", "[fragments]") {
  const auto tensors = gpt_like(2, 16);
  const auto a = partition_tensors(tensors, 4);
  const auto b = partition_tensors(tensors, 4);
  REQUIRE(a.fragments == b.fragments);
  REQUIRE(a.fingerprint == b.fingerprint);
  REQUIRE(a.fingerprint != 0);

  SECTION("another shape changes it") {
    auto changed = tensors;
    changed[3].shape[0] += 1;
    CHECK(partition_tensors(changed, 4).fingerprint != a.fingerprint);
  }
  SECTION("another name changes it") {
    auto changed = tensors;
    changed[3].name += "_";
    CHECK(partition_tensors(changed, 4).fingerprint != a.fingerprint);
  }
  SECTION("another number of fragments changes it") {
    CHECK(partition_tensors(tensors, 3).fingerprint != a.fingerprint);
  }
  SECTION("another model order changes it") {
    auto changed = tensors;
    std::swap(changed[2], changed[3]);
    CHECK(partition_tensors(changed, 4).fingerprint != a.fingerprint);
  }
}

TEST_CASE("bad fragment counts and duplicate names are invalid input", "[fragments]") {
  const auto tensors = gpt_like(1, 8);
  CHECK_THROWS_AS(partition_tensors(tensors, 0), InvalidInput);
  // More fragments than rows to cut: 96 + 64 + 8 + 24 + 8 + 32 + 8 + 96 rows.
  CHECK_THROWS_AS(partition_tensors(tensors, 337), InvalidInput);
  CHECK_THROWS_AS(partition_tensors({}, 1), InvalidInput);
  auto duplicated = tensors;
  duplicated.push_back(tensors.front());
  CHECK_THROWS_AS(partition_tensors(duplicated, 2), InvalidInput);
}

TEST_CASE("the layout keeps every tensor in registration order", "[fragments]") {
  const auto tensors = gpt_like(2, 8);
  CHECK(partition_tensors(tensors, 3).tensors == tensors);
}

// The fingerprint is part of the wire contract: a learner in another language must compute it
// from the same text. Written out here by hand: strings length-prefixed, shapes as "[d,d]".
TEST_CASE("the fingerprint is XXH64 of the canonical text of the tensors and the layout", "[fragments]") {
  const std::vector<TensorSpec> tensors{{"ab", {2, 3}}, {"c", {4}}, {"d", {}}};
  // LPT: ab (6) -> 0, c (4) -> 1, d (1) -> 1.
  const std::string text =
      "diloco fragment layout v2\n"
      "tensors 3\n2:ab [2,3]\n1:c [4]\n1:d []\n"
      "fragments 2\n"
      "fragment 0\n2:ab [2,3]\n"
      "fragment 1\n1:c [4]\n1:d []\n";
  CHECK(partition_tensors(tensors, 2).fingerprint == XXH64(text.data(), text.size(), 0));
}

TEST_CASE("the fingerprint depends on nothing but the names, shapes, order and fragment count", "[fragments]") {
  const auto tensors = gpt_like(2, 16);
  const uint64_t fingerprint = partition_tensors(tensors, 4).fingerprint;
  // The same list built anew (another container, other strings) in another call.
  std::vector<TensorSpec> rebuilt;
  for (const auto& t : tensors) rebuilt.push_back(TensorSpec{std::string(t.name.begin(), t.name.end()), t.shape});
  CHECK(partition_tensors(std::span<const TensorSpec>(rebuilt.data(), rebuilt.size()), 4).fingerprint == fingerprint);
  // Neither the values nor the process that registers them go in: the list is all there is.
  CHECK(partition_tensors(gpt_like(2, 16), 4).fingerprint == fingerprint);
  CHECK(partition_tensors(gpt_like(2, 17), 4).fingerprint != fingerprint);
}

TEST_CASE("a tensor list is refused with a message naming the tensor", "[fragments]") {
  std::vector<TensorSpec> tensors{{"a", {2, 3}}, {"b", {4}}, {"c", {5}}};
  auto refusal = [](const std::vector<TensorSpec>& list) {
    try {
      (void)partition_tensors(list, 1);
    } catch (const InvalidInput& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  REQUIRE(refusal(tensors) == "accepted");

  SECTION("an empty name: its position") {
    tensors[1].name.clear();
    CHECK_THAT(refusal(tensors), Contains("tensor 1 ") && Contains("1 to 1024 bytes, not 0"));
  }
  SECTION("a name longer than kMaxTensorName: its beginning and its length") {
    tensors[2].name = "blocks.0." + std::string(kMaxTensorName, 'x');
    CHECK_THAT(refusal(tensors), Contains("'blocks.0.xxxx") && Contains(std::to_string(kMaxTensorName + 9)));
    tensors[2].name = std::string(kMaxTensorName, 'x');
    CHECK(refusal(tensors) == "accepted");
  }
  SECTION("a dimension below 1") {
    tensors[0].shape = {2, 0};
    CHECK_THAT(refusal(tensors), Contains("tensor 'a' has shape [2,0]"));
    tensors[0].shape = {-3};
    CHECK_THAT(refusal(tensors), Contains("tensor 'a' has shape [-3]"));
  }
  SECTION("more than kMaxTensorDims dimensions") {
    tensors[1].shape = std::vector<int64_t>(kMaxTensorDims + 1, 1);
    CHECK_THAT(refusal(tensors), Contains("tensor 'b' has 9 dimensions, at most 8"));
    tensors[1].shape = std::vector<int64_t>(kMaxTensorDims, 1);
    CHECK(refusal(tensors) == "accepted");
  }
  SECTION("more values than one tensor may have") {
    tensors[2].shape = {int64_t{1} << 21, int64_t{1} << 20};
    CHECK_THAT(refusal(tensors), Contains("tensor 'c' has shape [2097152,1048576]"));
  }
  SECTION("a name given twice") {
    tensors[2].name = "a";
    CHECK_THAT(refusal(tensors), Contains("tensor name 'a' appears twice"));
  }
}

TEST_CASE("describe_difference names the first tensor that differs", "[fragments]") {
  const std::vector<TensorSpec> run{{"a", {3, 4}}, {"b", {4}}, {"c", {2}}};
  CHECK(describe_difference(run, run).empty());

  SECTION("another shape") {
    auto here = run;
    here[1].shape = {5};
    CHECK(describe_difference(run, here) == "tensor 'b' is [4] in the run, [5] here");
  }
  SECTION("a tensor of the run missing here") {
    const std::vector<TensorSpec> here{run[0], run[1]};
    CHECK(describe_difference(run, here) == "tensor 'c' [2] of the run is missing here (3 tensors in the run, 2 here)");
  }
  SECTION("a tensor that is not in the run") {
    auto here = run;
    here.push_back({"d", {1, 1}});
    CHECK(describe_difference(run, here) == "tensor 'd' [1,1] is not in the run (3 tensors in the run, 4 here)");
  }
  SECTION("the same tensors in another order") {
    const std::vector<TensorSpec> here{run[0], run[2], run[1]};
    CHECK(describe_difference(run, here) ==
          "the tensors are registered in another order: position 1 is 'b' in the run, 'c' here");
  }
  SECTION("several differences: the first in the run's order") {
    auto here = run;
    here[2].shape = {7};
    here[0].shape = {4, 3};
    CHECK(describe_difference(run, here) == "tensor 'a' is [3,4] in the run, [4,3] here");
  }
}

TEST_CASE("shape_text writes a shape as messages do", "[fragments]") {
  CHECK(shape_text(std::vector<int64_t>{3, 4}) == "[3,4]");
  CHECK(shape_text(std::vector<int64_t>{7}) == "[7]");
  CHECK(shape_text(std::vector<int64_t>{}) == "[]");
}

TEST_CASE("a tensor above the mean fragment is cut into blocks of rows", "[fragments]") {
  // 720 + 240 + 8 = 968 over 4 fragments: the mean is 242. embed (720) becomes
  // ceil(720 / 242) = 3 blocks of 30 rows (240 each); w (240) and b stay whole. LPT over 240 x 4
  // (ties by name: embed[0:30] < embed[30:60] < embed[60:90] < w) fills fragments 0-3, then b
  // joins fragment 0 (all at 240, the lowest index).
  const std::vector<TensorSpec> tensors{{"embed", {90, 8}}, {"w", {15, 16}}, {"b", {8}}};
  const auto layout = partition_tensors(tensors, 4);
  const auto names = [&](uint32_t p) {
    std::vector<std::string> out;
    for (const auto& t : layout.fragments[p]) out.push_back(t.name);
    return out;
  };
  CHECK(names(0) == std::vector<std::string>{"embed[0:30]", "b"});
  CHECK(names(1) == std::vector<std::string>{"embed[30:60]"});
  CHECK(names(2) == std::vector<std::string>{"embed[60:90]"});
  CHECK(names(3) == std::vector<std::string>{"w"});
  CHECK(layout.fragments[1][0].shape == std::vector<int64_t>{30, 8});
  CHECK(layout.pieces[2][0] == TensorPiece{.tensor = 0, .row_begin = 60, .rows = 30, .offset = 480, .numel = 240,
                                           .whole = false});
  CHECK(layout.pieces[0][1] == TensorPiece{.tensor = 2, .row_begin = 0, .rows = 8, .offset = 0, .numel = 8, .whole = true});
}

TEST_CASE("one tensor larger than any fragment: a 525M-row-block layout, and uneven rows", "[fragments]") {
  // The shape of a Llama-style embedding, 128,256 x 4,096, over 3 fragments: 42,752 rows each.
  const std::vector<TensorSpec> tensors{{"embed", {128256, 4096}}};
  const auto layout = partition_tensors(tensors, 3);
  for (uint32_t p = 0; p < 3; ++p) {
    REQUIRE(layout.pieces[p].size() == 1);
    CHECK(layout.pieces[p][0].row_begin == 42752 * p);
    CHECK(layout.fragment_numel(p) == int64_t{42752} * 4096);
  }
  // 10 rows over 4 fragments: blocks of 3, 3, 2, 2 rows, the longer first.
  const auto uneven = partition_tensors(std::vector<TensorSpec>{{"v", {10}}}, 4);
  std::vector<int64_t> rows;
  for (const auto& fragment : uneven.pieces) rows.push_back(fragment.at(0).rows);
  CHECK(rows == std::vector<int64_t>{3, 3, 2, 2});
  // 5 rows over 4 fragments: at the mean rounded up (2) only 3 blocks, so cut at 1: five blocks,
  // the fifth joins fragment 0.
  const auto fine = partition_tensors(std::vector<TensorSpec>{{"v", {5}}}, 4);
  CHECK(fine.fragment_numel(0) == 2);
  CHECK(fine.fragment_numel(3) == 1);
  // Rows cannot be cut: [2, 1000] makes two pieces at most.
  CHECK_THROWS_WITH(partition_tensors(std::vector<TensorSpec>{{"m", {2, 1000}}}, 3),
                    Contains("only 2 pieces") && Contains("lower diloco.fragments"));
}

TEST_CASE("a layout that cuts a tensor has a fingerprint of its own canonical text", "[fragments]") {
  // w (8) is above the mean of 5: two blocks of 2 rows. LPT: w[0:2] -> 0, w[2:4] -> 1, c -> 0.
  const std::vector<TensorSpec> tensors{{"w", {4, 2}}, {"c", {2}}};
  const std::string text =
      "diloco fragment layout v2\n"
      "tensors 2\n1:w [4,2]\n1:c [2]\n"
      "fragments 2\n"
      "fragment 0\n6:w[0:2] [2,2]\n1:c [2]\n"
      "fragment 1\n6:w[2:4] [2,2]\n";
  CHECK(partition_tensors(tensors, 2).fingerprint == XXH64(text.data(), text.size(), 0));
}

TEST_CASE("a block's name that is also a tensor of the model is refused", "[fragments]") {
  const std::vector<TensorSpec> tensors{{"w", {4, 2}}, {"w[0:2]", {1}}};
  CHECK_THROWS_WITH(partition_tensors(tensors, 2), Contains("'w[0:2]'") && Contains("rename"));
}
