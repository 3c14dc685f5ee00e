// The start-up size check: the bounds hold for real encoded messages of incompressible values
// (a bound below what the encoder produces would let a config through that then fails mid-run),
// and a layout that cannot travel is refused with the numbers and the setting to change.
#include <catch2/catch.hpp>

#include <random>

#include "core/codec/messages.h"
#include "core/errors.h"
#include "core/codec/chunk.h"
#include "core/fragments/message_budget.h"
#include "core/fragments/partition.h"

using namespace diloco;

namespace {

std::vector<DenseTensor> random_tensors(const std::vector<std::vector<int64_t>>& shapes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<DenseTensor> out;
  for (uint32_t i = 0; i < shapes.size(); ++i) {
    DenseTensor t{i, shapes[i], {}};
    int64_t n = 1;
    for (auto d : shapes[i]) n *= d;
    t.values.resize(static_cast<size_t>(n));
    for (auto& v : t.values) v = normal(rng);
    out.push_back(std::move(t));
  }
  return out;
}

FragmentLayout layout_of(const std::vector<std::vector<TensorSpec>>& fragments) {
  FragmentLayout layout;
  layout.fragments = fragments;
  layout.fingerprint = 7;
  return layout;
}

}  // namespace

TEST_CASE("message bounds hold for encoded messages of random values", "[budget]") {
  const std::vector<std::vector<int64_t>> shapes = {{300, 257}, {257}, {64, 3, 5}};
  const int64_t n = 300 * 257 + 257 + 64 * 3 * 5;
  auto tensors = random_tensors(shapes, 1);

  // A checkpoint carries the run's whole layout (names and shapes) besides its own fragment.
  const auto layout = std::make_shared<const FragmentLayout>(partition_tensors(
      std::vector<TensorSpec>{{"blocks.0.mlp.up.weight", shapes[0]}, {"blocks.0.mlp.up.bias", shapes[1]},
                              {"blocks.0.attn.conv.weight", shapes[2]}},
      1));
  FragmentState state;
  state.run_id = "budget";
  state.fingerprint = layout->fingerprint;
  state.layout = layout;
  state.params = tensors;
  state.momentum = random_tensors(shapes, 2);
  const auto state_bytes = encode_fragment_state(state, 1).size();
  CHECK(state_bytes <= state_bytes_bound(n, shapes.size(), false));
  CHECK(state_bytes_bound(n, shapes.size(), false) < state_bytes + (3u << 20));  // bounds, not guesses
  state.outer_state = random_tensors(shapes, 3);
  CHECK(encode_fragment_state(state, 1).size() <= state_bytes_bound(n, shapes.size(), true));
  state.downlink_residual = random_tensors(shapes, 4);  // a quantized downlink's error feedback
  const auto with_residual = encode_fragment_state(state, 1).size();
  CHECK(state_bytes_bound(n, shapes.size(), true, true) >= state_bytes_bound(n, shapes.size(), true) + 4 * n);
  CHECK(with_residual <= state_bytes_bound(n, shapes.size(), true, true));

  // A proposal of version 0 holds one buffer: within the checkpoint's bound, which the decoders'
  // limit covers.
  GenesisProposal proposal{.run_id = "budget", .fingerprint = layout->fingerprint, .learner_id = "learner-0",
                           .region = "eu", .fragment = 0, .seq = 1, .layout = layout, .tensors = tensors};
  CHECK(encode_genesis_proposal(proposal, 1).size() <= state_bytes_bound(n, shapes.size(), false));

  FragmentParams params;
  params.run_id = "budget";
  params.fingerprint = 7;
  params.merger_instance = "merger-0";
  params.tensors = tensors;
  CHECK(encode_fragment_params(params, 1).size() <= params_bytes_bound(n, shapes.size()));

  DeltaHeader h;
  h.run_id = "budget";
  h.learner_id = "learner-0";
  h.region = "eu";
  for (DType dtype : {DType::F32, DType::BF16, DType::INT8, DType::INT4}) {
    CodecOptions options{.dtype = dtype, .block_size = 64, .byte_shuffle = true, .zstd_level = 3};
    const auto bytes = encode_delta(h, std::span<const DenseTensor>(tensors), options);
    INFO(dtype_name(dtype));
    CHECK(bytes.size() <= delta_bytes_bound(n, shapes.size(), dtype, 64));
  }
}

TEST_CASE("a checkpoint, snapshot or proposal above codec.segment_bytes is bounded by its segment", "[budget]") {
  RunConfig config;  // nesterov, int4 deltas and downlink: params, momentum and residual, 12 B per parameter
  // Four 80M-parameter tensors in one fragment: 3.84 GB of checkpoint and 1.28 GB of fp32
  // parameters, both streamed in segments of 256 MiB; the int4 delta (about 0.56 bytes a
  // parameter, 180 MB) is below a segment.
  std::vector<TensorSpec> four;
  for (int i = 0; i < 4; ++i) four.push_back({"w" + std::to_string(i), {8000, 10000}});
  auto one = layout_of({four});
  CHECK(largest_message(config, one).kind == "checkpoint");  // a segment and the bookkeeping's bound
  CHECK(largest_message(config, one).numel == 320'000'000);
  CHECK(largest_message(config, one).bytes > 256ull << 20);
  CHECK(largest_message(config, one).bytes < (257ull << 20) * 102 / 100);  // zstd's worst case and framing
  CHECK(delta_bytes_bound(320'000'000, 4, DType::INT4, 64) > 160'000'000ull);
  CHECK_NOTHROW(check_message_sizes(config, one, 64ull << 20));
  // Streamed only above codec.segment_bytes: a small fragment's checkpoint is the whole message.
  auto small = layout_of({{{"w", {1000, 1000}}}});  // 12 MB of checkpoint, below 256 MiB
  CHECK(largest_message(config, small).kind == "checkpoint");
  CHECK(largest_message(config, small).bytes >= 12'000'000ull);
  config.codec.segment_bytes = 1 << 20;  // now streamed in segments of 1 MiB of values
  CHECK(largest_message(config, small).kind == "checkpoint");
  CHECK(largest_message(config, small).bytes < 3'000'000ull);  // a segment and the bookkeeping, not 12 MB
  // 100M parameters in segments of 16 MiB: the whole messages are the largest. By default deltas
  // and updates are both int4 in blocks of 64 (0.56 bytes a parameter); int8 updates are about
  // twice that; an fp32 downlink sends snapshots, which stream.
  auto large = layout_of({{{"w", {10000, 10000}}}});
  config.codec.segment_bytes = 16 << 20;
  CHECK(largest_message(config, large).kind == "delta");
  CHECK(largest_message(config, large).bytes >= 56'000'000ull);
  config.codec.downlink_dtype = DType::INT8;
  CHECK(largest_message(config, large).kind == "update");
  CHECK(largest_message(config, large).bytes >= 100'000'000ull);
  config.codec.downlink_dtype = DType::F32;
  CHECK(largest_message(config, large).kind == "delta");
  CHECK(largest_message(config, large).bytes >= 53'000'000ull);
}

TEST_CASE("readers still take a checkpoint written whole, up to one FlatBuffer", "[budget]") {
  RunConfig config;
  // 30M parameters: 360 MB of checkpoint, streamed in segments of 256 MiB, but a binary that
  // predates streaming wrote it whole; a reader's limit takes it.
  auto mid = layout_of({{{"w", {3000, 10000}}}});
  CHECK(largest_message(config, mid).bytes < 360'000'000ull);
  CHECK(logical_message_limit(config, mid) >= 360'000'000ull);
  CHECK(logical_message_limit(config, mid) >= state_bytes_bound(30'000'000, 1, false, true));
  // Never above what one FlatBuffer holds.
  std::vector<TensorSpec> four;
  for (int i = 0; i < 4; ++i) four.push_back({"w" + std::to_string(i), {8000, 10000}});
  CHECK(logical_message_limit(config, layout_of({four})) == kMaxLogicalMessageBytes);
}

TEST_CASE("a layout whose deltas cannot fit one buffer is refused with the way out", "[budget]") {
  RunConfig config;
  config.codec.dtype = DType::F32;  // fp32 deltas: 4 bytes a parameter, built whole
  config.codec.topk = 0;
  const uint64_t record_limit = 64ull << 20;
  // Four 150M-parameter tensors: 2.4 GB of fp32 delta in one fragment, 1.2 GB in each of two,
  // against the 2 GiB one FlatBuffer can hold.
  std::vector<TensorSpec> four;
  for (int i = 0; i < 4; ++i) four.push_back({"w" + std::to_string(i), {15000, 10000}});
  auto one = layout_of({four});
  auto two = layout_of({{four[0], four[1]}, {four[2], four[3]}});
  CHECK(largest_message(config, one).kind == "delta");
  CHECK_NOTHROW(check_message_sizes(config, two, record_limit));
  try {
    check_message_sizes(config, one, record_limit);
    FAIL("a 600M-parameter fragment of fp32 deltas passed");
  } catch (const InvalidInput& e) {
    const std::string what = e.what();
    CHECK_THAT(what, Catch::Contains("fragment 0 has 600000000 parameters"));
    CHECK_THAT(what, Catch::Contains("delta message"));
    CHECK_THAT(what, Catch::Contains(std::to_string(kMaxLogicalMessageBytes) + "-byte limit"));
    CHECK_THAT(what, Catch::Contains("set diloco.fragments to at least 2 (now 1)"));
    CHECK_THAT(what, Catch::Contains("codec.dtype = \"int4\""));
  }
  // With int4 deltas the same fragment travels: its parameters, checkpoint and proposal stream.
  config.codec.dtype = DType::INT4;
  CHECK_NOTHROW(check_message_sizes(config, one, record_limit));
  // Neither dn's fourth buffer nor any other checkpoint buffer changes that: checkpoints stream.
  config.merger.optimizer = "dn";
  CHECK_NOTHROW(check_message_sizes(config, one, record_limit));
  // Five billion parameters in one fragment: even its int4 delta and update pass 2 GiB; two fragments
  // bring each under it.
  std::vector<TensorSpec> huge;
  for (int i = 0; i < 5; ++i) huge.push_back({"h" + std::to_string(i), {100000, 10000}});
  try {
    check_message_sizes(config, layout_of({huge}), record_limit);
    FAIL("a 5B-parameter fragment passed");
  } catch (const InvalidInput& e) {
    const std::string what = e.what();
    CHECK_THAT(what, Catch::Contains("parameters: its "));
    CHECK_THAT(what, Catch::Contains("set diloco.fragments to at least 2 (now 1)"));
  }
}

TEST_CASE("chunks larger than one Kafka record are refused at start-up, naming both sizes", "[budget]") {
  RunConfig config;
  // A fragment far above one record travels in chunks: 12M parameters, 144 MB of checkpoint.
  auto layout = layout_of({{{"w", {3000, 4000}}}});
  CHECK(largest_message(config, layout).bytes > (64ull << 20));
  CHECK_NOTHROW(check_message_sizes(config, layout, 64ull << 20));  // 4 MiB chunks
  config.codec.chunk_bytes = 64ull << 20;
  try {
    check_message_sizes(config, layout, 64ull << 20);
    FAIL("64 MiB chunks passed a 64 MiB record limit");
  } catch (const InvalidInput& e) {
    const std::string what = e.what();
    CHECK_THAT(what, Catch::Contains("codec.chunk_bytes is 67108864 bytes"));
    CHECK_THAT(what, Catch::Contains("67108864-byte limit of one Kafka record"));
    CHECK_THAT(what, Catch::Contains("lower codec.chunk_bytes to at most " + std::to_string((64ull << 20) - kChunkOverhead)));
  }
  config.codec.chunk_bytes = (64ull << 20) - kChunkOverhead;
  CHECK_NOTHROW(check_message_sizes(config, layout, 64ull << 20));
}
