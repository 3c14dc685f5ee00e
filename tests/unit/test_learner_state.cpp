// A learner's saved local progress (core/codec/learner_state.h): what LearnerRuntime::save_state
// gives a client to keep beside its model, and load_state takes back. Decoded as strictly as a
// message: bytes of another run, another model or corrupt bytes are refused with a reason.
#include <catch2/catch.hpp>

#include <functional>
#include <limits>
#include <random>

#include "core/codec/learner_state.h"
#include "core/fragments/partition.h"
#include "tests/rejection.h"

using namespace diloco;
using testing::rejection;

namespace {

const FragmentLayout& layout() {
  // LPT: w (12) -> 0; b (7), n (5) -> 1. No tensor is above the mean (12), so none is cut.
  static const FragmentLayout l = partition_tensors(std::vector<TensorSpec>{{"w", {3, 4}}, {"b", {7}}, {"n", {5}}}, 2);
  return l;
}

DecodeLimits limits() { return DecodeLimits{.run_id = "run-1", .fingerprint = layout().fingerprint, .layout = &layout()}; }

std::vector<std::vector<float>> flat(uint32_t p, float base) {
  std::vector<std::vector<float>> out;
  for (const auto& spec : layout().fragments[p]) {
    std::vector<float> v(static_cast<size_t>(spec.numel()));
    for (size_t i = 0; i < v.size(); ++i) v[i] = base + 0.25f * static_cast<float>(i);
    out.push_back(std::move(v));
  }
  return out;
}

std::vector<DenseTensor> dense(uint32_t p, float base) {
  std::vector<DenseTensor> out;
  auto values = flat(p, base);
  for (uint32_t k = 0; k < values.size(); ++k) out.push_back(DenseTensor{k, layout().fragments[p][k].shape, values[k]});
  return out;
}

// Fragment 0 was cut on its base (residuals and cut point kept), fragment 1 was not.
SavedLearner saved() {
  SavedLearner s{.run_id = "run-1", .fingerprint = layout().fingerprint, .learner_id = "learner-a", .step = 640,
                 .tokens = 640ull * 2048};
  s.fragments.push_back(SavedFragment{.fragment = 0, .version = 12, .checksum = checksum_fp32(dense(0, 1.0f)),
                                      .anchor = dense(0, 1.0f), .carried = flat(0, -0.5f), .last_cut = flat(0, 0.125f),
                                      .cut_point = flat(0, 2.0f), .sent_on_base = true, .steps = 40, .tokens = 81920,
                                      .steps_at_cut = 24, .tokens_at_cut = 49152, .seq = 1'700'000'000'321});
  s.fragments.push_back(SavedFragment{.fragment = 1, .version = 7, .checksum = checksum_fp32(dense(1, 3.0f)),
                                      .anchor = dense(1, 3.0f), .carried = flat(1, 0.0f), .steps = 9, .tokens = 18432,
                                      .seq = 0});
  return s;
}

}  // namespace

TEST_CASE("a saved learner state round-trips field by field", "[codec][learner_state]") {
  const SavedLearner want = saved();
  const SavedLearner got = decode_learner_state(encode_learner_state(want), limits());
  CHECK(got.run_id == "run-1");
  CHECK(got.fingerprint == layout().fingerprint);
  CHECK(got.learner_id == "learner-a");
  CHECK(got.step == 640);
  CHECK(got.tokens == 640ull * 2048);
  REQUIRE(got.fragments.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    INFO("fragment " << i);
    const auto& g = got.fragments[i];
    const auto& w = want.fragments[i];
    CHECK(g.fragment == w.fragment);
    CHECK(g.version == w.version);
    CHECK(g.checksum == w.checksum);
    REQUIRE(g.anchor.size() == w.anchor.size());
    for (size_t t = 0; t < w.anchor.size(); ++t) {
      CHECK(g.anchor[t].shape == w.anchor[t].shape);
      CHECK(g.anchor[t].values == w.anchor[t].values);
    }
    CHECK(g.carried == w.carried);
    CHECK(g.last_cut == w.last_cut);
    CHECK(g.cut_point == w.cut_point);
    CHECK(g.sent_on_base == w.sent_on_base);
    CHECK(g.steps == w.steps);
    CHECK(g.tokens == w.tokens);
    CHECK(g.steps_at_cut == w.steps_at_cut);
    CHECK(g.tokens_at_cut == w.tokens_at_cut);
    CHECK(g.seq == w.seq);
  }
  // A fragment not cut on its base keeps no residual after a cut and no cut point.
  CHECK(got.fragments[1].last_cut.empty());
  CHECK(got.fragments[1].cut_point.empty());
}

TEST_CASE("a saved state of another model, run or corrupt bytes is refused", "[codec][learner_state]") {
  SavedLearner s = saved();
  SECTION("another model's fingerprint") {
    s.fingerprint ^= 1;
    CHECK_REJECTS(decode_learner_state(encode_learner_state(s), limits()), WrongFingerprint);
  }
  SECTION("another model of the same fragment count: the reader's layout decides") {
    const FragmentLayout other = partition_tensors(std::vector<TensorSpec>{{"w", {3, 5}}, {"b", {3}}, {"n", {2}}}, 2);
    DecodeLimits theirs = limits();
    theirs.fingerprint = other.fingerprint;
    theirs.layout = &other;
    CHECK_REJECTS(decode_learner_state(encode_learner_state(s), theirs), WrongFingerprint);
  }
  SECTION("another run") {
    s.run_id = "run-2";
    CHECK_REJECTS(decode_learner_state(encode_learner_state(s), limits()), WrongRunId);
  }
  SECTION("some fragments (a learner of some fragments), but not none") {
    s.fragments.pop_back();
    const SavedLearner some = decode_learner_state(encode_learner_state(s), limits());
    REQUIRE(some.fragments.size() == 1);
    CHECK(some.fragments[0].fragment == s.fragments[0].fragment);
    s.fragments.clear();
    CHECK_REJECTS(decode_learner_state(encode_learner_state(s), limits()), TensorCountMismatch);
  }
  SECTION("a fragment twice") {
    s.fragments[1] = s.fragments[0];
    CHECK_REJECTS(decode_learner_state(encode_learner_state(s), limits()), BadCounter);
  }
  SECTION("a fragment the layout does not have") {
    s.fragments[1].fragment = 2;
    CHECK_REJECTS(decode_learner_state(encode_learner_state(s), limits()), FragmentOutOfRange);
  }
  SECTION("no carried residual") {
    s.fragments[1].carried.clear();
    CHECK_REJECTS(decode_learner_state(encode_learner_state(s), limits()), MissingField);
  }
  SECTION("a cut on the base without its residual") {
    s.fragments[0].last_cut.clear();
    CHECK_REJECTS(decode_learner_state(encode_learner_state(s), limits()), MissingField);
  }
  SECTION("an anchor of another shape") {
    s.fragments[0].anchor[0].shape = {4, 3};
    CHECK_REJECTS(decode_learner_state(encode_learner_state(s), limits()), ShapeMismatch);
  }
  SECTION("a value that is not finite") {
    s.fragments[1].carried[0][1] = std::numeric_limits<float>::quiet_NaN();
    CHECK_REJECTS(decode_learner_state(encode_learner_state(s), limits()), NonFinite);
  }
  SECTION("truncated bytes") {
    const auto bytes = encode_learner_state(s);
    for (size_t n = 0; n < bytes.size(); ++n) {
      INFO(n << " of " << bytes.size() << " bytes");
      CHECK(rejection([&] { (void)decode_learner_state(std::span<const uint8_t>(bytes.data(), n), limits()); }) !=
            "accepted");
    }
  }
}
