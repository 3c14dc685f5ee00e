// The wire contract (core/codec/messages.h): round trips of every message, field by field, and
// every rejection reason triggered by a crafted input. Hostile inputs are built by hand with the
// generated FlatBuffers builder, so they do not depend on the encoder under test.
#include <catch2/catch.hpp>

#include <xxhash.h>
#include <zstd.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <set>

#include "core/codec/compress.h"
#include "core/codec/messages.h"
#include "schemas/delta_generated.h"
#include "tests/rejection.h"

using namespace diloco;
using testing::rejection;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// By hand, with a made-up fingerprint: decoding with the reader's layout checks the fingerprint
// and the fragments' shapes only (tests/unit/test_genesis_messages.cpp has self-described ones).
FragmentLayout make_layout() {
  FragmentLayout layout;
  layout.fingerprint = 0xF1F2F3F4A5A6A7A8ull;
  layout.fragments = {
      {{"blocks.0.attn", {4, 33}}, {"blocks.0.norm", {7}}, {"blocks.0.mlp", {3, 1, 5}}},
      {{"head", {2, 2}}},
  };
  layout.tensors = {layout.fragments[0][0], layout.fragments[0][1], layout.fragments[0][2], layout.fragments[1][0]};
  return layout;
}

// A checkpoint carries the run's layout.
std::shared_ptr<const FragmentLayout> carried(const FragmentLayout& layout) {
  return std::make_shared<const FragmentLayout>(layout);
}

DecodeLimits limits_for(const FragmentLayout& layout) {
  DecodeLimits limits;
  limits.run_id = "run-1";
  limits.fingerprint = layout.fingerprint;
  limits.layout = &layout;
  return limits;
}

std::vector<DenseTensor> dense_fragment(const FragmentLayout& layout, uint32_t fragment,
                                        uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<DenseTensor> out;
  const auto& specs = layout.fragments[fragment];
  for (size_t k = 0; k < specs.size(); ++k) {
    std::normal_distribution<float> dist(0.0f, 0.01f * static_cast<float>(k + 1));
    DenseTensor t;
    t.index = static_cast<uint32_t>(k);
    t.shape = specs[k].shape;
    t.values.resize(static_cast<size_t>(specs[k].numel()));
    for (auto& v : t.values) v = dist(rng);
    out.push_back(std::move(t));
  }
  return out;
}

DeltaHeader make_header(uint32_t fragment) {
  DeltaHeader h;
  h.run_id = "run-1";
  h.fingerprint = make_layout().fingerprint;
  h.learner_id = "learner-7";
  h.region = "eu-west";
  h.fragment = fragment;
  h.seq = 12;
  h.base_version = 40;
  h.inner_steps = 50;
  h.tokens = 50 * 8192;
  h.learner_step = 6000;
  h.train_loss = 2.75f;
  h.send_time_us = 1'700'000'000'000'000;
  return h;
}

CodecOptions codec(DType dtype, bool shuffle = true, uint32_t block = 16) {
  CodecOptions o;
  o.dtype = dtype;
  o.block_size = block;
  o.byte_shuffle = shuffle;
  return o;
}

std::vector<uint8_t> encode(const DeltaHeader& h, const std::vector<DenseTensor>& tensors,
                            const CodecOptions& options) {
  return encode_delta(h, std::span<const DenseTensor>(tensors), options);
}

std::string name(RejectReason r) { return reject_reason_name(r); }

// decode_delta both ways, fp32 and int8/int4 kept as sent: the two must accept the same bytes or
// reject them for the same reason. Returns (or throws) what the fp32 decoding does.
Delta decode_both(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  const std::string as_sent = rejection([&] { (void)decode_delta(bytes, limits, DeltaValues::AsSent); });
  const std::string dense = rejection([&] { (void)decode_delta(bytes, limits); });
  CHECK(as_sent == dense);
  return decode_delta(bytes, limits);
}

// ---- a Delta built by hand ------------------------------------------------------------------

struct RawTensor {
  uint32_t index = 0;
  std::optional<std::vector<int64_t>> shape;
  std::optional<std::vector<float>> scales;
  std::optional<std::vector<uint8_t>> payload;
  std::optional<std::vector<uint8_t>> gaps;    // the sparse form (core/codec/sparse.h)
  std::optional<std::vector<uint8_t>> values;
};

struct RawDelta {
  const char* identifier = "DDLT";  // nullptr: no identifier
  uint16_t schema_version = kSchemaVersion;
  std::optional<std::string> run_id = "run-1";
  uint64_t fingerprint = make_layout().fingerprint;
  std::optional<std::string> learner_id = "learner-1";
  std::optional<std::string> region = "us";
  uint32_t fragment = 1;
  uint64_t seq = 1, base_version = 0, tokens = 1000, learner_step = 10;
  uint32_t inner_steps = 10;
  float train_loss = 1.0f;
  bool has_codec = true;
  uint8_t dtype = 2;  // INT8
  uint32_t block_size = 2;
  uint32_t topk = 0;
  bool byte_shuffle = false;
  bool sparse = false;
  std::optional<std::vector<RawTensor>> tensors = std::vector<RawTensor>{
      {0, std::vector<int64_t>{2, 2}, std::vector<float>{0.5f, 0.25f},
       std::vector<uint8_t>{1, 2, 0xFF, 0x80}}};
};

std::vector<uint8_t> build_flatbuffer(const RawDelta& r) {
  flatbuffers::FlatBufferBuilder fbb;
  flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<wire::Tensor>>> tensors;
  if (r.tensors) {
    std::vector<flatbuffers::Offset<wire::Tensor>> offsets;
    for (const auto& t : *r.tensors) {
      const auto shape = t.shape ? fbb.CreateVector(*t.shape) : 0;
      const auto scales = t.scales ? fbb.CreateVector(*t.scales) : 0;
      const auto payload = t.payload ? fbb.CreateVector(*t.payload) : 0;
      const auto gaps = t.gaps ? fbb.CreateVector(*t.gaps) : 0;
      const auto values = t.values ? fbb.CreateVector(*t.values) : 0;
      offsets.push_back(wire::CreateTensor(fbb, t.index, shape, scales, payload, gaps, values));
    }
    tensors = fbb.CreateVector(offsets);
  }
  const auto codec_table =
      r.has_codec ? wire::CreateCodec(fbb, static_cast<wire::DType>(r.dtype), r.block_size,
                                      r.byte_shuffle, r.topk, r.sparse)
                  : 0;
  const auto run_id = r.run_id ? fbb.CreateString(*r.run_id) : 0;
  const auto learner_id = r.learner_id ? fbb.CreateString(*r.learner_id) : 0;
  const auto region = r.region ? fbb.CreateString(*r.region) : 0;
  const auto root = wire::CreateDelta(fbb, r.schema_version, run_id, r.fingerprint, learner_id,
                                      region, r.fragment, r.seq, r.base_version, r.inner_steps,
                                      r.tokens, r.learner_step, r.train_loss, 0, codec_table,
                                      tensors);
  fbb.Finish(root, r.identifier);
  return {fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize()};
}

std::vector<uint8_t> build(const RawDelta& r) { return zstd_compress(build_flatbuffer(r), 1); }

// Independent checksum: one-shot XXH64 over all values laid end to end.
uint64_t reference_checksum(const std::vector<DenseTensor>& tensors) {
  std::vector<float> all;
  for (const auto& t : tensors) all.insert(all.end(), t.values.begin(), t.values.end());
  return XXH64(all.data(), all.size() * sizeof(float), 0);
}

void check_values(DType dtype, uint32_t block, const std::vector<float>& want,
                  const std::vector<float>& got) {
  REQUIRE(got.size() == want.size());
  for (size_t b = 0; b < want.size(); b += block) {
    const size_t end = std::min(want.size(), b + block);
    float absmax = 0;
    for (size_t i = b; i < end; ++i) absmax = std::max(absmax, std::fabs(want[i]));
    for (size_t i = b; i < end; ++i) {
      INFO("value " << i);
      switch (dtype) {
        case DType::F32: CHECK(got[i] == want[i]); break;
        case DType::BF16:
          CHECK(std::fabs(got[i] - want[i]) < std::ldexp(std::fabs(want[i]), -8));
          break;
        case DType::INT8: CHECK(std::fabs(got[i] - want[i]) <= absmax / 127); break;
        case DType::INT4: CHECK(std::fabs(got[i] - want[i]) <= absmax / 7); break;
      }
    }
  }
}

void check_header(const DeltaHeader& got, const DeltaHeader& want) {
  CHECK(got.run_id == want.run_id);
  CHECK(got.fingerprint == want.fingerprint);
  CHECK(got.learner_id == want.learner_id);
  CHECK(got.region == want.region);
  CHECK(got.fragment == want.fragment);
  CHECK(got.seq == want.seq);
  CHECK(got.base_version == want.base_version);
  CHECK(got.inner_steps == want.inner_steps);
  CHECK(got.tokens == want.tokens);
  CHECK(got.learner_step == want.learner_step);
  CHECK(got.train_loss == want.train_loss);
  CHECK(got.send_time_us == want.send_time_us);
}

// Built field by field: nested brace initializers of these aggregates trip GCC 12's
// -Wmaybe-uninitialized.
DeltaRef delta_ref(const std::string& topic, int32_t partition, int64_t offset,
                   const std::string& learner, uint64_t seq, uint64_t base, uint64_t staleness,
                   uint32_t steps, uint64_t tokens, double weight) {
  DeltaRef r;
  r.position.topic = topic;
  r.position.partition = partition;
  r.position.offset = offset;
  r.learner_id = learner;
  r.seq = seq;
  r.base_version = base;
  r.staleness = staleness;
  r.inner_steps = steps;
  r.tokens = tokens;
  r.weight = weight;
  return r;
}

DroppedDelta dropped_delta(DeltaRef ref, DropReason reason, const std::string& detail) {
  DroppedDelta d;
  d.delta = std::move(ref);
  d.reason = reason;
  d.detail = detail;
  return d;
}

}  // namespace

// ---- round trips ----------------------------------------------------------------------------

TEST_CASE("Delta round trip, every dtype, with and without byte shuffle", "[codec][messages]") {
  const auto dtype = GENERATE(DType::F32, DType::BF16, DType::INT8, DType::INT4);
  const bool shuffle = GENERATE(false, true);
  const uint32_t block = GENERATE(16u, 5u);
  INFO(dtype_name(dtype) << (shuffle ? " shuffled" : "") << " block " << block);
  const auto layout = make_layout();
  const auto tensors = dense_fragment(layout, 0, 11);
  const auto header = make_header(0);
  const auto bytes = encode(header, tensors, codec(dtype, shuffle, block));

  const Delta d = decode_delta(bytes, limits_for(layout));
  check_header(d.header, header);
  CHECK(d.dtype == dtype);
  CHECK(d.block_size == ((dtype == DType::INT8 || dtype == DType::INT4) ? block : 0));
  CHECK(d.byte_shuffle == shuffle);
  CHECK(d.wire_bytes == bytes.size());
  REQUIRE(d.tensors.size() == tensors.size());
  for (size_t k = 0; k < tensors.size(); ++k) {
    CHECK(d.tensors[k].index == k);
    CHECK(d.tensors[k].shape == layout.fragments[0][k].shape);
    check_values(dtype, block, tensors[k].values, d.tensors[k].values);
  }
  check_header(peek_delta_header(bytes, limits_for(layout)), header);
}

TEST_CASE("Delta of error-feedback tensors decodes to exactly what was quantized",
          "[codec][messages]") {
  const auto dtype = GENERATE(DType::INT8, DType::INT4, DType::BF16);
  const bool shuffle = GENERATE(false, true);
  const auto layout = make_layout();
  const auto tensors = dense_fragment(layout, 0, 12);
  std::vector<QuantizedTensor> quantized;
  for (const auto& t : tensors) {
    ErrorFeedback feedback(static_cast<int64_t>(t.values.size()));
    quantized.push_back(feedback.push(t.index, t.shape, t.values, dtype, 8));
  }
  const auto bytes =
      encode_delta(make_header(0), std::span<const QuantizedTensor>(quantized),
                   codec(dtype, shuffle, 8));
  const Delta d = decode_delta(bytes, limits_for(layout));
  for (size_t k = 0; k < quantized.size(); ++k) {
    std::vector<float> want(tensors[k].values.size());
    dequantize(quantized[k], want);
    CHECK(d.tensors[k].values == want);
  }
}

TEST_CASE("Delta of top-k tensors: declared, decoded as sent, and smaller on the wire", "[codec][messages][topk]") {
  const auto layout = make_layout();
  const auto tensors = dense_fragment(layout, 0, 13);
  std::vector<QuantizedTensor> dense, sparse;
  for (const auto& t : tensors) {
    ErrorFeedback a(static_cast<int64_t>(t.values.size())), b(static_cast<int64_t>(t.values.size()));
    dense.push_back(a.push(t.index, t.shape, t.values, DType::INT4, 8));
    sparse.push_back(b.push(t.index, t.shape, t.values, DType::INT4, 8, 1));
  }
  CodecOptions options = codec(DType::INT4, false, 8);
  const auto dense_bytes = encode_delta(make_header(0), std::span<const QuantizedTensor>(dense), options);
  options.topk = 1;
  const auto sparse_bytes = encode_delta(make_header(0), std::span<const QuantizedTensor>(sparse), options);
  const Delta d = decode_delta(sparse_bytes, limits_for(layout));
  CHECK(d.topk == 1);
  CHECK(decode_delta(dense_bytes, limits_for(layout)).topk == 0);
  for (size_t k = 0; k < sparse.size(); ++k) {
    std::vector<float> want(tensors[k].values.size());
    dequantize(sparse[k], want);
    CHECK(d.tensors[k].values == want);
  }
  CHECK(sparse_bytes.size() < dense_bytes.size());
  options.topk = 8;  // not below the block size
  CHECK_THROWS_AS(encode_delta(make_header(0), std::span<const QuantizedTensor>(sparse), options), InvalidInput);
}

TEST_CASE("a sparse delta and update decode to the bits of the dense ones", "[codec][messages][topk][sparse]") {
  const auto dtype = GENERATE(DType::INT4, DType::INT8);
  const uint32_t block = GENERATE(16u, 5u);
  INFO(dtype_name(dtype) << " block " << block);
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  const auto tensors = dense_fragment(layout, 0, 21);
  std::vector<QuantizedTensor> q;
  for (const auto& t : tensors) {
    ErrorFeedback feedback(static_cast<int64_t>(t.values.size()));
    q.push_back(feedback.push(t.index, t.shape, t.values, dtype, block, 2));
  }
  CodecOptions options = codec(dtype, false, block);
  options.zstd_level = 3;
  const auto dense_bytes = encode_delta(make_header(0), std::span<const QuantizedTensor>(q), options);
  options.topk = 2;
  const auto sparse_bytes = encode_delta(make_header(0), std::span<const QuantizedTensor>(q), options);
  const Delta dense = decode_delta(dense_bytes, limits), sparse = decode_both(sparse_bytes, limits);
  CHECK_FALSE(dense.sparse);
  CHECK(sparse.sparse);
  CHECK(sparse.topk == 2);
  REQUIRE(sparse.tensors.size() == dense.tensors.size());
  for (size_t k = 0; k < dense.tensors.size(); ++k) {
    REQUIRE(sparse.tensors[k].values.size() == dense.tensors[k].values.size());
    CHECK(std::memcmp(sparse.tensors[k].values.data(), dense.tensors[k].values.data(),
                      dense.tensors[k].values.size() * sizeof(float)) == 0);
  }
  const Delta as_sent = decode_delta(sparse_bytes, limits, DeltaValues::AsSent);
  REQUIRE(as_sent.quantized.size() == q.size());
  for (size_t k = 0; k < q.size(); ++k) {
    CHECK(as_sent.quantized[k].payload == q[k].payload);
    CHECK(as_sent.quantized[k].scales == q[k].scales);
  }
  // (Sizes: bench-codec. On tensors of a few hundred values the two extra vectors cost more than
  // the zeros they save.)

  // The merger's downlink: the same change as a sparse update.
  FragmentParams update{.run_id = "run-1", .fingerprint = layout.fingerprint, .fragment = 0, .version = 8,
                        .checksum = 77, .merger_instance = "m", .epoch = 1, .update = true, .base_version = 7};
  options.topk = 0;
  const auto dense_update = decode_fragment_params(encode_fragment_update(update, q, options), limits);
  options.topk = 2;
  const auto sparse_update = decode_fragment_params(encode_fragment_update(update, q, options), limits);
  REQUIRE(sparse_update.tensors.size() == dense_update.tensors.size());
  for (size_t k = 0; k < dense_update.tensors.size(); ++k)
    CHECK(std::memcmp(sparse_update.tensors[k].values.data(), dense_update.tensors[k].values.data(),
                      dense_update.tensors[k].values.size() * sizeof(float)) == 0);

  // Tensors that are not top-k tensors cannot be sent sparse.
  options.topk = 1;
  CHECK_THROWS_AS(encode_delta(make_header(0), std::span<const QuantizedTensor>(q), options), InvalidInput);
}

TEST_CASE("rejected: hostile sparse tensors", "[codec][reject][sparse]") {
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  // INT8, 4 values in blocks of 2, topk 1: 5 at position 1, -5 at position 3.
  RawDelta r;
  r.topk = 1;
  r.sparse = true;
  RawTensor& t = (*r.tensors)[0];
  t.payload.reset();
  t.gaps = std::vector<uint8_t>{1, 1};
  t.values = std::vector<uint8_t>{5, 0xFB};
  SECTION("accepted, values by hand") {
    const Delta d = decode_both(build(r), limits);
    CHECK(d.sparse);
    REQUIRE(d.tensors.size() == 1);
    CHECK(d.tensors[0].values == std::vector<float>{0.0f, 2.5f, 0.0f, -1.25f});
    const Delta q = decode_delta(build(r), limits, DeltaValues::AsSent);
    CHECK(q.quantized[0].payload == std::vector<uint8_t>{0, 5, 0, 0xFB});
    t.gaps = std::vector<uint8_t>{};
    t.values = std::vector<uint8_t>{};
    CHECK(decode_both(build(r), limits).tensors[0].values == std::vector<float>(4, 0.0f));
  }
  SECTION("a payload beside the sparse form") {
    t.payload = std::vector<uint8_t>{0, 5, 0, 0xFB};
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
    t.payload = std::vector<uint8_t>{};
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
  SECTION("gaps or values missing") {
    t.gaps.reset();
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
    t.gaps = std::vector<uint8_t>{1, 1};
    t.values.reset();
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
  SECTION("a position past the tensor") {
    t.gaps = std::vector<uint8_t>{1, 2};
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
    t.gaps = std::vector<uint8_t>(1 << 20, 255);  // a run that never ends
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
  SECTION("more than topk in a block") {
    t.gaps = std::vector<uint8_t>{0, 0};
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
  SECTION("sizes that do not agree") {
    t.values = std::vector<uint8_t>{5};
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
    t.values = std::vector<uint8_t>{5, 6, 7};
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
    t.gaps = std::vector<uint8_t>{1, 255};  // a run without its end
    t.values = std::vector<uint8_t>{5};
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
  SECTION("a value 0, or an INT4 padding nibble set") {
    t.values = std::vector<uint8_t>{5, 0};
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
    r.dtype = 3;  // INT4
    t.values = std::vector<uint8_t>{0xB5};
    CHECK(decode_both(build(r), limits).tensors[0].values == std::vector<float>{0.0f, 2.5f, 0.0f, -1.25f});
    t.gaps = std::vector<uint8_t>{1};
    t.values = std::vector<uint8_t>{0x15};
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
  SECTION("sparse without topk") {  // (topk with fp32 or bf16 is rejected as for dense tensors)
    r.topk = 0;
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
  SECTION("gaps and values beside a dense payload") {
    r.sparse = false;
    t.payload = std::vector<uint8_t>{0, 5, 0, 0xFB};
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
    t.gaps.reset();
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
    t.values.reset();
    CHECK(decode_both(build(r), limits).tensors[0].values == std::vector<float>{0.0f, 2.5f, 0.0f, -1.25f});
  }
}

TEST_CASE("DeltaValues::AsSent keeps int8 and int4 tensors as they travelled, fp32 and bf16 decoded",
          "[codec][messages]") {
  const auto dtype = GENERATE(DType::F32, DType::BF16, DType::INT8, DType::INT4);
  const bool shuffle = GENERATE(false, true);
  const uint32_t block = GENERATE(16u, 5u);
  INFO(dtype_name(dtype) << (shuffle ? " shuffled" : "") << " block " << block);
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  const auto header = make_header(0);
  const auto bytes = encode(header, dense_fragment(layout, 0, 13), codec(dtype, shuffle, block));
  const Delta dense = decode_delta(bytes, limits);
  Delta as_sent;
  decode_delta(bytes, limits, as_sent, DeltaValues::AsSent);
  check_header(as_sent.header, header);
  CHECK(as_sent.wire_bytes == bytes.size());
  const bool kept = dtype == DType::INT8 || dtype == DType::INT4;
  REQUIRE(as_sent.quantized.size() == (kept ? dense.tensors.size() : 0));
  REQUIRE(as_sent.tensors.size() == (kept ? 0 : dense.tensors.size()));
  for (size_t k = 0; k < dense.tensors.size(); ++k) {
    if (!kept) {
      CHECK(as_sent.tensors[k].values == dense.tensors[k].values);
      continue;
    }
    const QuantizedTensor& q = as_sent.quantized[k];
    CHECK(q.index == k);
    CHECK(q.shape == layout.fragments[0][k].shape);
    CHECK(q.dtype == dtype);
    CHECK(q.block_size == block);
    std::vector<float> values(dense.tensors[k].values.size());
    dequantize(q, values);
    CHECK(values == dense.tensors[k].values);  // the very values the fp32 decoding gives
  }
  // Decoding into the same Delta again, the other way, leaves no stale list behind.
  decode_delta(bytes, limits, as_sent);
  CHECK(as_sent.quantized.empty());
  CHECK(as_sent.tensors.size() == dense.tensors.size());
}

TEST_CASE("the encoder refuses tensors that do not match its codec", "[codec][messages]") {
  const auto layout = make_layout();
  const auto tensors = dense_fragment(layout, 1, 1);
  const auto q = quantize(0, {2, 2}, tensors[0].values, DType::INT8, 2);
  const std::vector<QuantizedTensor> one{q};
  const std::span<const QuantizedTensor> span(one);
  CHECK_THROWS_AS(encode_delta(make_header(1), span, codec(DType::INT4, false, 2)), InvalidInput);
  CHECK_THROWS_AS(encode_delta(make_header(1), span, codec(DType::INT8, false, 4)), InvalidInput);
  CHECK_THROWS_AS(encode(make_header(1), tensors, codec(DType::INT8, false, 0)), InvalidInput);
  CHECK_THROWS_AS(encode(make_header(1), tensors, codec(DType::INT8, false, (1u << 20) + 1)),
                  InvalidInput);
  auto bad_shape = tensors;
  bad_shape[0].shape = {3};
  CHECK_THROWS_AS(encode(make_header(1), bad_shape, codec(DType::F32)), InvalidInput);
}

TEST_CASE("decode_delta into a reused Delta", "[codec][messages]") {
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  Delta reused;
  for (uint64_t seed : {1, 2, 3}) {
    const auto tensors = dense_fragment(layout, 0, seed);
    auto header = make_header(0);
    header.seq = seed;
    decode_delta(encode(header, tensors, codec(DType::F32)), limits, reused);
    CHECK(reused.header.seq == seed);
    REQUIRE(reused.tensors.size() == 3);
    for (size_t k = 0; k < 3; ++k) CHECK(reused.tensors[k].values == tensors[k].values);
  }
}

TEST_CASE("checksum_fp32 is XXH64 over the values in order", "[codec][messages]") {
  const auto layout = make_layout();
  auto tensors = dense_fragment(layout, 0, 5);
  const uint64_t sum = checksum_fp32(tensors);
  CHECK(sum == reference_checksum(tensors));
  tensors[2].values.back() += 1.0f;
  CHECK(checksum_fp32(tensors) != sum);
  CHECK(checksum_fp32({}) == XXH64(nullptr, 0, 0));
}

TEST_CASE("FragmentParams round trip", "[codec][messages]") {
  const auto layout = make_layout();
  FragmentParams msg;
  msg.run_id = "run-1";
  msg.fingerprint = layout.fingerprint;
  msg.fragment = 0;
  msg.version = 41;
  msg.merger_instance = "merger-a";
  msg.epoch = 3;
  msg.tensors = dense_fragment(layout, 0, 21);
  const auto bytes = encode_fragment_params(msg, 3);
  const FragmentParams got = decode_fragment_params(bytes, limits_for(layout));
  CHECK(got.run_id == msg.run_id);
  CHECK(got.fingerprint == msg.fingerprint);
  CHECK(got.fragment == msg.fragment);
  CHECK(got.version == msg.version);
  CHECK(got.checksum == reference_checksum(msg.tensors));  // filled in by the encoder
  CHECK(got.merger_instance == msg.merger_instance);
  CHECK(got.epoch == msg.epoch);
  REQUIRE(got.tensors.size() == 3);
  for (size_t k = 0; k < 3; ++k) {
    CHECK(got.tensors[k].index == k);
    CHECK(got.tensors[k].shape == msg.tensors[k].shape);
    CHECK(got.tensors[k].values == msg.tensors[k].values);
  }
}

TEST_CASE("a FragmentParams update rebuilds the merger's version bit for bit", "[codec][messages]") {
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  FragmentParams held{.run_id = "run-1", .fingerprint = layout.fingerprint, .fragment = 0, .version = 41,
                      .merger_instance = "merger-a", .epoch = 3, .tensors = dense_fragment(layout, 0, 21)};
  held.checksum = checksum_fp32(held.tensors);
  const DType dtype = GENERATE(DType::INT8, DType::INT4, DType::BF16);
  const uint32_t block = dtype == DType::BF16 ? 0 : 16;
  // The merger's side: a change, quantized; the new version is held + dequantized change.
  const auto step = dense_fragment(layout, 0, 22);
  std::vector<QuantizedTensor> change;
  FragmentParams next = held;
  next.version = 42;
  for (size_t t = 0; t < step.size(); ++t) {
    std::vector<float> scaled = step[t].values;
    for (float& v : scaled) v *= 1e-3f;
    change.push_back(quantize(static_cast<uint32_t>(t), step[t].shape, scaled, dtype, block));
    std::vector<float> sent(scaled.size());
    dequantize(change.back(), sent);
    apply_update(held.tensors[t].values, sent, next.tensors[t].values);
  }
  next.checksum = checksum_fp32(next.tensors);
  FragmentParams header = next;
  header.update = true;
  header.base_version = 41;
  const auto bytes = encode_fragment_update(header, change, {.dtype = dtype, .block_size = block});
  const FragmentParams got = decode_fragment_params(bytes, limits);
  CHECK(got.update);
  CHECK(got.base_version == 41);
  CHECK(got.version == 42);
  CHECK(got.wire_bytes == bytes.size());
  const FragmentParams rebuilt = apply_fragment_update(held, got);
  CHECK_FALSE(rebuilt.update);
  CHECK(rebuilt.version == 42);
  CHECK(rebuilt.checksum == next.checksum);
  CHECK(checksum_fp32(rebuilt.tensors) == next.checksum);
  for (size_t t = 0; t < next.tensors.size(); ++t) CHECK(rebuilt.tensors[t].values == next.tensors[t].values);
  // Smaller than the snapshot of the same version.
  CHECK(bytes.size() < encode_fragment_params(next).size());
  // Applied to the update itself: the new version is written over its values, no third copy.
  FragmentParams moved = got;
  const float* storage = moved.tensors[0].values.data();
  const FragmentParams in_place = apply_fragment_update(held, std::move(moved));
  CHECK(in_place.tensors[0].values.data() == storage);
  CHECK_FALSE(in_place.update);
  CHECK(in_place.base_version == 0);
  for (size_t t = 0; t < next.tensors.size(); ++t) CHECK(in_place.tensors[t].values == next.tensors[t].values);

  SECTION("not on the version it was made for") {
    FragmentParams other = held;
    other.version = 40;
    CHECK_THROWS_AS(apply_fragment_update(other, got), InvalidInput);
    CHECK_THROWS_AS(apply_fragment_update(got, got), InvalidInput);  // an update is not a base
  }
  SECTION("a base that differs from the merger's fails the checksum") {
    FragmentParams other = held;
    other.tensors[1].values[0] += 1.0f;
    CHECK_REJECTS(apply_fragment_update(other, got), CorruptFrame);
  }
  SECTION("a declared checksum that the result does not have") {
    header.checksum ^= 1;
    const auto tampered = decode_fragment_params(encode_fragment_update(header, change, {.dtype = dtype, .block_size = block}), limits);
    CHECK_REJECTS(apply_fragment_update(held, tampered), CorruptFrame);
  }
}

TEST_CASE("FragmentState round trip", "[codec][messages]") {
  const auto layout = make_layout();
  FragmentState msg;
  msg.run_id = "run-1";
  msg.fingerprint = layout.fingerprint;
  msg.layout = carried(layout);
  msg.fragment = 1;
  msg.version = 9;
  msg.params = dense_fragment(layout, 1, 31);
  msg.momentum = dense_fragment(layout, 1, 32);
  msg.consumed = {{"diloco.run-1.deltas.eu", 0, 120}, {"diloco.run-1.deltas.us", 3, 77}};
  msg.accounted = {{"learner-a", 12}, {"learner-b", 1796000000000}};
  const bool with_last_merge = GENERATE(false, true);
  if (with_last_merge) msg.last_merge = LogPosition{"diloco.run-1.merges", 0, 8};
  const FragmentState got =
      decode_fragment_state(encode_fragment_state(msg), limits_for(layout));
  CHECK(got.run_id == msg.run_id);
  CHECK(got.fingerprint == msg.fingerprint);
  CHECK(got.fragment == 1);
  CHECK(got.version == 9);
  CHECK(got.checksum == reference_checksum(msg.params));
  REQUIRE(got.params.size() == 1);
  CHECK(got.params[0].values == msg.params[0].values);
  CHECK(got.params[0].shape == msg.params[0].shape);
  REQUIRE(got.momentum.size() == 1);
  CHECK(got.momentum[0].values == msg.momentum[0].values);
  CHECK(got.consumed == msg.consumed);
  CHECK(got.accounted == msg.accounted);
  CHECK(got.last_merge == msg.last_merge);

  CHECK(got.outer_state.empty());  // Nesterov and Sgd keep none
  CHECK_FALSE(got.optimizer.has_value());  // none named, as in older checkpoints
  CHECK(got.optimizer_since == 0);

  SECTION("with the optimizer that stepped it") {
    msg.optimizer = OuterOptimizerKind::Cgad;
    msg.optimizer_since = 7;
    const auto named = decode_fragment_state(encode_fragment_state(msg), limits_for(layout));
    CHECK(named.optimizer == OuterOptimizerKind::Cgad);
    CHECK(named.optimizer_since == 7);
    msg.optimizer_since = 10;  // above version 9
    CHECK_THROWS_AS(decode_fragment_state(encode_fragment_state(msg), limits_for(layout)), Rejection);
    msg.optimizer_since = 0;
    msg.optimizer = static_cast<OuterOptimizerKind>(9);
    CHECK_THROWS_AS(decode_fragment_state(encode_fragment_state(msg), limits_for(layout)), Rejection);
  }

  SECTION("without momentum") {
    msg.momentum.clear();
    const auto no_momentum = decode_fragment_state(encode_fragment_state(msg), limits_for(layout));
    CHECK(no_momentum.momentum.empty());
    CHECK(no_momentum.params[0].values == msg.params[0].values);
  }

  CHECK(got.downlink_residual.empty());  // an fp32 downlink keeps none

  SECTION("with a downlink residual") {
    msg.downlink_residual = dense_fragment(layout, 1, 34);
    const auto with_residual = decode_fragment_state(encode_fragment_state(msg), limits_for(layout));
    REQUIRE(with_residual.downlink_residual.size() == 1);
    CHECK(with_residual.downlink_residual[0].values == msg.downlink_residual[0].values);
  }

  SECTION("with an outer_state") {
    msg.outer_state = dense_fragment(layout, 1, 33);
    const auto with_state = decode_fragment_state(encode_fragment_state(msg), limits_for(layout));
    REQUIRE(with_state.outer_state.size() == 1);
    CHECK(with_state.outer_state[0].values == msg.outer_state[0].values);
    CHECK(with_state.outer_state[0].shape == msg.outer_state[0].shape);
    CHECK(with_state.momentum[0].values == msg.momentum[0].values);
  }

  SECTION("the parameters only, as a learner joining the run reads it") {
    msg.outer_state = dense_fragment(layout, 1, 33);
    msg.downlink_residual = dense_fragment(layout, 1, 34);
    msg.recent = {{"diloco.run-1.deltas.eu", 0, 121}};
    msg.merged_bases = {{"learner-a", 8}};
    msg.optimizer = OuterOptimizerKind::Nesterov;
    msg.optimizer_since = 2;
    const auto bytes = encode_fragment_state(msg);
    const auto whole = decode_fragment_state(bytes, limits_for(layout));
    const auto params = decode_fragment_state(bytes, limits_for(layout), StateParts::ParamsOnly);
    REQUIRE(whole.momentum.size() == 1);  // what the other decode leaves out is there
    REQUIRE(whole.outer_state.size() == 1);
    REQUIRE(whole.downlink_residual.size() == 1);
    CHECK(params.momentum.empty());
    CHECK(params.outer_state.empty());
    CHECK(params.downlink_residual.empty());
    REQUIRE(params.params.size() == 1);
    CHECK(params.params[0].values == msg.params[0].values);
    CHECK(params.params[0].shape == msg.params[0].shape);
    CHECK(params.checksum == reference_checksum(msg.params));
    CHECK(params.version == 9);
    CHECK(params.consumed == msg.consumed);
    CHECK(params.accounted == msg.accounted);
    CHECK(params.merged_bases == msg.merged_bases);
    CHECK(params.recent == msg.recent);
    CHECK(params.last_merge == msg.last_merge);
    CHECK(params.optimizer == OuterOptimizerKind::Nesterov);
    CHECK(params.optimizer_since == 2);
    // The parameters' checksum is still checked.
    msg.checksum = reference_checksum(msg.params) ^ 1;
    CHECK_THROWS_AS(decode_fragment_state(encode_fragment_state(msg), limits_for(layout), StateParts::ParamsOnly),
                    Rejection);
  }
}

namespace {
void check_same_hyper(const OuterHyper& got, const OuterHyper& want) {
  CHECK(got.lr == want.lr);
  CHECK(got.momentum == want.momentum);
  CHECK(got.staleness_alpha == want.staleness_alpha);
  CHECK(got.max_staleness == want.max_staleness);
  CHECK(got.quorum == want.quorum);
  CHECK(got.dn_period == want.dn_period);
  CHECK(got.dn_activation == want.dn_activation);
  CHECK(got.cgad_decay == want.cgad_decay);
  CHECK(got.cgad_cutoff == want.cgad_cutoff);
  CHECK(got.adam_beta2 == want.adam_beta2);
  CHECK(got.adam_epsilon == want.adam_epsilon);
}

// A record of fragment 1 of run-1 making `version`.
MergeRecord merge_record_of(const FragmentLayout& layout, uint64_t version) {
  MergeRecord msg;
  msg.run_id = "run-1";
  msg.fingerprint = layout.fingerprint;
  msg.fragment = 1;
  msg.version = version;
  msg.prev_version = version - 1;
  return msg;
}
}  // namespace

TEST_CASE("MergeRecord round trip", "[codec][messages]") {
  const auto layout = make_layout();
  MergeRecord msg = merge_record_of(layout, 10);
  msg.inputs = {delta_ref("deltas.eu", 2, 100, "learner-1", 4, 8, 1, 50, 409600, 0.75),
                delta_ref("deltas.us", 0, 7, "learner-2", 9, 9, 0, 40, 327680, 0.25)};
  msg.dropped = {
      dropped_delta(delta_ref("deltas.eu", 1, 55, "learner-3", 2, 3, 6, 50, 409600, 0.0),
                    DropReason::TooStale, "staleness 6 > 4"),
      dropped_delta(delta_ref("deltas.us", 1, 9, "learner-4", 1, 9, 0, 50, 409600, 0.0),
                    DropReason::Invalid, "non_finite: NaN")};
  msg.rule = MergeRule::WeightedAverage;
  msg.optimizer = OuterOptimizerKind::Sgd;
  msg.hyper = {0.5f, 0.8f, 0.25f, 4, 2};
  msg.checksum = 0xABCDEF;
  msg.merger_instance = "merger-b";
  msg.epoch = 5;
  msg.merge_time_us = 123456789;
  msg.share = 0.25f;
  const MergeRecord got = decode_merge_record(encode_merge_record(msg), limits_for(layout));
  CHECK(got.share == 0.25f);
  CHECK(got.run_id == msg.run_id);
  CHECK(got.fingerprint == msg.fingerprint);
  CHECK(got.fragment == msg.fragment);
  CHECK(got.version == msg.version);
  CHECK(got.prev_version == msg.prev_version);
  REQUIRE(got.inputs.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    const auto& a = got.inputs[i];
    const auto& b = msg.inputs[i];
    CHECK(a.position == b.position);
    CHECK(a.learner_id == b.learner_id);
    CHECK(a.seq == b.seq);
    CHECK(a.base_version == b.base_version);
    CHECK(a.staleness == b.staleness);
    CHECK(a.inner_steps == b.inner_steps);
    CHECK(a.tokens == b.tokens);
    CHECK(a.weight == b.weight);
  }
  REQUIRE(got.dropped.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    CHECK(got.dropped[i].delta.position == msg.dropped[i].delta.position);
    CHECK(got.dropped[i].delta.learner_id == msg.dropped[i].delta.learner_id);
    CHECK(got.dropped[i].delta.staleness == msg.dropped[i].delta.staleness);
    CHECK(got.dropped[i].reason == msg.dropped[i].reason);
    CHECK(got.dropped[i].detail == msg.dropped[i].detail);
  }
  CHECK(got.rule == msg.rule);
  CHECK(got.optimizer == msg.optimizer);
  // The fields newer than the first records hold their defaults here, which FlatBuffers does not
  // write: they decode from the schema's defaults, as an older record's do, and must match.
  check_same_hyper(got.hyper, msg.hyper);
  CHECK(got.staleness_scale == 1.0f);
  CHECK(got.checksum == msg.checksum);
  CHECK(got.merger_instance == msg.merger_instance);
  CHECK(got.epoch == msg.epoch);
  CHECK(got.merge_time_us == msg.merge_time_us);
  CHECK(std::string(drop_reason_name(DropReason::TooStale)) == "too_stale");
}

TEST_CASE("MergeRecord round trip of the outer optimizers' settings and the staleness scale", "[codec][messages]") {
  const auto layout = make_layout();
  MergeRecord msg = merge_record_of(layout, 4);
  msg.inputs = {delta_ref("deltas.eu", 2, 100, "learner-1", 4, 1, 2, 50, 409600, 0.75)};
  msg.merger_instance = "merger-a";
  msg.hyper = {.lr = 0.3f, .momentum = 0.5f, .staleness_alpha = 0.5f, .max_staleness = 8, .quorum = 1,
               .dn_period = 32, .dn_activation = 0.125f, .cgad_decay = 0.25f, .cgad_cutoff = 7,
               .adam_beta2 = 0.95f, .adam_epsilon = 1e-6f};
  msg.share = 0.25f;
  msg.staleness_scale = 0.5f;
  for (auto kind : {OuterOptimizerKind::DelayedNesterov, OuterOptimizerKind::Cgad}) {
    msg.optimizer = kind;
    const MergeRecord got = decode_merge_record(encode_merge_record(msg), limits_for(layout));
    CHECK(got.optimizer == kind);
    CHECK(got.share == 0.25f);
    CHECK(got.staleness_scale == 0.5f);
    check_same_hyper(got.hyper, msg.hyper);
    CHECK(got.downlink == DownlinkCodec{});  // fp32, the default
  }
  for (const DownlinkCodec downlink : {DownlinkCodec{DType::INT4, 64}, DownlinkCodec{DType::INT8, 128},
                                       DownlinkCodec{DType::BF16, 0}, DownlinkCodec{DType::INT4, 4096, 64}}) {
    msg.downlink = downlink;
    CHECK(decode_merge_record(encode_merge_record(msg), limits_for(layout)).downlink == downlink);
  }
  for (float bad : {0.0f, 1.5f, std::numeric_limits<float>::quiet_NaN()}) {
    msg.staleness_scale = bad;
    CHECK_THROWS_AS(decode_merge_record(encode_merge_record(msg), limits_for(layout)), Rejection);
  }
}

TEST_CASE("MergeRecord round trip of norm_block, and records with a norm_block that no merge makes are rejected",
          "[codec][messages]") {
  const auto layout = make_layout();
  MergeRecord msg = merge_record_of(layout, 4);
  msg.inputs = {delta_ref("deltas.eu", 2, 100, "learner-1", 4, 1, 2, 50, 409600, 0.75)};
  msg.merger_instance = "merger-a";
  CHECK(decode_merge_record(encode_merge_record(msg), limits_for(layout)).norm_block == 0);  // as older records
  for (uint32_t ok : {kMinNormBlock, 1u << 16, kMaxNormBlock}) {
    msg.norm_block = ok;
    CHECK(decode_merge_record(encode_merge_record(msg), limits_for(layout)).norm_block == ok);
  }
  // A hostile block of 1 would make a reader sum a billion partial norms; others are not powers of two.
  for (uint32_t bad : {1u, kMinNormBlock / 2, (1u << 16) + 1, kMaxNormBlock * 2, 0xFFFFFFFFu}) {
    INFO("norm_block " << bad);
    msg.norm_block = bad;
    CHECK_THROWS_AS(decode_merge_record(encode_merge_record(msg), limits_for(layout)), Rejection);
  }
}

TEST_CASE("Member round trip", "[codec][messages]") {
  Member msg;
  msg.run_id = "run-1";
  msg.instance_id = "learner-3";
  msg.role = Role::Evaluator;
  msg.region = "ap";
  msg.endpoint = "tcp://10.0.0.3:5555";
  msg.epoch = 2;
  msg.owned_fragments = {0, 3};
  msg.fragment_versions = {17, 4};
  msg.time_us = -5;
  msg.step = 1234;
  msg.step_time_s = 0.125f;
  msg.tokens_per_s = 65536.5f;
  msg.loss = 3.5f;
  msg.tokens = 1ull << 40;
  msg.bytes_sent = 99;
  msg.bytes_received = 1ull << 35;
  const auto layout = make_layout();
  const Member got = decode_member(encode_member(msg), limits_for(layout));
  CHECK(got.run_id == msg.run_id);
  CHECK(got.instance_id == msg.instance_id);
  CHECK(got.role == msg.role);
  CHECK(got.region == msg.region);
  CHECK(got.endpoint == msg.endpoint);
  CHECK(got.epoch == msg.epoch);
  CHECK(got.owned_fragments == msg.owned_fragments);
  CHECK(got.fragment_versions == msg.fragment_versions);
  CHECK(got.time_us == msg.time_us);
  CHECK(got.step == msg.step);
  CHECK(got.step_time_s == msg.step_time_s);
  CHECK(got.tokens_per_s == msg.tokens_per_s);
  CHECK(got.loss == msg.loss);
  CHECK(got.tokens == msg.tokens);
  CHECK(got.bytes_sent == msg.bytes_sent);
  CHECK(got.bytes_received == msg.bytes_received);
  CHECK(got.fragment_checksums.empty());  // none given
  CHECK(std::string(role_name(Role::Evaluator)) == "evaluator");

  msg.fragment_checksums = {7, 1ull << 63};
  CHECK(decode_member(encode_member(msg), limits_for(layout)).fragment_checksums == msg.fragment_checksums);
  msg.fragment_checksums = {7};  // not one per owned fragment
  CHECK_REJECTS(decode_member(encode_member(msg), limits_for(layout)), BadFlatbuffer);
  msg.fragment_checksums.clear();

  CHECK(got.announce_interval_s == 0);  // none given
  msg.announce_interval_s = 2.5f;
  CHECK(decode_member(encode_member(msg), limits_for(layout)).announce_interval_s == 2.5f);
  msg.announce_interval_s = -1;
  CHECK_REJECTS(decode_member(encode_member(msg), limits_for(layout)), BadFlatbuffer);
  msg.announce_interval_s = std::numeric_limits<float>::quiet_NaN();
  CHECK_REJECTS(decode_member(encode_member(msg), limits_for(layout)), BadFlatbuffer);
}

TEST_CASE("Member round trip of the incarnation and the leaving flag", "[codec][messages]") {
  const auto layout = make_layout();
  Member msg{.run_id = "run-1", .instance_id = "learner-3", .role = Role::Learner, .region = "eu", .step = 40};
  // Older binaries send neither: incarnation 0, not leaving.
  const Member plain = decode_member(encode_member(msg), limits_for(layout));
  CHECK(plain.incarnation == 0);
  CHECK_FALSE(plain.leaving);
  msg.incarnation = 0x8000'0000'0000'0001ull;
  msg.leaving = true;
  const Member got = decode_member(encode_member(msg), limits_for(layout));
  CHECK(got.incarnation == 0x8000'0000'0000'0001ull);
  CHECK(got.leaving);
  CHECK(got.step == 40);
}

TEST_CASE("Member round trip of a learner's batch and context", "[codec][messages]") {
  const auto layout = make_layout();
  Member msg{.run_id = "run-1", .instance_id = "learner-3", .role = Role::Learner, .region = "eu", .step = 40};
  // Older binaries declare neither.
  const Member plain = decode_member(encode_member(msg), limits_for(layout));
  CHECK(plain.batch == 0);
  CHECK(plain.context == 0);
  msg.batch = 64;
  msg.context = 4096;
  const Member got = decode_member(encode_member(msg), limits_for(layout));
  CHECK(got.batch == 64);
  CHECK(got.context == 4096);
}

TEST_CASE("MergeRecord round trip of a genesis record; one that is not version 0 from one proposal is rejected",
          "[codec][messages]") {
  const auto layout = make_layout();
  MergeRecord msg = merge_record_of(layout, 0);
  msg.prev_version = 0;
  msg.genesis = true;
  msg.inputs = {delta_ref("diloco.run-1.genesis", 1, 5, "learner-a", 1700000000000, 0, 0, 0, 0, 0.0)};
  const MergeRecord got = decode_merge_record(encode_merge_record(msg), limits_for(layout));
  CHECK(got.genesis);
  CHECK(got.version == 0);
  REQUIRE(got.inputs.size() == 1);
  CHECK(got.inputs[0].position == LogPosition{"diloco.run-1.genesis", 1, 5});
  CHECK(got.inputs[0].learner_id == "learner-a");
  CHECK_FALSE(decode_merge_record(encode_merge_record(merge_record_of(layout, 3)), limits_for(layout)).genesis);

  SECTION("another version") {
    msg.version = 1;
    CHECK_REJECTS(decode_merge_record(encode_merge_record(msg), limits_for(layout)), BadCounter);
  }
  SECTION("two inputs") {
    msg.inputs.push_back(msg.inputs[0]);
    msg.inputs[1].position.offset = 6;
    CHECK_REJECTS(decode_merge_record(encode_merge_record(msg), limits_for(layout)), BadCounter);
  }
  SECTION("no input") {
    msg.inputs.clear();
    CHECK_REJECTS(decode_merge_record(encode_merge_record(msg), limits_for(layout)), BadCounter);
  }
}

TEST_CASE("Rejected round trip keeps at most 256 bytes of payload", "[codec][messages]") {
  RejectedInput msg;
  msg.run_id = "run-1";
  msg.source = {"diloco.run-1.deltas.eu", 4, 1000};
  msg.reason = "wrong_fingerprint";
  msg.detail = "fingerprint 0x1, expected 0x2";
  msg.rejected_by = "merger-a";
  msg.time_us = 42;
  msg.payload_size = 1000;
  msg.payload_head.resize(1000);
  for (size_t i = 0; i < msg.payload_head.size(); ++i)
    msg.payload_head[i] = static_cast<uint8_t>(i);
  const auto layout = make_layout();
  const RejectedInput got = decode_rejected(encode_rejected(msg), limits_for(layout));
  CHECK(got.run_id == msg.run_id);
  CHECK(got.source == msg.source);
  CHECK(got.reason == msg.reason);
  CHECK(got.detail == msg.detail);
  CHECK(got.rejected_by == msg.rejected_by);
  CHECK(got.time_us == msg.time_us);
  CHECK(got.payload_size == msg.payload_size);
  CHECK(got.payload_head ==
        std::vector<uint8_t>(msg.payload_head.begin(), msg.payload_head.begin() + 256));
  CHECK(got.sender.empty());
  msg.sender = "learner-7";
  CHECK(decode_rejected(encode_rejected(msg), limits_for(layout)).sender == "learner-7");
}

TEST_CASE("every reject reason has a distinct snake_case name", "[codec][messages]") {
  std::set<std::string> names;
  for (int r = 0; r <= static_cast<int>(RejectReason::MissingField); ++r) {
    const std::string n = reject_reason_name(static_cast<RejectReason>(r));
    CHECK(n.find_first_not_of("abcdefghijklmnopqrstuvwxyz_") == std::string::npos);
    names.insert(n);
  }
  CHECK(names.size() == static_cast<size_t>(RejectReason::MissingField) + 1);
  CHECK(name(RejectReason::WrongFingerprint) == "wrong_fingerprint");
}

// ---- rejections -----------------------------------------------------------------------------

TEST_CASE("the hand-built Delta is valid to begin with", "[codec][reject]") {
  const auto layout = make_layout();
  const Delta d = decode_delta(build(RawDelta{}), limits_for(layout));
  REQUIRE(d.tensors.size() == 1);
  // INT8 block 2: (1, 2) * 0.5 and (-1, -128) * 0.25 (the decoder accepts the full byte range)
  CHECK(d.tensors[0].values == std::vector<float>{0.5f, 1.0f, -0.25f, -32.0f});
}

TEST_CASE("rejected: framing", "[codec][reject]") {
  const auto layout = make_layout();
  auto limits = limits_for(layout);
  const auto bytes = encode(make_header(0), dense_fragment(layout, 0, 1), codec(DType::INT4));

  SECTION("too large") {
    limits.max_message_bytes = bytes.size() - 1;
    CHECK_REJECTS(decode_delta(bytes, limits), TooLarge);
    CHECK_REJECTS(peek_delta_header(bytes, limits), TooLarge);
  }
  SECTION("not zstd") {
    CHECK_REJECTS(decode_delta(build_flatbuffer(RawDelta{}), limits), NotZstd);
  }
  SECTION("truncated, at every length") {
    CHECK_REJECTS(decode_delta(std::span(bytes.data(), 3), limits), NotZstd);
    CHECK_REJECTS(decode_delta(std::span(bytes.data(), bytes.size() - 1), limits), CorruptFrame);
    CHECK_REJECTS(decode_delta(std::span(bytes.data(), bytes.size() / 2), limits), CorruptFrame);
    for (size_t n = 0; n < bytes.size(); ++n) {
      INFO("first " << n << " bytes");
      CHECK(rejection([&] { decode_delta(std::span(bytes.data(), n), limits); }) != "accepted");
    }
  }
  SECTION("decompressed size above the limit") {
    limits.max_decompressed_bytes = 100;
    CHECK_REJECTS(decode_delta(bytes, limits), DecompressedTooLarge);
  }
  SECTION("a frame declaring 4 GiB") {
    const std::vector<uint8_t> bomb = {0x28, 0xB5, 0x2F, 0xFD, 0xE0, 0x00, 0x00,
                                       0x00, 0x00, 0x01, 0x00, 0x00, 0x00};
    CHECK_REJECTS(decode_delta(bomb, limits), DecompressedTooLarge);
  }
  SECTION("a frame without content size") {
    const auto fb = build_flatbuffer(RawDelta{});
    std::vector<uint8_t> out(ZSTD_compressBound(fb.size()) + 64);
    ZSTD_CCtx* cctx = ZSTD_createCCtx();
    ZSTD_outBuffer ob{out.data(), out.size(), 0};
    ZSTD_inBuffer ib{fb.data(), fb.size(), 0};
    ZSTD_compressStream2(cctx, &ob, &ib, ZSTD_e_continue);
    ZSTD_inBuffer rest{nullptr, 0, 0};
    REQUIRE(ZSTD_compressStream2(cctx, &ob, &rest, ZSTD_e_end) == 0);
    ZSTD_freeCCtx(cctx);
    out.resize(ob.pos);
    CHECK_REJECTS(decode_delta(out, limits), SizeUnknown);
  }
  SECTION("zstd around garbage") {
    std::vector<uint8_t> garbage(500);
    std::mt19937 rng(1);
    for (auto& b : garbage) b = static_cast<uint8_t>(rng());
    CHECK_REJECTS(decode_delta(zstd_compress(garbage, 1), limits), BadFlatbuffer);
    CHECK_REJECTS(decode_delta(zstd_compress({}, 1), limits), BadFlatbuffer);
  }
  SECTION("wrong file identifier") {
    RawDelta r;
    r.identifier = "DPRM";
    CHECK_REJECTS(decode_both(build(r), limits), BadFlatbuffer);
    r.identifier = nullptr;
    CHECK_REJECTS(decode_both(build(r), limits), BadFlatbuffer);
    FragmentParams params;
    params.run_id = "run-1";
    params.fingerprint = layout.fingerprint;
    params.merger_instance = "m";
    params.tensors = dense_fragment(layout, 1, 1);
    CHECK_REJECTS(decode_delta(encode_fragment_params(params), limits), BadFlatbuffer);
    CHECK_REJECTS(decode_fragment_params(bytes, limits), BadFlatbuffer);
    CHECK_REJECTS(decode_member(bytes, limits), BadFlatbuffer);
    CHECK_REJECTS(decode_merge_record(bytes, limits), BadFlatbuffer);
    CHECK_REJECTS(decode_rejected(bytes, limits), BadFlatbuffer);
    CHECK_REJECTS(decode_fragment_state(bytes, limits), BadFlatbuffer);
  }
}

// zstd's entropy-coded blocks have a few redundant bits (table headers, the frame descriptor's
// unused bit): flipping one yields the very same decompressed bytes, hence the same message. A
// flip that changes the content is caught by the frame's content checksum or by the checks that
// follow. So: every flip is rejected, or decodes to exactly the original delta; never a crash
// and never a different delta.
TEST_CASE("rejected: every flipped bit, never a crash, never a different delta",
          "[codec][reject]") {
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  const auto dtype = GENERATE(DType::INT4, DType::F32);
  const auto header = make_header(1);
  const auto tensors = dense_fragment(layout, 1, 77);
  const auto bytes = encode(header, tensors, codec(dtype, true, 2));
  const Delta original = decode_delta(bytes, limits);
  size_t accepted = 0, total = 0;
  for (size_t byte = 0; byte < bytes.size(); ++byte)
    for (int bit = 0; bit < 8; ++bit) {
      auto flipped = bytes;
      flipped[byte] ^= static_cast<uint8_t>(1u << bit);
      INFO("byte " << byte << " of " << bytes.size() << ", bit " << bit);
      Delta got;
      const std::string outcome = rejection([&] { got = decode_both(flipped, limits); });
      ++total;
      if (outcome != "accepted") continue;
      ++accepted;
      check_header(got.header, original.header);
      REQUIRE(got.tensors.size() == 1);
      CHECK(got.tensors[0].values == original.tensors[0].values);
    }
  INFO(accepted << " of " << total << " flips decoded to the original delta");
  CHECK(accepted * 20 < total);
}

// A hostile sender controls the FlatBuffer itself, inside a perfectly valid zstd frame. Every
// bit flip and every byte forced to 0x00 or 0xFF must end in a clean decode or a Rejection:
// no crash, no other exception (run under ASan/UBSan to make "no crash" mean something).
TEST_CASE("hostile FlatBuffers inside valid frames never crash", "[codec][reject]") {
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  auto mutate_all = [&](const std::vector<uint8_t>& frame,
                        const std::function<void(std::span<const uint8_t>)>& decode) {
    const auto plain = zstd_decompress_bounded(frame, 1 << 20);
    std::vector<std::vector<uint8_t>> variants;
    for (size_t byte = 0; byte < plain.size(); ++byte) {
      for (int bit = 0; bit < 8; ++bit) {
        variants.push_back(plain);
        variants.back()[byte] ^= static_cast<uint8_t>(1u << bit);
      }
      for (uint8_t forced : {uint8_t{0x00}, uint8_t{0xFF}}) {
        variants.push_back(plain);
        variants.back()[byte] = forced;
      }
    }
    for (size_t i = 0; i < variants.size(); ++i) {
      INFO("variant " << i);
      const auto bytes = zstd_compress(variants[i], 1);
      CHECK_NOTHROW(rejection([&] { decode(bytes); }));
    }
  };

  SECTION("Delta") {
    const auto bytes =
        encode(make_header(1), dense_fragment(layout, 1, 5), codec(DType::INT4, true, 2));
    mutate_all(bytes, [&](std::span<const uint8_t> b) { decode_delta(b, limits); });
    mutate_all(bytes, [&](std::span<const uint8_t> b) { peek_delta_header(b, limits); });
  }
  SECTION("FragmentParams and FragmentState") {
    FragmentParams params;
    params.run_id = "run-1";
    params.fingerprint = layout.fingerprint;
    params.fragment = 1;
    params.merger_instance = "m";
    params.tensors = dense_fragment(layout, 1, 6);
    mutate_all(encode_fragment_params(params),
               [&](std::span<const uint8_t> b) { decode_fragment_params(b, limits); });
    FragmentState state;
    state.run_id = "run-1";
    state.fingerprint = layout.fingerprint;
    state.layout = carried(layout);
    state.fragment = 1;
    state.params = params.tensors;
    state.momentum = params.tensors;
    state.consumed = {{"t", 1, 2}};
    state.last_merge = LogPosition{"m", 0, 3};
    mutate_all(encode_fragment_state(state),
               [&](std::span<const uint8_t> b) { decode_fragment_state(b, limits); });
  }
  SECTION("MergeRecord, Member, Rejected") {
    MergeRecord record;
    record.run_id = "run-1";
    record.fingerprint = layout.fingerprint;
    record.inputs = {delta_ref("d", 0, 1, "l", 1, 0, 0, 1, 1, 1.0)};
    record.dropped = {dropped_delta(delta_ref("d", 0, 2, "k", 1, 0, 9, 1, 1, 0.0),
                                    DropReason::TooStale, "old")};
    mutate_all(encode_merge_record(record),
               [&](std::span<const uint8_t> b) { decode_merge_record(b, limits); });
    Member member;
    member.run_id = "run-1";
    member.instance_id = "i";
    member.owned_fragments = {1};
    member.fragment_versions = {2};
    mutate_all(encode_member(member),
               [&](std::span<const uint8_t> b) { decode_member(b, limits); });
    RejectedInput rejected;
    rejected.run_id = "run-1";
    rejected.payload_head = {1, 2, 3};
    mutate_all(encode_rejected(rejected),
               [&](std::span<const uint8_t> b) { decode_rejected(b, limits); });
  }
}

TEST_CASE("rejected: schema version, run id, fingerprint, fragment", "[codec][reject]") {
  const auto layout = make_layout();
  auto limits = limits_for(layout);
  RawDelta r;
  SECTION("unknown schema version") {
    r.schema_version = kSchemaVersion + 1;
    CHECK_REJECTS(decode_both(build(r), limits), UnknownSchemaVersion);
    r.schema_version = 0;
    CHECK_REJECTS(decode_both(build(r), limits), UnknownSchemaVersion);
  }
  SECTION("wrong run id") {
    limits.run_id = "run-2";
    CHECK_REJECTS(decode_both(build(r), limits), WrongRunId);
    CHECK_REJECTS(peek_delta_header(build(r), limits), WrongRunId);
  }
  SECTION("missing run id") {
    r.run_id.reset();
    CHECK_REJECTS(decode_both(build(r), limits), MissingField);
  }
  SECTION("wrong fingerprint") {
    r.fingerprint ^= 1;
    CHECK_REJECTS(decode_both(build(r), limits), WrongFingerprint);
    CHECK_REJECTS(peek_delta_header(build(r), limits), WrongFingerprint);
  }
  SECTION("fragment out of range") {
    r.fragment = 2;
    CHECK_REJECTS(decode_both(build(r), limits), FragmentOutOfRange);
    CHECK_REJECTS(peek_delta_header(build(r), limits), FragmentOutOfRange);
    auto header = make_header(0);
    header.fragment = 0xFFFFFFFF;
    CHECK_REJECTS(decode_both(encode(header, dense_fragment(layout, 0, 1), codec(DType::INT8)),
                               limits),
                  FragmentOutOfRange);
  }
}

TEST_CASE("rejected: tensors against the layout", "[codec][reject]") {
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  const auto header = make_header(0);
  auto tensors = dense_fragment(layout, 0, 3);

  SECTION("a tensor missing") {
    tensors.pop_back();
    CHECK_REJECTS(decode_both(encode(header, tensors, codec(DType::INT4)), limits),
                  TensorCountMismatch);
  }
  SECTION("no tensors at all") {
    CHECK_REJECTS(decode_both(encode(header, {}, codec(DType::INT4)), limits),
                  TensorCountMismatch);
    RawDelta r;
    r.tensors.reset();
    CHECK_REJECTS(decode_both(build(r), limits), MissingField);
  }
  SECTION("100000 empty tensors") {
    RawDelta r;
    r.tensors = std::vector<RawTensor>(100000);
    CHECK_REJECTS(decode_both(build(r), limits), TensorCountMismatch);
  }
  SECTION("same number of values, another shape") {
    tensors[0].shape = {33, 4};
    CHECK_REJECTS(decode_both(encode(header, tensors, codec(DType::INT8)), limits),
                  ShapeMismatch);
  }
  SECTION("a shape of another rank") {
    tensors[2].shape = {3, 5};
    CHECK_REJECTS(decode_both(encode(header, tensors, codec(DType::F32)), limits),
                  ShapeMismatch);
  }
  SECTION("tensors out of order") {
    std::swap(tensors[0].index, tensors[1].index);
    CHECK_REJECTS(decode_both(encode(header, tensors, codec(DType::BF16)), limits),
                  ShapeMismatch);
  }
  SECTION("shape missing") {
    RawDelta r;
    (*r.tensors)[0].shape.reset();
    CHECK_REJECTS(decode_both(build(r), limits), ShapeMismatch);
  }
}

TEST_CASE("rejected: codec", "[codec][reject]") {
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  RawDelta r;
  auto& t = (*r.tensors)[0];
  SECTION("unknown dtype") {
    r.dtype = 4;
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
  SECTION("block size 0") {
    r.block_size = 0;
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
  SECTION("block size above 2^20") {
    r.block_size = (1u << 20) + 1;
    t.scales = std::vector<float>{0.5f};
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
  SECTION("fp32 with a block size") {
    r.dtype = 0;
    r.block_size = 2;
    t.scales.reset();
    t.payload = std::vector<uint8_t>(16);
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
  SECTION("scale count") {
    t.scales = std::vector<float>{0.5f};
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
    t.scales.reset();
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
  SECTION("payload size") {
    t.payload = std::vector<uint8_t>{1, 2, 3};
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
    t.payload = std::vector<uint8_t>(5);
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
    r.dtype = 3;  // INT4: 4 values are 2 bytes
    t.payload = std::vector<uint8_t>(4);
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
  SECTION("negative scale") {
    t.scales = std::vector<float>{0.5f, -0.25f};
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
  SECTION("negative zero scale") {
    // No encoder writes -0 (a block's largest magnitude is +0 at least), and a value a sparse
    // delta leaves out would read +0 where its unpacked payload gives code 0 * -0 = -0.
    t.scales = std::vector<float>{0.5f, -0.0f};
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
  SECTION("codec missing") {
    r.has_codec = false;
    CHECK_REJECTS(decode_both(build(r), limits), MissingField);
  }
  SECTION("topk not below the block size, or with fp32") {
    r.topk = 1;
    CHECK_NOTHROW(decode_both(build(r), limits));
    r.topk = 2;
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
    r.dtype = 0;
    r.block_size = 0;
    r.topk = 1;
    t.scales.reset();
    t.payload = std::vector<uint8_t>(16);
    CHECK_REJECTS(decode_both(build(r), limits), BadCodec);
  }
}

TEST_CASE("rejected: non-finite values and scales", "[codec][reject]") {
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  const auto header = make_header(0);
  auto tensors = dense_fragment(layout, 0, 4);

  // (Loops rather than GENERATE: Catch2 v2 generators misbehave inside sections.)
  SECTION("NaN and Inf in fp32 and bf16 values, shuffled or not") {
    for (DType dtype : {DType::F32, DType::BF16})
      for (bool shuffle : {false, true})
        for (float bad : {kNaN, kInf, -kInf}) {
          auto with_bad = tensors;
          with_bad[1].values[3] = bad;
          INFO(dtype_name(dtype) << " shuffle " << shuffle << " value " << bad);
          CHECK_REJECTS(decode_both(encode(header, with_bad, codec(dtype, shuffle)), limits),
                        NonFinite);
        }
  }
  SECTION("NaN in int8/int4 values gives a NaN scale") {
    tensors[0].values[100] = kNaN;
    for (DType dtype : {DType::INT8, DType::INT4})
      CHECK_REJECTS(decode_both(encode(header, tensors, codec(dtype)), limits), NonFinite);
  }
  SECTION("NaN, Inf and overflowing scales, by hand") {
    for (float scale : {kNaN, kInf, 1e38f}) {
      RawDelta r;
      (*r.tensors)[0].scales = std::vector<float>{0.5f, scale};
      INFO("scale " << scale);
      CHECK_REJECTS(decode_both(build(r), limits), NonFinite);
    }
  }
  SECTION("train loss") {
    RawDelta r;
    r.train_loss = kNaN;
    CHECK_REJECTS(decode_both(build(r), limits), NonFinite);
  }
}

TEST_CASE("rejected: counters", "[codec][reject]") {
  const auto layout = make_layout();
  auto limits = limits_for(layout);
  RawDelta r;
  SECTION("seq 0") { r.seq = 0; }
  SECTION("no inner steps") { r.inner_steps = 0; }
  SECTION("steps without tokens") { r.tokens = 0; }
  SECTION("too many tokens per step") {
    r.inner_steps = 2;
    r.tokens = 2 * limits.max_tokens_per_step + 2;
  }
  SECTION("absurd base version") { r.base_version = (1ull << 48) + 1; }
  SECTION("absurd seq") { r.seq = ~0ull; }
  CHECK_REJECTS(decode_both(build(r), limits), BadCounter);
  CHECK_REJECTS(peek_delta_header(build(r), limits), BadCounter);
}

TEST_CASE("rejected: missing strings", "[codec][reject]") {
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  RawDelta r;
  SECTION("learner id") { r.learner_id.reset(); }
  SECTION("empty learner id") { r.learner_id = ""; }
  SECTION("region") { r.region.reset(); }
  CHECK_REJECTS(decode_both(build(r), limits), MissingField);
}

TEST_CASE("peek_delta_header reads the header only", "[codec][reject]") {
  const auto layout = make_layout();
  const auto limits = limits_for(layout);
  RawDelta r;
  r.tensors = std::vector<RawTensor>(3);  // wrong count for fragment 1: only decode sees it
  const auto bytes = build(r);
  CHECK_REJECTS(decode_delta(bytes, limits), TensorCountMismatch);
  const DeltaHeader h = peek_delta_header(bytes, limits);
  CHECK(h.learner_id == "learner-1");
  CHECK(h.fragment == 1);
}

TEST_CASE("rejected: FragmentParams and FragmentState", "[codec][reject]") {
  const auto layout = make_layout();
  auto limits = limits_for(layout);
  FragmentParams params;
  params.run_id = "run-1";
  params.fingerprint = layout.fingerprint;
  params.fragment = 1;
  params.merger_instance = "m";
  params.tensors = dense_fragment(layout, 1, 8);
  FragmentState state;
  state.run_id = "run-1";
  state.fingerprint = layout.fingerprint;
  state.layout = carried(layout);
  state.fragment = 1;
  state.params = params.tensors;
  state.momentum = params.tensors;

  SECTION("checksum mismatch") {
    params.checksum = reference_checksum(params.tensors) ^ 1;
    CHECK_REJECTS(decode_fragment_params(encode_fragment_params(params), limits), CorruptFrame);
    state.checksum = reference_checksum(state.params) ^ 1;
    CHECK_REJECTS(decode_fragment_state(encode_fragment_state(state), limits), CorruptFrame);
  }
  SECTION("run id, fingerprint, fragment, shape") {
    limits.run_id = "other";
    CHECK_REJECTS(decode_fragment_params(encode_fragment_params(params), limits), WrongRunId);
    CHECK_REJECTS(decode_fragment_state(encode_fragment_state(state), limits), WrongRunId);
    limits = limits_for(layout);
    limits.fingerprint ^= 1;
    CHECK_REJECTS(decode_fragment_params(encode_fragment_params(params), limits), WrongFingerprint);
    CHECK_REJECTS(decode_fragment_state(encode_fragment_state(state), limits), WrongFingerprint);
    limits = limits_for(layout);
    params.fragment = 5;
    state.fragment = 5;
    CHECK_REJECTS(decode_fragment_params(encode_fragment_params(params), limits),
                  FragmentOutOfRange);
    CHECK_REJECTS(decode_fragment_state(encode_fragment_state(state), limits), FragmentOutOfRange);
    params.fragment = 0;  // fragment 0 has three tensors
    CHECK_REJECTS(decode_fragment_params(encode_fragment_params(params), limits),
                  TensorCountMismatch);
    params.fragment = 1;
    params.tensors[0].shape = {4};
    CHECK_REJECTS(decode_fragment_params(encode_fragment_params(params), limits), ShapeMismatch);
  }
  SECTION("NaN in parameters") {
    params.tensors[0].values[0] = kNaN;
    CHECK_REJECTS(decode_fragment_params(encode_fragment_params(params), limits), NonFinite);
    state.momentum[0].values[1] = kInf;
    CHECK_REJECTS(decode_fragment_state(encode_fragment_state(state), limits), NonFinite);
  }
  SECTION("momentum with the wrong number of tensors") {
    state.momentum.push_back(state.momentum[0]);
    CHECK_REJECTS(decode_fragment_state(encode_fragment_state(state), limits), TensorCountMismatch);
  }
}

TEST_CASE("rejected: MergeRecord, Member, Rejected", "[codec][reject]") {
  const auto layout = make_layout();
  auto limits = limits_for(layout);
  MergeRecord record;
  record.run_id = "run-1";
  record.fingerprint = layout.fingerprint;
  record.fragment = 1;
  record.inputs = {delta_ref("deltas", 0, 1, "l", 1, 0, 0, 1, 1, 1.0)};
  Member member;
  member.run_id = "run-1";
  member.instance_id = "i";
  RejectedInput rejected;
  rejected.run_id = "run-1";

  SECTION("wrong run id") {
    limits.run_id = "run-0";
    CHECK_REJECTS(decode_merge_record(encode_merge_record(record), limits), WrongRunId);
    CHECK_REJECTS(decode_member(encode_member(member), limits), WrongRunId);
    CHECK_REJECTS(decode_rejected(encode_rejected(rejected), limits), WrongRunId);
  }
  SECTION("merge record: fingerprint, fragment, weights") {
    limits.fingerprint = 1;
    CHECK_REJECTS(decode_merge_record(encode_merge_record(record), limits), WrongFingerprint);
    limits = limits_for(layout);
    record.fragment = 2;
    CHECK_REJECTS(decode_merge_record(encode_merge_record(record), limits), FragmentOutOfRange);
    record.fragment = 1;
    record.inputs[0].weight = std::numeric_limits<double>::quiet_NaN();
    CHECK_REJECTS(decode_merge_record(encode_merge_record(record), limits), NonFinite);
    record.inputs[0].weight = 1.0;
    record.hyper.lr = kInf;
    CHECK_REJECTS(decode_merge_record(encode_merge_record(record), limits), NonFinite);
    record.hyper.lr = 0.7f;
    record.share = 1.5f;
    CHECK_REJECTS(decode_merge_record(encode_merge_record(record), limits), BadCounter);
    record.share = 0.0f;
    CHECK_REJECTS(decode_merge_record(encode_merge_record(record), limits), BadCounter);
    record.share = std::numeric_limits<float>::quiet_NaN();
    CHECK_REJECTS(decode_merge_record(encode_merge_record(record), limits), NonFinite);
  }
  SECTION("unknown enum values") {
    record.rule = static_cast<MergeRule>(9);
    CHECK_REJECTS(decode_merge_record(encode_merge_record(record), limits), BadFlatbuffer);
    member.role = static_cast<Role>(3);
    CHECK_REJECTS(decode_member(encode_member(member), limits), BadFlatbuffer);
  }
  SECTION("member: versions not parallel to fragments") {
    member.owned_fragments = {1, 2};
    member.fragment_versions = {1};
    CHECK_REJECTS(decode_member(encode_member(member), limits), BadFlatbuffer);
  }
  SECTION("membership does not depend on the model") {
    limits.fingerprint = 0;
    limits.layout = nullptr;
    CHECK(decode_member(encode_member(member), limits).instance_id == "i");
  }
}
