// A learner's per-fragment bookkeeping (learner/fragment_track.h) and its cut schedule
// (core/fragments/schedule.h). Expected values are worked out by hand: with int8 and one block,
// scale = absmax / 127, so a block whose absmax is 127 quantizes each value to round-half-even(x).
#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <vector>

#include "core/codec/quantize.h"
#include "core/errors.h"
#include "core/fragments/schedule.h"
#include "learner/fragment_track.h"
#include "tests/temp_dir.h"

using namespace diloco;

namespace {

// One fragment of one tensor of two values.
std::vector<DenseTensor> tensors(float a, float b) { return {DenseTensor{.index = 0, .shape = {2}, .values = {a, b}}}; }
std::vector<std::vector<float>> values(float a, float b) { return {{a, b}}; }

std::vector<float> sent(const CutDelta& d) {
  REQUIRE(d.tensors.size() == 1);
  std::vector<float> out(2);
  dequantize(d.tensors[0], out);
  return out;
}

}  // namespace

TEST_CASE("a delta is anchor minus current, with the counters since the base", "[learner]") {
  FragmentTrack f(tensors(3, -1), 4);
  f.count_step(16);
  f.count_step(16);
  CutDelta d = f.cut(values(1, 2), DType::F32, 64);
  CHECK(sent(d) == std::vector<float>{2, -3});
  CHECK(d.base_version == 4);
  CHECK(d.inner_steps == 2);
  CHECK(d.tokens == 32);
  CHECK(f.sent_on_base());
  CHECK_THROWS_AS(f.cut({{1, 2}, {3}}, DType::F32, 64), InvalidInput);
  CHECK_THROWS_AS(f.cut({{1}}, DType::F32, 64), InvalidInput);
}

TEST_CASE("a second cut on the same base starts from the residual carried into the base", "[learner]") {
  FragmentTrack f(tensors(127, 0.25f), 0);
  f.count_step(1);
  // delta (127, 0.25) -> sent (127, 0), held back (0, 0.25)
  CHECK(sent(f.cut(values(0, 0), DType::INT8, 64)) == std::vector<float>{127, 0});
  // The first cut is superseded by the second (both on base 0; the merger takes one of them), so
  // its 0.25 is not added again: delta (127, 0.375) -> sent (127, 0). Chaining the residual
  // would have sent round(0.625) = 1.
  CutDelta second = f.cut(values(0, -0.125f), DType::INT8, 64);
  CHECK(sent(second) == std::vector<float>{127, 0});
  CHECK(second.base_version == 0);
  CHECK(f.carried_residual() == std::vector<std::vector<float>>{{0, 0}});
}

TEST_CASE("on adoption the residual of the last cut is carried into the new base", "[learner]") {
  FragmentTrack f(tensors(127, 0.25f), 0);
  f.count_step(1);
  CHECK(sent(f.cut(values(0, 0), DType::INT8, 64)) == std::vector<float>{127, 0});  // holds back 0.25
  auto model = f.adopt(1, 77, tensors(10, 10));
  CHECK(model[0].values == std::vector<float>{10, 10});  // overwrite
  CHECK(f.carried_residual() == std::vector<std::vector<float>>{{0, 0.25f}});
  // A version adopted without a cut in between keeps the carried residual (none of it went out).
  f.adopt(2, 78, tensors(10, 10));
  CHECK(f.carried_residual() == std::vector<std::vector<float>>{{0, 0.25f}});
  f.count_step(1);
  // delta (10 - -117, 10 - 9.625) = (127, 0.375), plus 0.25 carried = (127, 0.625) -> (127, 1).
  CutDelta d = f.cut(values(-117, 9.625f), DType::INT8, 64);
  CHECK(sent(d) == std::vector<float>{127, 1});
  CHECK(d.base_version == 2);
  f.adopt(3, 79, tensors(0, 0));
  CHECK(f.carried_residual() == std::vector<std::vector<float>>{{0, -0.375f}});
}

TEST_CASE("blend_alpha mixes the local and the received parameters, and the anchor is the received", "[learner]") {
  FragmentTrack f(tensors(0, 0), 0);
  f.count_step(1);
  auto model = f.adopt(1, 0, tensors(0, 4), 0.25, tensors(4, 8));
  // 0.25 * (4, 8) + 0.75 * (0, 4) = (1, 5)
  CHECK(model[0].values == std::vector<float>{1, 5});
  CHECK(f.anchor()[0].values == std::vector<float>{0, 4});
  f.count_step(1);
  CHECK(sent(f.cut(values(1, 5), DType::F32, 64)) == std::vector<float>{-1, -1});
  CHECK(blend(tensors(2, 2), tensors(4, 6), 0.5)[0].values == std::vector<float>{3, 4});
  CHECK_THROWS_AS(blend(tensors(2, 2), {}, 0.5), InvalidInput);
}

TEST_CASE("adoption resets the counters of the fragment", "[learner]") {
  FragmentTrack f(tensors(0, 0), 3, 11);
  for (int i = 0; i < 3; ++i) f.count_step(16);
  CHECK(f.steps() == 3);
  CHECK(f.tokens() == 48);
  f.cut(values(0, 0), DType::F32, 64);
  f.adopt(5, 12, tensors(1, 1));
  CHECK(f.version() == 5);
  CHECK(f.checksum() == 12);
  CHECK(f.steps() == 0);
  CHECK(f.tokens() == 0);
  CHECK_FALSE(f.sent_on_base());
  f.count_step(16);
  CutDelta d = f.cut(values(0, 0), DType::F32, 64);
  CHECK(d.inner_steps == 1);
  CHECK(d.tokens == 16);
  CHECK(d.base_version == 5);
}

TEST_CASE("a cut before an overwrite needs progress of its own that the arriving version lacks", "[learner]") {
  const uint32_t H = 10;
  FragmentTrack f(tensors(0, 0), 2);
  for (int i = 0; i < 4; ++i) f.count_step(1);
  CHECK_FALSE(f.cut_before_adopting(3, 0.5, H));  // 4 steps < 0.5 * 10
  f.count_step(1);
  CHECK(f.cut_before_adopting(3, 0.5, H));        // 5 steps >= 5
  CHECK_FALSE(f.cut_before_adopting(3, 0.0, H));  // disabled
  CHECK_FALSE(f.cut_before_adopting(2, 0.5, H));  // not a newer version
  CHECK(f.cut_before_adopting(3, 0.1, H));
  f.cut(values(0, 0), DType::F32, 64);
  // A delta on this base went out: the arriving version may already contain it.
  CHECK_FALSE(f.cut_before_adopting(3, 0.5, H));
  f.adopt(3, 0, tensors(0, 0));
  CHECK_FALSE(f.cut_before_adopting(4, 0.1, H));  // no steps since the adoption
  f.count_step(1);
  CHECK(f.cut_before_adopting(4, 0.1, H));
}

TEST_CASE("after a cut a synchronous learner waits for a version above the base", "[learner]") {
  FragmentTrack f(tensors(0, 0), 6);
  f.count_step(1);
  f.cut(values(0, 0), DType::F32, 64);
  f.expect_merge(10, -1);  // Decoupled: never waits
  CHECK_FALSE(f.must_wait(1000));
  f.expect_merge(10, 2);   // may complete steps 11 and 12, then waits
  CHECK(f.awaited_base() == 6u);
  CHECK_FALSE(f.must_wait(10));
  CHECK_FALSE(f.must_wait(11));
  CHECK(f.must_wait(12));
  f.adopt(7, 0, tensors(0, 0));
  CHECK_FALSE(f.must_wait(12));
  CHECK_FALSE(f.awaited_base());

  f.count_step(1);
  f.cut(values(0, 0), DType::F32, 64);
  f.expect_merge(20, 0);
  CHECK(f.must_wait(20));
  f.give_up_wait();
  CHECK_FALSE(f.must_wait(20));
}

TEST_CASE("the cut schedule follows the fixed phase schedule unless a fragment is cut early", "[learner][schedule]") {
  for (uint32_t H : {1u, 4u, 12u, 24u})
    for (uint32_t P : {1u, 2u, 4u, 12u})
      for (uint32_t offset : {0u, 1u, 5u}) {
        if (P > H || H % P != 0) continue;
        const StreamingSchedule s{H, P, offset};
        CutSchedule cuts(s);
        for (uint64_t step = 1; step <= 5ull * H; ++step) {
          auto due = cuts.due(step);
          auto fixed = fragment_due(s, step);
          REQUIRE(due.size() == (fixed ? 1u : 0u));
          if (fixed) {
            REQUIRE(due[0] == *fixed);
            cuts.cut(due[0], step);
          }
        }
      }

  // H = 12, P = 4, offset 0: fragment p at 3, 6, 9, 12, then 15, ...
  CutSchedule cuts(StreamingSchedule{12, 4, 0});
  CHECK(cuts.next_due(0) == 3u);
  CHECK(cuts.next_due(3) == 12u);
  cuts.cut(2, 7);  // fragment 2, due at 9, is cut early at step 7
  CHECK(cuts.next_due(2) == 19u);
  CHECK(cuts.due(9).size() == 2u);  // fragments 0 (due 3) and 1 (due 6) were never cut here
  cuts.cut(0, 3);
  cuts.cut(1, 6);
  CHECK(cuts.due(9).empty());
  CHECK(cuts.due(12) == std::vector<uint32_t>{3});
  cuts.cut(3, 12);
  CHECK(cuts.due(15) == std::vector<uint32_t>{0});
  CHECK(cuts.due(18) == std::vector<uint32_t>{0, 1});
  cuts.cut(0, 15);
  cuts.cut(1, 18);
  CHECK(cuts.due(19) == std::vector<uint32_t>{2});  // 7 + 12: the early cut moved its phase
  cuts.cut(2, 19);
  CHECK(cuts.next_due(2) == 31u);
  CHECK(cuts.due(26) == std::vector<uint32_t>{3});  // 12 + 12; fragment 0 follows at 27
}

TEST_CASE("rebase keeps the progress made since the last cut on top of the received version", "[learner]") {
  FragmentTrack f(tensors(10, 10), 3);
  for (int i = 0; i < 4; ++i) f.count_step(8);
  f.cut(values(8, 12), DType::F32, 64);  // sent (2, -2) after 4 steps
  for (int i = 0; i < 2; ++i) f.count_step(8);
  // Two more steps moved the fragment to (7, 13): (-1, +1) since the cut. Version 4 arrives.
  auto model = f.rebase(4, 99, tensors(9, 11), tensors(7, 13));
  REQUIRE(model.size() == 1);
  CHECK(model[0].values == std::vector<float>{8, 12});  // (9, 11) + (-1, 1)
  CHECK(f.version() == 4);
  CHECK(f.checksum() == 99);
  CHECK(f.anchor()[0].values == std::vector<float>{9, 11});
  CHECK(f.steps() == 2);  // the steps whose progress was kept
  CHECK(f.tokens() == 16);
  CHECK_FALSE(f.sent_on_base());
  // The next delta carries that progress, measured from the new anchor.
  f.count_step(8);
  CHECK(sent(f.cut(values(8, 12), DType::F32, 64)) == std::vector<float>{1, -1});
}

TEST_CASE("rebase without a cut on the base keeps all progress since the base", "[learner]") {
  FragmentTrack f(tensors(10, 10), 3);
  for (int i = 0; i < 5; ++i) f.count_step(8);
  auto model = f.rebase(4, 0, tensors(20, 0), tensors(9, 12));  // (-1, +2) since the base
  CHECK(model[0].values == std::vector<float>{19, 2});
  CHECK(f.steps() == 5);
  CHECK(f.tokens() == 40);
}

TEST_CASE("rebase right after a cut is an overwrite", "[learner]") {
  FragmentTrack f(tensors(10, 10), 3);
  f.count_step(8);
  f.cut(values(8, 12), DType::F32, 64);
  f.expect_merge(1, 0);
  CHECK(f.must_wait(1));
  auto model = f.rebase(4, 0, tensors(9, 11), tensors(8, 12));
  CHECK(model[0].values == std::vector<float>{9, 11});
  CHECK(f.steps() == 0);
  CHECK_FALSE(f.must_wait(1));
  CHECK_THROWS_AS(f.rebase(5, 0, tensors(1, 1), {}), InvalidInput);
}

TEST_CASE("a cut and the residual carried at adoption are those of quantizing the whole tensor at once",
          "[learner]") {
  // Two tensors, one of several of the ranges a cut works in (2^20 values) and a last block that
  // is not whole; the expected values come from quantize_with_feedback on whole tensors.
  const std::vector<size_t> sizes = {(size_t{1} << 21) + 1000, 77};
  std::mt19937_64 rng(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  auto fill = [&](float scale) {
    std::vector<DenseTensor> out;
    for (uint32_t t = 0; t < sizes.size(); ++t) {
      DenseTensor d{t, {static_cast<int64_t>(sizes[t])}, std::vector<float>(sizes[t])};
      for (auto& v : d.values) v = scale * dist(rng);
      out.push_back(std::move(d));
    }
    return out;
  };
  auto bits = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  // The same with the residual and the values at the cut spilled to a directory, the cut read
  // from the model's buffers.
  test::TempDir dir("diloco-track-spill");
  const std::string spill = GENERATE(as<std::string>{}, "", "spill");
  const std::string spill_dir = spill.empty() ? "" : dir.path.string();
  for (const uint32_t topk : {0u, 8u}) {
    const auto anchor = fill(1.0f), first = fill(1.0f), second = fill(1.0f), third = fill(1.0f);
    FragmentTrack f(anchor, 0, 0, spill_dir);
    CHECK(f.spilled() == !spill_dir.empty());
    f.count_step(1);
    // The first cut, on base 0: its residual becomes the carried one at adoption.
    std::vector<std::vector<float>> at_cut;
    for (const auto& t : first) at_cut.push_back(t.values);
    if (spill_dir.empty()) {
      f.cut(at_cut, DType::INT4, 64, topk);
    } else {
      FragmentTrack::Model model;
      for (auto& v : at_cut) model.emplace_back(v);
      f.cut_from(model, DType::INT4, 64, topk);
      for (auto& v : at_cut) std::fill(v.begin(), v.end(), 0.0f);  // the track holds its own copy
    }
    std::vector<std::vector<float>> expected_residual;
    for (size_t t = 0; t < sizes.size(); ++t) {
      std::vector<float> delta(sizes[t]), residual(sizes[t], 0.0f), scratch;
      for (size_t i = 0; i < sizes[t]; ++i) delta[i] = anchor[t].values[i] - first[t].values[i];
      quantize_with_feedback(static_cast<uint32_t>(t), anchor[t].shape, delta, residual, DType::INT4, 64, scratch, {},
                             topk);
      expected_residual.push_back(std::move(residual));
    }
    CHECK(f.save().last_cut.size() == sizes.size());
    for (size_t t = 0; t < sizes.size(); ++t) CHECK(bits(f.save().last_cut[t], expected_residual[t]));
    const auto rebased = f.rebase(1, 0, second, third);
    for (size_t t = 0; t < sizes.size(); ++t) {  // second + (third - first), value by value
      std::vector<float> expected(sizes[t]);
      for (size_t i = 0; i < sizes[t]; ++i)
        expected[i] = second[t].values[i] + (third[t].values[i] - first[t].values[i]);
      CHECK(bits(rebased[t].values, expected));
    }
    const auto carried = f.carried_residual();
    for (size_t t = 0; t < sizes.size(); ++t) CHECK(bits(carried[t], expected_residual[t]));
    // The next cut starts from it and leaves it as it is.
    f.count_step(1);
    std::vector<std::vector<float>> now;
    for (const auto& t : first) now.push_back(t.values);
    const CutDelta d = f.cut(now, DType::INT4, 64, topk);
    for (size_t t = 0; t < sizes.size(); ++t) {
      std::vector<float> delta(sizes[t]), residual = expected_residual[t], scratch;
      for (size_t i = 0; i < sizes[t]; ++i) delta[i] = second[t].values[i] - first[t].values[i];
      const QuantizedTensor q =
          quantize_with_feedback(static_cast<uint32_t>(t), anchor[t].shape, delta, residual, DType::INT4, 64, scratch,
                                 {}, topk);
      CHECK(d.tensors[t].payload == q.payload);
      CHECK(d.tensors[t].scales == q.scales);
      CHECK(bits(f.carried_residual()[t], expected_residual[t]));
    }
  }
}

TEST_CASE("adopt_into and rebase_into write the model's own buffers, and change nothing on a size mismatch",
          "[learner]") {
  FragmentTrack f(tensors(10, 10), 3);
  for (int i = 0; i < 4; ++i) f.count_step(8);
  f.cut(values(8, 12), DType::F32, 64);
  std::vector<float> model = {7, 13}, short_model = {1};
  auto received = std::make_shared<const std::vector<DenseTensor>>(tensors(9, 11));
  CHECK_THROWS_AS(f.rebase_into(4, 0, received, {std::span<float>(short_model)}), InvalidInput);
  CHECK_THROWS_AS(f.rebase_into(4, 0, received, {}), InvalidInput);
  CHECK(f.version() == 3);
  CHECK(f.sent_on_base());
  CHECK(model == std::vector<float>{7, 13});
  // (9, 11) + ((7, 13) - (8, 12)), in place.
  f.rebase_into(4, 0, received, {std::span<float>(model)});
  CHECK(model == std::vector<float>{8, 12});
  CHECK(f.version() == 4);
  CHECK(f.anchor_version() == received);  // shared, not copied
  f.count_step(8);
  auto next = std::make_shared<const std::vector<DenseTensor>>(tensors(0, 4));
  f.adopt_into(5, 0, next, 0.25, {std::span<float>(model)});
  CHECK(model == std::vector<float>{2, 6});  // 0.25 * (8, 12) + 0.75 * (0, 4)
  f.adopt_into(6, 0, received, 0, {std::span<float>(model)});
  CHECK(model == std::vector<float>{9, 11});
}

TEST_CASE("save keeps everything the next cut and rebase need, and restore gives it back", "[learner][learner_state]") {
  FragmentTrack f(tensors(127, 0.25f), 6, 77);
  for (int i = 0; i < 3; ++i) f.count_step(10);
  // delta (127, 0.25) in int8 -> sent (127, 0), 0.25 held back after the cut.
  CHECK(sent(f.cut(values(0, 0), DType::INT8, 64)) == std::vector<float>{127, 0});
  for (int i = 0; i < 2; ++i) f.count_step(10);

  const FragmentTrack::Saved saved = f.save();
  CHECK(saved.version == 6);
  CHECK(saved.checksum == 77);
  REQUIRE(saved.anchor.size() == 1);
  CHECK(saved.anchor[0].values == std::vector<float>{127, 0.25f});
  CHECK(saved.carried == std::vector<std::vector<float>>{{0, 0}});
  CHECK(saved.last_cut == std::vector<std::vector<float>>{{0, 0.25f}});
  CHECK(saved.sent_on_base);
  CHECK(saved.steps == 5);
  CHECK(saved.tokens == 50);
  CHECK(saved.cut_point == std::vector<std::vector<float>>{{0, 0}});
  CHECK(saved.steps_at_cut == 3);
  CHECK(saved.tokens_at_cut == 30);

  FragmentTrack r = FragmentTrack::restore(saved);
  CHECK(r.version() == 6);
  CHECK(r.checksum() == 77);
  CHECK(r.steps() == 5);
  CHECK(r.sent_on_base());
  // Version 7 arrives: (100, 0) + the progress since the cut, (0.5, 1) - (0, 0); the two steps
  // since the cut stay counted, and the held-back 0.25 is carried into the new base.
  const auto model = r.rebase(7, 0, tensors(100, 0), tensors(0.5f, 1));
  CHECK(model[0].values == std::vector<float>{100.5f, 1});
  CHECK(r.steps() == 2);
  CHECK(r.tokens() == 20);
  CHECK(r.carried_residual() == std::vector<std::vector<float>>{{0, 0.25f}});
  // The next delta: (100, 0) - (99.5, 1) + (0, 0.25), after those two steps.
  CutDelta next = r.cut(values(99.5f, 1), DType::F32, 64);
  CHECK(sent(next) == std::vector<float>{0.5f, -0.75f});
  CHECK(next.base_version == 7);
  CHECK(next.inner_steps == 2);
  CHECK(next.tokens == 20);
}

TEST_CASE("a track saved after an adoption that followed a cut restores", "[learner][learner_state]") {
  FragmentTrack f(tensors(10, 10), 3);
  for (int i = 0; i < 4; ++i) f.count_step(8);
  f.cut(values(8, 12), DType::F32, 64);
  f.adopt(4, 0, tensors(9, 11));
  f.count_step(8);
  FragmentTrack r = FragmentTrack::restore(f.save());
  CHECK(r.version() == 4);
  CHECK(r.steps() == 1);
  CHECK_FALSE(r.sent_on_base());
  CHECK(sent(r.cut(values(9, 10), DType::F32, 64)) == std::vector<float>{0, 1});
}

TEST_CASE("restore refuses a saved track whose parts do not agree with its anchor", "[learner][learner_state]") {
  FragmentTrack f(tensors(1, 2), 0);
  f.count_step(4);
  f.cut(values(0, 0), DType::F32, 64);
  const FragmentTrack::Saved good = f.save();
  CHECK_NOTHROW(FragmentTrack::restore(good));
  auto bad = good;
  bad.carried = {{0}};
  CHECK_THROWS_AS(FragmentTrack::restore(bad), InvalidInput);
  bad = good;
  bad.last_cut.clear();  // a cut on the base without its residual
  CHECK_THROWS_AS(FragmentTrack::restore(bad), InvalidInput);
  bad = good;
  bad.cut_point = {{0, 0}, {0, 0}};
  CHECK_THROWS_AS(FragmentTrack::restore(bad), InvalidInput);
  bad = good;
  bad.steps_at_cut = bad.steps + 1;
  CHECK_THROWS_AS(FragmentTrack::restore(bad), InvalidInput);
}
