// Messages that carry the run's model layout (schemas/common.fbs ModelLayout): a learner's
// GenesisProposal and every FragmentState. A reader that holds no model (a merger before genesis,
// replay, a learner telling how its model differs from the run's) decodes them self-described,
// checked against the layout they carry, whose fingerprint must be theirs. Proposals come from
// any learner before any check of the run: decoding them is strict, and hostile bytes end in a
// Rejection, never in other values.
#include <catch2/catch.hpp>

#include <functional>
#include <limits>
#include <random>

#include "core/codec/compress.h"
#include "core/codec/messages.h"
#include "core/fragments/partition.h"
#include "schemas/genesis_generated.h"
#include "tests/rejection.h"

using namespace diloco;
using testing::rejection;

namespace {

// LPT: embed (24) -> 0; proj (12), head (8), norm (4) -> 1, kept in model order there.
std::vector<TensorSpec> model_tensors() {
  return {{"embed", {6, 4}}, {"norm", {4}}, {"proj", {4, 3}}, {"head", {2, 4}}};
}

std::shared_ptr<const FragmentLayout> run_layout(std::vector<TensorSpec> tensors = model_tensors()) {
  return std::make_shared<const FragmentLayout>(partition_tensors(tensors, 2));
}

DecodeLimits reader_with(const FragmentLayout& layout) {
  return DecodeLimits{.run_id = "run-1", .fingerprint = layout.fingerprint, .layout = &layout};
}

// A reader without a model: any fingerprint whose layout the message carries.
DecodeLimits reader_without_model() { return DecodeLimits{.run_id = "run-1"}; }

std::vector<DenseTensor> values_of(const FragmentLayout& layout, uint32_t p, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<DenseTensor> out;
  for (uint32_t k = 0; k < layout.fragments[p].size(); ++k) {
    DenseTensor t{k, layout.fragments[p][k].shape, std::vector<float>(static_cast<size_t>(layout.fragments[p][k].numel()))};
    for (auto& v : t.values) v = normal(rng);
    out.push_back(std::move(t));
  }
  return out;
}

GenesisProposal proposal_of(std::shared_ptr<const FragmentLayout> layout, uint32_t p = 1) {
  GenesisProposal msg{.run_id = "run-1", .fingerprint = layout->fingerprint, .learner_id = "learner-a",
                      .region = "eu", .fragment = p, .seq = 1'700'000'000'000, .send_time_us = 1'700'000'000'000'123,
                      .layout = layout};
  msg.tensors = values_of(*layout, p, 5 + p);
  return msg;
}

FragmentState state_of(std::shared_ptr<const FragmentLayout> layout, uint32_t p = 1) {
  FragmentState msg{.run_id = "run-1", .fingerprint = layout->fingerprint, .fragment = p, .version = 3};
  msg.params = values_of(*layout, p, 7);
  msg.momentum = values_of(*layout, p, 8);
  msg.layout = layout;
  return msg;
}

bool same_values(const std::vector<DenseTensor>& a, const std::vector<DenseTensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t t = 0; t < a.size(); ++t)
    if (a[t].index != b[t].index || a[t].shape != b[t].shape || a[t].values != b[t].values) return false;
  return true;
}

void check_same_layout(const FragmentLayout& got, const FragmentLayout& want) {
  CHECK(got.fingerprint == want.fingerprint);
  CHECK(got.tensors == want.tensors);
  CHECK(got.fragments == want.fragments);
}

}  // namespace

TEST_CASE("GenesisProposal round trip, read with the run's layout and self-described", "[codec][genesis]") {
  const auto layout = run_layout();
  const GenesisProposal msg = proposal_of(layout);
  const auto bytes = encode_genesis_proposal(msg);
  for (const bool self_described : {false, true}) {
    INFO((self_described ? "self-described" : "with the reader's layout"));
    const GenesisProposal got = decode_genesis_proposal(bytes, self_described ? reader_without_model() : reader_with(*layout));
    CHECK(got.run_id == "run-1");
    CHECK(got.fingerprint == layout->fingerprint);
    CHECK(got.learner_id == "learner-a");
    CHECK(got.region == "eu");
    CHECK(got.fragment == 1);
    CHECK(got.seq == msg.seq);
    CHECK(got.send_time_us == msg.send_time_us);
    CHECK(got.checksum == checksum_fp32(msg.tensors));
    CHECK(got.wire_bytes == bytes.size());
    CHECK(same_values(got.tensors, msg.tensors));
    if (self_described) {
      REQUIRE(got.layout != nullptr);
      check_same_layout(*got.layout, *layout);
    } else {
      CHECK(got.layout == nullptr);  // the reader's own layout applies
    }
  }
}

TEST_CASE("a FragmentState carries the whole run's layout, not only its fragment's", "[codec][genesis]") {
  const auto layout = run_layout();
  const FragmentState msg = state_of(layout, 0);
  const auto bytes = encode_fragment_state(msg);
  CHECK(decode_fragment_state(bytes, reader_with(*layout)).layout == nullptr);
  const FragmentState got = decode_fragment_state(bytes, reader_without_model());
  REQUIRE(got.layout != nullptr);
  check_same_layout(*got.layout, *layout);
  CHECK(got.layout->tensors.size() == 4);
  CHECK(same_values(got.params, msg.params));
  CHECK(same_values(got.momentum, msg.momentum));
  CHECK(got.version == 3);
}

TEST_CASE("a reader without a model takes any model's messages, each checked against its own layout",
          "[codec][genesis]") {
  auto other_tensors = model_tensors();
  other_tensors[3].shape = {2, 5};
  const auto other = run_layout(other_tensors);
  REQUIRE(other->fingerprint != run_layout()->fingerprint);
  const auto proposal = decode_genesis_proposal(encode_genesis_proposal(proposal_of(other)), reader_without_model());
  CHECK(proposal.fingerprint == other->fingerprint);
  CHECK(proposal.tensors.back().shape == std::vector<int64_t>{2, 5});
  const auto state = decode_fragment_state(encode_fragment_state(state_of(other)), reader_without_model());
  CHECK(state.layout->fingerprint == other->fingerprint);
  // With the run's layout, the same bytes are another model's.
  const auto run = run_layout();
  CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(proposal_of(other)), reader_with(*run)), WrongFingerprint);
  CHECK_REJECTS(decode_fragment_state(encode_fragment_state(state_of(other)), reader_with(*run)), WrongFingerprint);
}

TEST_CASE("a layout that does not give the message's fingerprint is rejected as bad_layout", "[codec][genesis]") {
  const auto layout = run_layout();
  auto other_tensors = model_tensors();
  other_tensors[1].shape = {5};
  const uint64_t other_fingerprint = run_layout(other_tensors)->fingerprint;

  SECTION("the tensors of one model under another's fingerprint") {
    auto forged = std::make_shared<FragmentLayout>(*layout);
    forged->fingerprint = other_fingerprint;
    GenesisProposal proposal = proposal_of(forged);
    CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(proposal), reader_without_model()), BadLayout);
    FragmentState state = state_of(forged);
    CHECK_REJECTS(decode_fragment_state(encode_fragment_state(state), reader_without_model()), BadLayout);
  }
  SECTION("a fragment count that does not give the fingerprint") {
    auto forged = std::make_shared<FragmentLayout>(*layout);
    forged->fragments.push_back({});  // written as 3 fragments of the same tensors
    CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(proposal_of(forged)), reader_without_model()),
                  BadLayout);
  }
  SECTION("a tensor list no learner can register") {
    auto forged = std::make_shared<FragmentLayout>(*layout);
    forged->tensors.push_back(forged->tensors.front());  // a name twice
    CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(proposal_of(forged)), reader_without_model()),
                  BadLayout);
    forged->tensors = layout->tensors;
    forged->tensors[2].shape = {4, 0};
    CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(proposal_of(forged)), reader_without_model()),
                  BadLayout);
  }
}

TEST_CASE("a proposal of a fragment its own layout does not have is out of range", "[codec][genesis]") {
  const auto layout = run_layout();
  GenesisProposal msg = proposal_of(layout);
  msg.fragment = 2;
  CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(msg), reader_without_model()), FragmentOutOfRange);
  CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(msg), reader_with(*layout)), FragmentOutOfRange);
}

TEST_CASE("a proposal or checkpoint without a layout is missing a field, with or without the reader's",
          "[codec][genesis]") {
  const auto layout = run_layout();
  flatbuffers::FlatBufferBuilder fbb;
  const auto run_id = fbb.CreateString("run-1");
  const auto learner_id = fbb.CreateString("learner-a");
  const auto region = fbb.CreateString("eu");
  fbb.Finish(wire::CreateGenesisProposal(fbb, kSchemaVersion, run_id, layout->fingerprint, learner_id, region, 1, 1, 0),
             wire::GenesisProposalIdentifier());
  const auto bytes = zstd_compress(std::span<const uint8_t>(fbb.GetBufferPointer(), fbb.GetSize()), 1);
  CHECK_REJECTS(decode_genesis_proposal(bytes, reader_without_model()), MissingField);
  CHECK_REJECTS(decode_genesis_proposal(bytes, reader_with(*layout)), MissingField);
}

TEST_CASE("a proposal is decoded strictly", "[codec][genesis][reject]") {
  const auto layout = run_layout();
  GenesisProposal msg = proposal_of(layout);
  const auto limits = reader_with(*layout);
  REQUIRE(rejection([&] { (void)decode_genesis_proposal(encode_genesis_proposal(msg), limits); }) == "accepted");

  SECTION("another run") {
    msg.run_id = "run-2";
    CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(msg), limits), WrongRunId);
    CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(msg), reader_without_model()), WrongRunId);
  }
  SECTION("no learner id") {
    msg.learner_id.clear();
    CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(msg), limits), MissingField);
  }
  SECTION("sequence number 0") {
    msg.seq = 0;
    CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(msg), limits), BadCounter);
  }
  SECTION("a checksum the values do not have") {
    msg.checksum = checksum_fp32(msg.tensors) ^ 1;
    CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(msg), limits), CorruptFrame);
  }
  SECTION("a value that is not finite") {
    msg.tensors[2].values[3] = std::numeric_limits<float>::infinity();
    CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(msg), limits), NonFinite);
    msg.tensors[2].values[3] = std::numeric_limits<float>::quiet_NaN();
    CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(msg), reader_without_model()), NonFinite);
  }
  SECTION("a tensor too few") {
    msg.tensors.pop_back();
    CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(msg), limits), TensorCountMismatch);
    CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(msg), reader_without_model()), TensorCountMismatch);
  }
  SECTION("a tensor of another shape than its layout's") {
    msg.tensors[1].shape = {3, 4};  // the same number of values
    CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(msg), limits), ShapeMismatch);
    CHECK_REJECTS(decode_genesis_proposal(encode_genesis_proposal(msg), reader_without_model()), ShapeMismatch);
  }
}

// Every truncation and every single-bit flip of a proposal and a checkpoint, read as a merger
// before genesis reads them (no model): a Rejection or the very same values, nothing else.
TEST_CASE("hostile proposals and checkpoints are rejected or decode to the values sent", "[codec][genesis][reject]") {
  const auto layout = run_layout();
  const GenesisProposal proposal = proposal_of(layout);
  const FragmentState state = state_of(layout);
  const auto limits = reader_without_model();
  struct Case {
    const char* name;
    std::vector<uint8_t> frame;
    std::function<std::vector<DenseTensor>(std::span<const uint8_t>)> decode;
    std::vector<DenseTensor> sent;
  };
  const Case cases[] = {
      {"GenesisProposal", encode_genesis_proposal(proposal),
       [&](std::span<const uint8_t> b) {
         auto got = decode_genesis_proposal(b, limits);
         CHECK(got.fingerprint == layout->fingerprint);
         CHECK(got.fragment == 1);
         return got.tensors;
       },
       proposal.tensors},
      {"FragmentState", encode_fragment_state(state),
       [&](std::span<const uint8_t> b) {
         auto got = decode_fragment_state(b, limits);
         CHECK(got.fingerprint == layout->fingerprint);
         CHECK(got.fragment == 1);
         return got.params;
       },
       state.params},
  };
  for (const auto& c : cases) {
    INFO(c.name);
    size_t accepted = 0, variants = 0;
    auto attempt = [&](std::span<const uint8_t> bytes) {
      ++variants;
      std::vector<DenseTensor> got;
      const std::string outcome = rejection([&] { got = c.decode(bytes); });
      if (outcome != "accepted") return;
      ++accepted;
      CHECK(same_values(got, c.sent));
    };
    for (size_t n = 0; n < c.frame.size(); ++n) attempt(std::span<const uint8_t>(c.frame.data(), n));
    const auto plain = zstd_decompress_bounded(c.frame, 1 << 20);
    for (size_t n = 0; n < plain.size(); ++n) attempt(zstd_compress(std::span<const uint8_t>(plain.data(), n), 1));
    for (size_t byte = 0; byte < plain.size(); ++byte)
      for (int bit = 0; bit < 8; ++bit) {
        auto flipped = plain;
        flipped[byte] ^= static_cast<uint8_t>(1u << bit);
        attempt(zstd_compress(flipped, 1));
      }
    // Most flips land in the values, the checksum or the layout, which the decoder checks.
    CHECK(accepted * 4 < variants);
  }
}
