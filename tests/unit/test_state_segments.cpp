// Streamed messages (core/codec/messages.h, schemas/common.fbs Segment): checkpoints (a
// FragmentState encoded segment by segment and read back by a FragmentStateAssembler), snapshots
// (FragmentParamsAssembler) and proposals (GenesisProposalAssembler), and every way a segment can
// fail to continue its message. Hostile checkpoint segments are built by hand with the generated
// FlatBuffers builder, so they do not depend on the encoder under test.
#include <catch2/catch.hpp>

#include <xxhash.h>

#include <random>

#include "core/codec/compress.h"
#include "core/codec/messages.h"
#include "core/fragments/partition.h"
#include "core/kafka/consumer.h"
#include "core/kafka/run_log.h"
#include "schemas/fragment_state_generated.h"
#include "tests/rejection.h"

using namespace diloco;

namespace {

// Fragment 0 holds 4 x 33 + 7 + 3 x 5 = 154 values, fragment 1 holds 4.
FragmentLayout make_layout() {
  FragmentLayout layout;
  layout.fingerprint = 0xA1A2A3A4B5B6B7B8ull;
  layout.fragments = {
      {{"blocks.0.attn", {4, 33}}, {"blocks.0.norm", {7}}, {"blocks.0.mlp", {3, 1, 5}}},
      {{"head", {2, 2}}},
  };
  layout.tensors = {layout.fragments[0][0], layout.fragments[0][1], layout.fragments[0][2], layout.fragments[1][0]};
  return layout;
}

DecodeLimits limits_for(const FragmentLayout& layout) {
  DecodeLimits limits;
  limits.run_id = "run-1";
  limits.fingerprint = layout.fingerprint;
  limits.layout = &layout;
  return limits;
}

std::vector<DenseTensor> values_of(const FragmentLayout& layout, uint32_t fragment, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.1f);
  std::vector<DenseTensor> out;
  const auto& specs = layout.fragments[fragment];
  for (size_t k = 0; k < specs.size(); ++k) {
    DenseTensor t{.index = static_cast<uint32_t>(k), .shape = specs[k].shape, .values = {}};
    t.values.resize(static_cast<size_t>(specs[k].numel()));
    for (auto& v : t.values) v = dist(rng);
    out.push_back(std::move(t));
  }
  return out;
}

FragmentState make_state(const FragmentLayout& layout, uint64_t version = 9) {
  FragmentState s;
  s.run_id = "run-1";
  s.fingerprint = layout.fingerprint;
  s.layout = std::make_shared<const FragmentLayout>(layout);
  s.fragment = 0;
  s.version = version;
  s.params = values_of(layout, 0, version);
  s.momentum = values_of(layout, 0, version + 100);
  s.outer_state = values_of(layout, 0, version + 200);
  s.downlink_residual = values_of(layout, 0, version + 300);
  s.consumed = {{"diloco.run-1.deltas.eu", 0, 120}, {"diloco.run-1.deltas.us", 3, 77}};
  s.last_merge = LogPosition{"diloco.run-1.merges", 0, 8};
  s.accounted = {{"learner-a", 12}, {"learner-b", 4}};
  s.merged_bases = {{"learner-a", 7}};
  s.recent = {{"diloco.run-1.deltas.eu", 0, 119}};
  s.optimizer = OuterOptimizerKind::Cgad;
  s.optimizer_since = 3;
  return s;
}

std::vector<std::vector<uint8_t>> segments_of(const FragmentState& s, uint64_t segment_bytes) {
  std::vector<std::vector<uint8_t>> out;
  for_each_fragment_state_segment(s, segment_bytes, 1, [&](uint32_t index, uint32_t count, std::span<const uint8_t> b) {
    CHECK(index == out.size());
    CHECK(count == fragment_state_segments(s, segment_bytes));
    out.emplace_back(b.begin(), b.end());
  });
  return out;
}

// The values of a list, flattened in layout order.
std::vector<float> flat(const std::vector<DenseTensor>& tensors) {
  std::vector<float> out;
  for (const auto& t : tensors) out.insert(out.end(), t.values.begin(), t.values.end());
  return out;
}

uint64_t xxh_of(const std::vector<DenseTensor>& tensors) {
  const auto values = flat(tensors);
  return XXH64(values.data(), values.size() * 4, 0);
}

// A segment of fragment 0 written by hand: params only, as the given slices of `params`
// (tensor index, offset in it, value count), with the values taken from `params`.
struct Slice {
  uint32_t index;
  uint64_t offset;
  uint64_t count;
};

std::vector<uint8_t> hand_segment(const FragmentLayout& layout, const std::vector<DenseTensor>& params, uint64_t version,
                                  uint32_t index, uint32_t count, uint64_t first, uint64_t values,
                                  const std::vector<Slice>& slices, uint16_t schema_version = 2,
                                  bool with_layout = true) {
  flatbuffers::FlatBufferBuilder fbb;
  std::vector<flatbuffers::Offset<wire::Tensor>> tensors;
  for (const auto& s : slices) {
    const auto& t = params[s.index];
    std::vector<uint8_t> payload(s.count * 4);
    std::memcpy(payload.data(), t.values.data() + s.offset, payload.size());
    tensors.push_back(wire::CreateTensor(fbb, s.index, fbb.CreateVector(t.shape), 0, fbb.CreateVector(payload), 0, 0,
                                         s.offset));
  }
  const auto params_vector = fbb.CreateVector(tensors);
  flatbuffers::Offset<wire::ModelLayout> layout_table = 0;
  if (with_layout) {
    std::vector<flatbuffers::Offset<wire::TensorSpec>> specs;
    for (const auto& spec : layout.tensors)
      specs.push_back(wire::CreateTensorSpec(fbb, fbb.CreateString(spec.name), fbb.CreateVector(spec.shape)));
    layout_table = wire::CreateModelLayout(fbb, static_cast<uint32_t>(layout.fragments.size()), fbb.CreateVector(specs));
  }
  const auto segment = wire::CreateSegment(fbb, index, count, first, values);
  wire::FragmentStateBuilder b(fbb);
  b.add_schema_version(schema_version);
  b.add_run_id(fbb.CreateString("run-1"));
  b.add_fingerprint(layout.fingerprint);
  b.add_fragment(0);
  b.add_version(version);
  b.add_params(params_vector);
  b.add_checksum(xxh_of(params));
  if (with_layout) b.add_layout(layout_table);
  b.add_segment(segment);
  wire::FinishFragmentStateBuffer(fbb, b.Finish());
  return zstd_compress({fbb.GetBufferPointer(), fbb.GetSize()}, 1);
}

}  // namespace

TEST_CASE("a checkpoint streamed in segments reads back as the whole one", "[codec][segments]") {
  const auto layout = make_layout();
  const FragmentState state = make_state(layout);
  // 4 lists x 4 bytes = 16 bytes a value; 160 bytes: 10 values a segment; 154 values: 16 segments.
  CHECK(fragment_state_segments(state, 160) == 16);
  CHECK(fragment_state_segments(state, 154 * 16) == 1);
  CHECK(fragment_state_segments(state, 154 * 16 - 1) == 2);
  CHECK(fragment_state_segments(state, 1) == 154);  // never fewer than one value a segment
  CHECK_THROWS_AS(fragment_state_segments(state, 0), InvalidInput);

  const uint64_t segment_bytes = GENERATE(160, 16, 1000);
  const auto segments = segments_of(state, segment_bytes);
  REQUIRE(segments.size() == fragment_state_segments(state, segment_bytes));
  FragmentStateAssembler assembler(limits_for(layout));
  std::optional<FragmentState> got;
  for (size_t i = 0; i < segments.size(); ++i) {
    CHECK_FALSE(got.has_value());
    got = assembler.add(segments[i]);
    CHECK(assembler.pending() == (i + 1 < segments.size()));
  }
  REQUIRE(got.has_value());
  CHECK(got->version == 9);
  CHECK(got->checksum == xxh_of(state.params));
  REQUIRE(got->params.size() == 3);
  for (size_t k = 0; k < 3; ++k) {
    CHECK(got->params[k].shape == state.params[k].shape);
    CHECK(got->params[k].values == state.params[k].values);
    CHECK(got->momentum[k].values == state.momentum[k].values);
    CHECK(got->outer_state[k].values == state.outer_state[k].values);
    CHECK(got->downlink_residual[k].values == state.downlink_residual[k].values);
  }
  CHECK(got->consumed == state.consumed);
  CHECK(got->last_merge == state.last_merge);
  CHECK(got->accounted == state.accounted);
  CHECK(got->merged_bases == state.merged_bases);
  CHECK(got->recent == state.recent);
  CHECK(got->optimizer == OuterOptimizerKind::Cgad);
  CHECK(got->optimizer_since == 3);

  SECTION("a reader of the parameters only") {
    FragmentStateAssembler params_only(limits_for(layout), StateParts::ParamsOnly);
    std::optional<FragmentState> p;
    for (const auto& s : segments) p = params_only.add(s);
    REQUIRE(p.has_value());
    CHECK(flat(p->params) == flat(state.params));
    CHECK(p->momentum.empty());
    CHECK(p->outer_state.empty());
    CHECK(p->downlink_residual.empty());
  }
  SECTION("a reader without the layout takes segment 0's") {
    // A layout whose fingerprint is its own (the made-up one above is checked only by a reader
    // that holds it): the same tensors in one fragment.
    const auto real = partition_tensors(layout.tensors, 1);
    const auto real_state = make_state(real);
    DecodeLimits limits = limits_for(real);
    limits.layout = nullptr;
    FragmentStateAssembler own_layout(limits);
    std::optional<FragmentState> p;
    const auto real_segments = segments_of(real_state, segment_bytes);
    CHECK(real_segments.size() == fragment_state_segments(real_state, segment_bytes));
    for (const auto& s : real_segments) p = own_layout.add(s);
    REQUIRE(p.has_value());
    REQUIRE(p->layout != nullptr);
    CHECK(p->layout->fingerprint == real.fingerprint);
    CHECK(flat(p->downlink_residual) == flat(real_state.downlink_residual));
  }
  SECTION("the same assembler reads the next checkpoint") {
    const auto next = make_state(layout, 10);
    std::optional<FragmentState> p;
    for (const auto& s : segments_of(next, segment_bytes)) p = assembler.add(s);
    REQUIRE(p.has_value());
    CHECK(p->version == 10);
    CHECK(flat(p->momentum) == flat(next.momentum));
  }
}

TEST_CASE("a checkpoint that fits one segment travels as the whole message", "[codec][segments]") {
  const auto layout = make_layout();
  FragmentState state = make_state(layout);
  state.outer_state.clear();  // 3 lists: 12 bytes a value
  CHECK(fragment_state_segments(state, 154 * 12) == 1);
  const auto segments = segments_of(state, 154 * 12);
  REQUIRE(segments.size() == 1);
  CHECK(segments[0] == encode_fragment_state(state, 1));
  FragmentStateAssembler assembler(limits_for(layout));
  const auto got = assembler.add(segments[0]);
  REQUIRE(got.has_value());
  CHECK(flat(got->params) == flat(state.params));
  CHECK(got->outer_state.empty());
  CHECK_FALSE(assembler.pending());
  // Fewer lists, fewer bytes a value: a list the checkpoint lacks is absent from every segment.
  CHECK(fragment_state_segments(state, 12 * 10) == 16);
  std::optional<FragmentState> streamed;
  for (const auto& s : segments_of(state, 12 * 10)) streamed = assembler.add(s);
  REQUIRE(streamed.has_value());
  CHECK(streamed->outer_state.empty());
  CHECK(flat(streamed->momentum) == flat(state.momentum));
}

TEST_CASE("segments that do not continue their checkpoint are rejected, and the checkpoint dropped",
          "[codec][segments][reject]") {
  const auto layout = make_layout();
  const FragmentState state = make_state(layout);
  const auto segments = segments_of(state, 160);  // 16 segments
  REQUIRE(segments.size() == 16);
  const auto limits = limits_for(layout);
  FragmentStateAssembler assembler(limits);

  auto feed = [&](const std::vector<std::vector<uint8_t>>& list) {
    std::optional<FragmentState> out;
    for (const auto& s : list) out = assembler.add(s);
    return out;
  };

  SECTION("a missing segment") {
    (void)assembler.add(segments[0]);
    (void)assembler.add(segments[1]);
    CHECK_REJECTS(assembler.add(segments[3]), ChunkMismatch);
    CHECK_FALSE(assembler.pending());
    // The rest of that checkpoint is now without its segment 0.
    CHECK_REJECTS(assembler.add(segments[4]), ChunkMissing);
  }
  SECTION("a segment twice") {
    (void)assembler.add(segments[0]);
    CHECK_REJECTS(assembler.add(segments[0]), ChunkMismatch);
  }
  SECTION("a segment of another version in the middle") {
    const auto other = segments_of(make_state(layout, 10), 160);
    (void)assembler.add(segments[0]);
    CHECK_REJECTS(assembler.add(other[1]), ChunkMismatch);
  }
  SECTION("a whole checkpoint in the middle") {
    (void)assembler.add(segments[0]);
    CHECK_REJECTS(assembler.add(encode_fragment_state(state)), ChunkMissing);
  }
  SECTION("the whole-message decoder refuses a segment") {
    CHECK_REJECTS(decode_fragment_state(segments[0], limits), ChunkMismatch);
    CHECK_REJECTS(decode_fragment_state(segments[5], limits), ChunkMismatch);
  }
  SECTION("after any rejection a whole checkpoint reads") {
    (void)assembler.add(segments[0]);
    CHECK_REJECTS(assembler.add(segments[2]), ChunkMismatch);
    const auto got = feed(segments);
    REQUIRE(got.has_value());
    CHECK(flat(got->params) == flat(state.params));
  }
  SECTION("a changed value fails the checksum at the end") {
    FragmentState tampered = state;
    tampered.checksum = xxh_of(state.params);  // the original's
    tampered.params[1].values[3] += 1.0f;
    auto bad = segments_of(tampered, 160);
    std::optional<FragmentState> out;
    for (size_t i = 0; i + 1 < bad.size(); ++i) CHECK_FALSE(assembler.add(bad[i]).has_value());
    CHECK_REJECTS(assembler.add(bad.back()), CorruptFrame);
    CHECK_FALSE(assembler.pending());
  }
}

TEST_CASE("hand-written segments: the slices must tile the segment's range", "[codec][segments][reject]") {
  const auto layout = make_layout();
  const auto params = values_of(layout, 0, 5);
  const auto limits = limits_for(layout);
  // Two segments: values 0-139 (tensor 0 whole, tensor 1 at 0..7) and 139-153 (tensor 2 whole).
  const auto first = hand_segment(layout, params, 4, 0, 2, 0, 139, {{0, 0, 132}, {1, 0, 7}});
  const auto second = hand_segment(layout, params, 4, 1, 2, 139, 15, {{2, 0, 15}}, 2, false);

  SECTION("well formed: accepted") {
    FragmentStateAssembler a(limits);
    CHECK_FALSE(a.add(first).has_value());
    const auto got = a.add(second);
    REQUIRE(got.has_value());
    CHECK(flat(got->params) == flat(params));
    CHECK(got->momentum.empty());
  }
  SECTION("a segment range that splits a tensor") {
    const auto a0 = hand_segment(layout, params, 4, 0, 2, 0, 100, {{0, 0, 100}});
    const auto a1 = hand_segment(layout, params, 4, 1, 2, 100, 54, {{0, 100, 32}, {1, 0, 7}, {2, 0, 15}}, 2, false);
    FragmentStateAssembler a(limits);
    CHECK_FALSE(a.add(a0).has_value());
    const auto got = a.add(a1);
    REQUIRE(got.has_value());
    CHECK(flat(got->params) == flat(params));
  }
  FragmentStateAssembler a(limits);
  auto second_rejected_with = [&](const std::vector<uint8_t>& bad) {
    (void)a.add(first);
    return testing::rejection([&] { (void)a.add(bad); });
  };
  SECTION("a slice at the wrong offset") {
    CHECK(second_rejected_with(hand_segment(layout, params, 4, 1, 2, 139, 15, {{2, 1, 14}}, 2, false)) ==
          "shape_mismatch");
  }
  SECTION("a slice of the wrong tensor") {
    CHECK(second_rejected_with(hand_segment(layout, params, 4, 1, 2, 139, 15, {{1, 0, 7}}, 2, false)) ==
          "shape_mismatch");
  }
  SECTION("slices that stop short of the range") {
    CHECK(second_rejected_with(hand_segment(layout, params, 4, 1, 2, 139, 15, {{2, 0, 10}}, 2, false)) ==
          "bad_codec");
  }
  SECTION("no slices at all") {
    CHECK(second_rejected_with(hand_segment(layout, params, 4, 1, 2, 139, 15, {}, 2, false)) == "chunk_mismatch");
  }
  SECTION("a range that skips values") {
    CHECK(second_rejected_with(hand_segment(layout, params, 4, 1, 2, 140, 14, {{2, 1, 14}}, 2, false)) ==
          "chunk_mismatch");
  }
  SECTION("a last segment that ends before the fragment does") {
    CHECK(second_rejected_with(hand_segment(layout, params, 4, 1, 2, 139, 14, {{2, 0, 14}}, 2, false)) ==
          "chunk_mismatch");
  }
  SECTION("a range past the fragment") {
    CHECK(second_rejected_with(hand_segment(layout, params, 4, 1, 2, 139, 16, {{2, 0, 15}}, 2, false)) ==
          "chunk_mismatch");
  }
  SECTION("a segment of schema version 1") {
    CHECK(testing::rejection([&] { (void)a.add(hand_segment(layout, params, 4, 0, 2, 0, 139, {{0, 0, 132}, {1, 0, 7}}, 1)); }) ==
          "unknown_schema_version");
  }
  SECTION("a streamed checkpoint of one segment") {
    CHECK(testing::rejection([&] { (void)a.add(hand_segment(layout, params, 4, 0, 1, 0, 154, {{0, 0, 132}, {1, 0, 7}, {2, 0, 15}})); }) ==
          "bad_counter");
  }
  SECTION("segment 0 without the layout, for a reader without one") {
    DecodeLimits no_layout = limits;
    no_layout.layout = nullptr;
    FragmentStateAssembler b(no_layout);
    CHECK(testing::rejection([&] { (void)b.add(hand_segment(layout, params, 4, 0, 2, 0, 139, {{0, 0, 132}, {1, 0, 7}}, 2, false)); }) ==
          "missing_field");
  }
}

// ---- streamed snapshots and proposals -------------------------------------------------------

namespace {

FragmentParams snapshot_header(const FragmentLayout& layout, uint32_t fragment, uint64_t version,
                               const std::string& merger = "merger-a", uint64_t epoch = 3) {
  return FragmentParams{.run_id = "run-1", .fingerprint = layout.fingerprint, .fragment = fragment,
                        .version = version, .checksum = 0, .merger_instance = merger, .epoch = epoch};
}

std::vector<std::vector<uint8_t>> snapshot_segments(const FragmentParams& header, const std::vector<DenseTensor>& values,
                                                    uint64_t segment_bytes) {
  std::vector<std::vector<uint8_t>> out;
  for_each_fragment_params_segment(header, values, segment_bytes, 1,
                                   [&](uint32_t index, uint32_t count, std::span<const uint8_t> b) {
                                     CHECK(index == out.size());
                                     CHECK(count == fragment_params_segments(header, values, segment_bytes));
                                     out.emplace_back(b.begin(), b.end());
                                   });
  return out;
}

GenesisProposal proposal_of(const FragmentLayout& layout, const std::string& learner, uint32_t fragment, uint64_t seq) {
  return GenesisProposal{.run_id = "run-1", .fingerprint = layout.fingerprint, .learner_id = learner,
                         .region = "eu", .fragment = fragment, .seq = seq, .send_time_us = 17,
                         .layout = std::make_shared<const FragmentLayout>(layout),
                         .tensors = values_of(layout, fragment, seq)};
}

std::vector<std::vector<uint8_t>> proposal_segments(const GenesisProposal& p, uint64_t segment_bytes) {
  std::vector<std::vector<uint8_t>> out;
  for_each_genesis_proposal_segment(p, segment_bytes, 1, [&](uint32_t index, uint32_t count, std::span<const uint8_t> b) {
    CHECK(index == out.size());
    CHECK(count == genesis_proposal_segments(p, segment_bytes));
    out.emplace_back(b.begin(), b.end());
  });
  return out;
}

}  // namespace

TEST_CASE("a snapshot streamed in segments reads back as the whole one", "[codec][segments]") {
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  const auto values = values_of(layout, 0, 42);
  const auto header = snapshot_header(layout, 0, 7);
  // 154 values of 4 bytes: one value a segment, segments that split tensors, two segments.
  for (const auto& [segment_bytes, expected] : std::vector<std::pair<uint64_t, size_t>>{{4, 154}, {100, 7}, {600, 2}}) {
    INFO("segment bytes " << segment_bytes);
    const auto segments = snapshot_segments(header, values, segment_bytes);
    REQUIRE(segments.size() == expected);
    FragmentParamsAssembler assembler(limits);
    std::optional<FragmentParams> got;
    size_t bytes = 0;
    for (size_t i = 0; i < segments.size(); ++i) {
      bytes += segments[i].size();
      got = assembler.add(segments[i]);
      CHECK(got.has_value() == (i + 1 == segments.size()));
      CHECK(assembler.pending() == (i + 1 == segments.size() ? 0u : 1u));
    }
    REQUIRE(got.has_value());
    CHECK(flat(got->tensors) == flat(values));
    CHECK(got->checksum == xxh_of(values));
    CHECK(got->version == 7);
    CHECK(got->merger_instance == "merger-a");
    CHECK(got->epoch == 3);
    CHECK_FALSE(got->update);
    CHECK(got->wire_bytes == bytes);
    for (size_t k = 0; k < values.size(); ++k) CHECK(got->tensors[k].shape == values[k].shape);
    // The whole-message decoder points to the assembler.
    CHECK_REJECTS(decode_fragment_params(segments[0], limits), ChunkMismatch);
  }
  SECTION("a snapshot that fits one segment is the whole message, read by both readers") {
    const auto segments = snapshot_segments(header, values, 616);
    REQUIRE(segments.size() == 1);
    FragmentParams whole = header;
    whole.tensors = values;
    CHECK(segments[0] == encode_fragment_params(whole));
    CHECK(flat(decode_fragment_params(segments[0], limits).tensors) == flat(values));
    FragmentParamsAssembler assembler(limits);
    const auto got = assembler.add(segments[0]);
    REQUIRE(got.has_value());
    CHECK(flat(got->tensors) == flat(values));
  }
  SECTION("updates never travel in segments") {
    FragmentParams update = header;
    update.update = true;
    update.base_version = 6;
    CHECK_THROWS_AS(fragment_params_segments(update, values, 100), InvalidInput);
  }
}

TEST_CASE("snapshot segments of different fragments interleave, and whole messages pass by", "[codec][segments]") {
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  const auto values0 = values_of(layout, 0, 1);
  const auto values1 = values_of(layout, 1, 2);
  const auto a = snapshot_segments(snapshot_header(layout, 0, 5), values0, 200);   // 4 segments
  const auto b = snapshot_segments(snapshot_header(layout, 1, 8), values1, 8);     // 2 segments
  REQUIRE(a.size() == 4);
  REQUIRE(b.size() == 2);
  FragmentParams whole1 = snapshot_header(layout, 1, 9);
  whole1.tensors = values_of(layout, 1, 3);
  FragmentParamsAssembler assembler(limits);
  CHECK_FALSE(assembler.add(a[0]));
  CHECK_FALSE(assembler.add(b[0]));
  CHECK_FALSE(assembler.add(a[1]));
  const auto passed = assembler.add(encode_fragment_params(whole1));  // while both are begun
  REQUIRE(passed.has_value());
  CHECK(passed->version == 9);
  CHECK(assembler.pending() == 2);
  const auto got1 = assembler.add(b[1]);
  REQUIRE(got1.has_value());
  CHECK(flat(got1->tensors) == flat(values1));
  CHECK_FALSE(assembler.add(a[2]));
  const auto got0 = assembler.add(a[3]);
  REQUIRE(got0.has_value());
  CHECK(flat(got0->tensors) == flat(values0));
  CHECK(assembler.pending() == 0);
}

TEST_CASE("snapshot segments that do not continue their snapshot are rejected, and it is dropped",
          "[codec][segments][reject]") {
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  const auto values = values_of(layout, 0, 4);
  const auto segments = snapshot_segments(snapshot_header(layout, 0, 11), values, 100);  // 7 segments
  REQUIRE(segments.size() == 7);
  FragmentParamsAssembler assembler(limits);
  auto feed_all = [&](const std::vector<std::vector<uint8_t>>& list) {
    std::optional<FragmentParams> out;
    for (const auto& s : list) out = assembler.add(s);
    return out;
  };
  SECTION("a lost segment, then the rest without its start") {
    (void)assembler.add(segments[0]);
    CHECK_REJECTS(assembler.add(segments[2]), ChunkMismatch);
    CHECK(assembler.pending() == 0);
    CHECK_REJECTS(assembler.add(segments[3]), ChunkMissing);
  }
  SECTION("a segment 0 begins again: the snapshot sent again after a loss reads whole") {
    (void)assembler.add(segments[0]);
    (void)assembler.add(segments[1]);
    const auto got = feed_all(segments);
    REQUIRE(got.has_value());
    CHECK(flat(got->tensors) == flat(values));
  }
  SECTION("a segment of another version, merger or epoch in the middle") {
    const auto other_version = snapshot_segments(snapshot_header(layout, 0, 12), values, 100);
    const auto other_merger = snapshot_segments(snapshot_header(layout, 0, 11, "merger-b"), values, 100);
    const auto other_epoch = snapshot_segments(snapshot_header(layout, 0, 11, "merger-a", 4), values, 100);
    for (const auto* other : {&other_version, &other_merger, &other_epoch}) {
      (void)assembler.add(segments[0]);
      CHECK_REJECTS(assembler.add((*other)[1]), ChunkMismatch);
      CHECK(assembler.pending() == 0);
    }
  }
  SECTION("a changed value fails the checksum at the end") {
    auto header = snapshot_header(layout, 0, 11);
    header.checksum = xxh_of(values);
    auto tampered = values;
    tampered[2].values[1] += 1.0f;
    const auto bad = snapshot_segments(header, tampered, 100);
    for (size_t i = 0; i + 1 < bad.size(); ++i) CHECK_FALSE(assembler.add(bad[i]).has_value());
    CHECK_REJECTS(assembler.add(bad.back()), CorruptFrame);
    CHECK(assembler.pending() == 0);
  }
  SECTION("another run's or model's segments") {
    DecodeLimits other_run = limits;
    other_run.run_id = "run-2";
    FragmentParamsAssembler a2(other_run);
    CHECK_REJECTS(a2.add(segments[0]), WrongRunId);
    DecodeLimits other_model = limits;
    other_model.fingerprint ^= 1;
    FragmentParamsAssembler a3(other_model);
    CHECK_REJECTS(a3.add(segments[0]), WrongFingerprint);
  }
}

TEST_CASE("a proposal streamed in segments reads back as the whole one, several learners interleaved",
          "[codec][segments]") {
  // A layout whose fingerprint is its own (the proposal's reader derives it from the tensors).
  const auto layout = partition_tensors(make_layout().tensors, 2);
  DecodeLimits any = limits_for(layout);
  any.layout = nullptr;  // as a merger reads proposals: against the layout they carry
  any.fingerprint = 0;
  const auto pa = proposal_of(layout, "learner-a", 0, 5);
  const auto pb = proposal_of(layout, "learner-b", 0, 9);
  const auto a = proposal_segments(pa, 120);
  const auto b = proposal_segments(pb, 60);
  REQUIRE(a.size() >= 3);
  REQUIRE(b.size() > a.size());
  GenesisProposalAssembler assembler(any);
  std::optional<GenesisProposal> got_a, got_b;
  for (size_t i = 0; i < b.size(); ++i) {
    if (i < a.size()) got_a = assembler.add(a[i]);
    got_b = assembler.add(b[i]);
  }
  REQUIRE(got_a.has_value());
  REQUIRE(got_b.has_value());
  CHECK(got_a->learner_id == "learner-a");
  CHECK(got_a->seq == 5);
  CHECK(flat(got_a->tensors) == flat(pa.tensors));
  CHECK(got_a->checksum == xxh_of(pa.tensors));
  REQUIRE(got_a->layout);
  CHECK(got_a->layout->fingerprint == layout.fingerprint);
  CHECK(flat(got_b->tensors) == flat(pb.tensors));
  CHECK(assembler.pending() == 0);
  CHECK_REJECTS(decode_genesis_proposal(a[0], any), ChunkMismatch);
  // One that fits a segment is the whole message, as encode_genesis_proposal writes it.
  const auto whole = proposal_segments(pa, 1 << 20);
  REQUIRE(whole.size() == 1);
  CHECK(whole[0] == encode_genesis_proposal(pa));
  CHECK(assembler.add(whole[0]).has_value());
}

TEST_CASE("streamed proposals: bounded, strict, and dropped on a rejection", "[codec][segments][reject]") {
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  const auto p = proposal_of(layout, "learner-a", 0, 5);
  const auto segments = proposal_segments(p, 100);
  SECTION("at most max_open proposals begun") {
    GenesisProposalAssembler assembler(limits, 2);
    (void)assembler.add(proposal_segments(proposal_of(layout, "learner-b", 0, 1), 100)[0]);
    (void)assembler.add(proposal_segments(proposal_of(layout, "learner-c", 0, 1), 100)[0]);
    CHECK_REJECTS(assembler.add(segments[0]), TooLarge);
    CHECK(assembler.pending() == 2);
  }
  SECTION("a lost segment: the proposal dropped where it began") {
    GenesisProposalAssembler assembler(limits);
    const LogPosition head{"diloco.run-1.genesis", 0, 40};
    (void)assembler.add(segments[0], head);
    CHECK(assembler.open_heads() == std::vector<LogPosition>{head});
    CHECK_REJECTS(assembler.add(segments[2], {"diloco.run-1.genesis", 0, 42}), ChunkMismatch);
    CHECK(assembler.dropped_head() == std::optional<LogPosition>(head));
    CHECK(assembler.pending() == 0);
    CHECK(assembler.open_heads().empty());
    CHECK_REJECTS(assembler.add(segments[3], {"diloco.run-1.genesis", 0, 43}), ChunkMissing);
    CHECK_FALSE(assembler.dropped_head().has_value());  // it began nothing
  }
  SECTION("a segment's index from its header alone") {
    for (size_t i = 0; i < segments.size(); ++i) CHECK(genesis_proposal_segment(segments[i], limits) == i);
    CHECK(genesis_proposal_segment(encode_genesis_proposal(p), limits) == 0);
    DecodeLimits other = limits;
    other.run_id = "run-2";
    CHECK_REJECTS(genesis_proposal_segment(segments[1], other), WrongRunId);
  }
  SECTION("a changed value fails the checksum at the end") {
    auto tampered = p;
    tampered.checksum = xxh_of(p.tensors);
    tampered.tensors[0].values[5] -= 1.0f;
    const auto bad = proposal_segments(tampered, 100);
    GenesisProposalAssembler assembler(limits);
    for (size_t i = 0; i + 1 < bad.size(); ++i) CHECK_FALSE(assembler.add(bad[i]).has_value());
    CHECK_REJECTS(assembler.add(bad.back()), CorruptFrame);
    CHECK(assembler.pending() == 0);
  }
}

namespace {

std::vector<ConsumedMessage> records_of(const std::vector<std::vector<uint8_t>>& segments, int64_t& offset) {
  std::vector<ConsumedMessage> out;
  for (const auto& bytes : segments) {
    ConsumedMessage m;
    m.topic = "diloco.run-1.state";
    m.partition = 0;
    m.offset = offset++;
    m.value = bytes;
    out.push_back(std::move(m));
  }
  return out;
}

}  // namespace

TEST_CASE("a streamed checkpoint's beginning is told before any of its values are held", "[codec][segments]") {
  const auto layout = make_layout();
  FragmentStateAssembler assembler(limits_for(layout));
  struct Begun {
    uint32_t fragment;
    uint64_t version;
    bool holds_values;
  };
  std::vector<Begun> begun;
  assembler.on_begin([&](const FragmentState& head) {
    begun.push_back({head.fragment, head.version, !head.params.empty() || !head.momentum.empty()});
  });
  const auto streamed = segments_of(make_state(layout, 4), 160);
  REQUIRE(streamed.size() == 16);
  for (size_t i = 0; i < streamed.size(); ++i) {
    (void)assembler.add(streamed[i]);
    CHECK(begun.size() == 1);  // at segment 0 only
  }
  CHECK(begun[0].fragment == 0);
  CHECK(begun[0].version == 4);
  CHECK_FALSE(begun[0].holds_values);
  // A checkpoint in one message is not streamed: nothing begins, it is whole at once.
  const auto whole = segments_of(make_state(layout, 6), 154 * 16);
  REQUIRE(whole.size() == 1);
  CHECK(assembler.add(whole[0]).has_value());
  CHECK(begun.size() == 1);
}

TEST_CASE("the newest checkpoint of a fragment: the one held is let go when a newer one begins", "[codec][segments]") {
  const auto layout = make_layout();
  const FragmentState v3 = make_state(layout, 3), v5 = make_state(layout, 5);
  int64_t offset = 0;
  const auto older = records_of(segments_of(v3, 160), offset);
  const auto newer = records_of(segments_of(v5, 160), offset);
  const std::vector<uint32_t> fragments{0};

  SECTION("a newer one that completes replaces it, never held beside it") {
    NewestCheckpoints newest(limits_for(layout), fragments, true);
    for (const auto& m : older) newest.add(m);
    REQUIRE(newest.newest().count(0) == 1);
    CHECK(newest.newest().at(0).state.version == 3);
    newest.add(newer[0]);
    CHECK(newest.newest().count(0) == 0);  // let go before version 5's values were read
    for (size_t i = 1; i < newer.size(); ++i) newest.add(newer[i]);
    CHECK(newest.complete());
    REQUIRE(newest.newest().count(0) == 1);
    const auto& got = newest.newest().at(0);
    CHECK(got.state.version == 5);
    CHECK(got.position.offset == newer[0].offset);
    CHECK(got.records == newer.size());
    CHECK(got.state.params[0].values == v5.params[0].values);
  }
  SECTION("a newer one cut short: not complete, and read again keeping the older one, it is found") {
    NewestCheckpoints newest(limits_for(layout), fragments, true);
    for (const auto& m : older) newest.add(m);
    for (size_t i = 0; i < 8; ++i) newest.add(newer[i]);
    CHECK_FALSE(newest.complete());
    NewestCheckpoints again(limits_for(layout), fragments, false);
    for (const auto& m : older) again.add(m);
    for (size_t i = 0; i < 8; ++i) again.add(newer[i]);
    CHECK(again.complete());
    REQUIRE(again.newest().count(0) == 1);
    CHECK(again.newest().at(0).state.version == 3);
    CHECK(again.newest().at(0).state.params[0].values == v3.params[0].values);
  }
  SECTION("an older one that begins after a newer one lets nothing go") {
    NewestCheckpoints newest(limits_for(layout), fragments, true);
    for (const auto& m : newer) newest.add(m);
    newest.add(older[0]);
    REQUIRE(newest.newest().count(0) == 1);
    CHECK(newest.newest().at(0).state.version == 5);
    for (size_t i = 1; i < older.size(); ++i) newest.add(older[i]);
    CHECK(newest.complete());
    CHECK(newest.newest().at(0).state.version == 5);
  }
  SECTION("a fragment not asked for is not kept") {
    const std::vector<uint32_t> other{1};
    NewestCheckpoints newest(limits_for(layout), other, true);
    for (const auto& m : older) newest.add(m);
    CHECK(newest.newest().empty());
    CHECK(newest.complete());
  }
}
