// Chunked messages (core/codec/chunk.h, core/kafka/chunk_assembler.h): a message travels whole or
// not at all. Every piece of a message in order gives it back bit for bit; a lost piece, a
// duplicated piece, a piece of another message mixed in, or pieces with inconsistent headers are
// each rejected with their reason and the position they concern, and never hand on a partial
// message.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <fstream>
#include <random>

#include "core/codec/chunk.h"
#include "core/kafka/chunk_assembler.h"
#include "schemas/chunk_generated.h"

using namespace diloco;

namespace {

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

DecodeLimits limits() {
  DecodeLimits l;
  l.run_id = "chunks";
  return l;
}

ChunkId id_of(const std::string& stream, uint64_t message, uint32_t fragment = 3) {
  return ChunkId{"chunks", stream, fragment, message};
}

ConsumedMessage record(std::vector<uint8_t> value, int64_t offset, int32_t partition = 0) {
  ConsumedMessage m;
  m.topic = "deltas";
  m.partition = partition;
  m.offset = offset;
  m.key = "3";
  m.value = std::move(value);
  return m;
}

// Feeds records in order from offset `first`; returns the whole messages and every problem.
struct Fed {
  std::vector<ConsumedMessage> messages;
  std::vector<ChunkProblem> problems;
};
Fed feed(ChunkAssembler& a, std::vector<std::vector<uint8_t>> pieces, int64_t first = 0) {
  Fed out;
  int64_t offset = first;
  for (auto& p : pieces) {
    auto r = a.add(record(std::move(p), offset++));
    if (r.message) out.messages.push_back(std::move(*r.message));
    for (auto& problem : r.problems) out.problems.push_back(std::move(problem));
  }
  return out;
}

// A piece as a hostile sender writes it: any count and size, one byte of data.
std::vector<uint8_t> piece_of(const std::string& stream, uint32_t index, uint32_t count, uint64_t total_bytes) {
  flatbuffers::FlatBufferBuilder fbb;
  const uint8_t byte = 7;
  const auto run_id = fbb.CreateString("chunks");
  const auto stream_name = fbb.CreateString(stream);
  const auto data = fbb.CreateVector(&byte, 1);
  wire::FinishChunkBuffer(fbb, wire::CreateChunk(fbb, kSchemaVersion, run_id, stream_name, 3, 1, index, count,
                                                 total_bytes, 0, data));
  return {fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize()};
}

// This process's resident memory now (not its peak), in bytes.
int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

}  // namespace

TEST_CASE("a message that fits travels unchanged, a larger one as pieces that give it back", "[chunks]") {
  const auto small = random_bytes(1000, 1);
  auto pieces = split_message(small, id_of("learner-0", 1), 4096);
  REQUIRE(pieces.size() == 1);
  CHECK(pieces[0] == small);
  CHECK_FALSE(is_chunk(pieces[0]));

  const auto big = random_bytes(10'000, 2);
  pieces = split_message(big, id_of("learner-0", 2), 4096);
  REQUIRE(pieces.size() == 3);
  for (const auto& p : pieces) {
    CHECK(is_chunk(p));
    CHECK(p.size() <= 4096 + kChunkOverhead);
  }
  const ChunkPiece last = decode_chunk(pieces[2], limits());
  CHECK(last.index == 2);
  CHECK(last.count == 3);
  CHECK(last.total_bytes == big.size());
  CHECK(last.data.size() == 10'000 - 2 * 4096);

  ChunkAssembler a(limits());
  Fed fed = feed(a, pieces, 10);
  CHECK(fed.problems.empty());
  REQUIRE(fed.messages.size() == 1);
  CHECK(fed.messages[0].value == big);
  CHECK(fed.messages[0].offset == 10);       // at its first piece
  CHECK(fed.messages[0].last_offset == 12);  // and its last
  CHECK(a.open_messages() == 0);
  CHECK(a.finish().empty());
}

TEST_CASE("for_each_piece hands out one piece at a time, in order, and a message that fits as itself", "[chunks]") {
  const auto big = random_bytes(10'000, 4);
  std::vector<std::vector<uint8_t>> seen;
  for_each_piece(big, id_of("merger-0", 7), 4096, [&](uint32_t index, uint32_t count, std::span<const uint8_t> piece) {
    CHECK(index == seen.size());
    CHECK(count == 3);
    const ChunkPiece decoded = decode_chunk(piece, limits());
    CHECK(decoded.index == index);
    CHECK(decoded.message == 7);
    seen.emplace_back(piece.begin(), piece.end());
  });
  REQUIRE(seen.size() == 3);
  ChunkAssembler a(limits());
  Fed fed = feed(a, seen, 0);
  REQUIRE(fed.messages.size() == 1);
  CHECK(fed.messages[0].value == big);

  const auto small = random_bytes(100, 5);
  int calls = 0;
  for_each_piece(small, id_of("merger-0", 8), 4096, [&](uint32_t index, uint32_t count, std::span<const uint8_t> piece) {
    ++calls;
    CHECK(index == 0);
    CHECK(count == 1);
    CHECK(std::vector<uint8_t>(piece.begin(), piece.end()) == small);
  });
  CHECK(calls == 1);
  CHECK_THROWS_AS(for_each_piece(small, id_of("merger-0", 9), 0, [](uint32_t, uint32_t, std::span<const uint8_t>) {}),
                  InvalidInput);
}

TEST_CASE("interleaved pieces of two senders each give their message back", "[chunks]") {
  const auto x = random_bytes(9000, 3), y = random_bytes(9000, 4);
  auto px = split_message(x, id_of("learner-0", 7), 4096);
  auto py = split_message(y, id_of("learner-1", 7), 4096);
  ChunkAssembler a(limits());
  std::vector<std::vector<uint8_t>> mixed;
  for (size_t i = 0; i < 3; ++i) {
    mixed.push_back(px[i]);
    mixed.push_back(py[i]);
  }
  Fed fed = feed(a, mixed);
  CHECK(fed.problems.empty());
  REQUIRE(fed.messages.size() == 2);
  CHECK(fed.messages[0].value == x);
  CHECK(fed.messages[0].offset == 0);
  CHECK(fed.messages[1].value == y);
  CHECK(fed.messages[1].offset == 1);
}

TEST_CASE("a lost piece: the message is rejected as chunk_missing at its first piece, never handed on", "[chunks]") {
  auto first = split_message(random_bytes(12'000, 5), id_of("learner-0", 1), 4096);
  auto second = split_message(random_bytes(12'000, 6), id_of("learner-0", 2), 4096);
  REQUIRE(first.size() == 3);
  ChunkAssembler a(limits());
  // Piece 1 of the first message is lost; the sender's next message begins.
  Fed fed = feed(a, {first[0], first[2]}, 100);
  CHECK(fed.messages.empty());
  CHECK(fed.problems.empty());
  REQUIRE(a.open_heads().size() == 1);
  CHECK(a.open_heads()[0].offset == 100);  // holds the consumer offset back
  fed = feed(a, second, 102);
  REQUIRE(fed.problems.size() == 1);
  CHECK(fed.problems[0].reason == RejectReason::ChunkMissing);
  CHECK(fed.problems[0].position.offset == 100);
  CHECK_THAT(fed.problems[0].detail, Catch::Contains("2 of 3 pieces"));
  REQUIRE(fed.messages.size() == 1);  // the next message is whole
  CHECK(fed.messages[0].offset == 102);

  // The same at the end of a read, and by age.
  ChunkAssembler b(limits());
  feed(b, {first[0], first[1]});
  auto ended = b.finish();
  REQUIRE(ended.size() == 1);
  CHECK(ended[0].reason == RejectReason::ChunkMissing);
  ChunkAssembler c(limits());
  c.add(record(first[0], 0), 10.0);
  CHECK(c.expire(5.0).empty());
  auto expired = c.expire(20.0);
  REQUIRE(expired.size() == 1);
  CHECK(expired[0].position.offset == 0);
  CHECK(c.open_heads().empty());
}

TEST_CASE("a duplicated piece is rejected as chunk_duplicate and the message still arrives once", "[chunks]") {
  const auto big = random_bytes(12'000, 7);
  auto p = split_message(big, id_of("learner-0", 1), 4096);
  ChunkAssembler a(limits());
  Fed fed = feed(a, {p[0], p[1], p[1], p[2]});
  REQUIRE(fed.problems.size() == 1);
  CHECK(fed.problems[0].reason == RejectReason::ChunkDuplicate);
  CHECK(fed.problems[0].position.offset == 2);
  REQUIRE(fed.messages.size() == 1);
  CHECK(fed.messages[0].value == big);
}

TEST_CASE("a piece of another message mixed in: rejected as chunk_mismatch, nothing handed on", "[chunks]") {
  const auto x = random_bytes(12'000, 8);
  auto px = split_message(x, id_of("learner-0", 1), 4096);
  // Same sender, fragment, message number and size, other bytes: only the checksum can tell.
  auto forged = split_message(random_bytes(12'000, 9), id_of("learner-0", 1), 4096);
  ChunkAssembler a(limits());
  Fed fed = feed(a, {px[0], forged[1], px[2]});
  // The forged piece carries its own message's checksum, which differs from the first piece's.
  REQUIRE(fed.problems.size() == 1);
  CHECK(fed.problems[0].reason == RejectReason::ChunkMismatch);
  CHECK(fed.problems[0].position.offset == 1);
  CHECK(fed.messages.empty());
  CHECK(a.open_messages() == 1);  // still waiting for its real piece 1

  // A piece whose header fields are all right but whose data is not: the reassembled bytes do
  // not match the message's checksum. Flip one data byte of x's piece 1 (the FlatBuffer stays
  // valid).
  const ChunkPiece real1 = decode_chunk(px[1], limits());
  std::vector<uint8_t> tampered = px[1];
  const auto pos = std::search(tampered.begin(), tampered.end(), real1.data.begin(), real1.data.begin() + 64);
  REQUIRE(pos != tampered.end());
  *(pos + 10) ^= 0xff;
  ChunkAssembler b(limits());
  fed = feed(b, {px[0], tampered, px[2]});
  REQUIRE(fed.problems.size() == 1);
  CHECK(fed.problems[0].reason == RejectReason::ChunkMismatch);
  CHECK(fed.problems[0].position.offset == 0);  // the whole message, at its first piece
  CHECK_THAT(fed.problems[0].detail, Catch::Contains("another message"));
  CHECK(fed.messages.empty());
}

TEST_CASE("hostile pieces are rejected by strict decoding", "[chunks]") {
  auto p = split_message(random_bytes(9000, 10), id_of("learner-0", 1), 4096);
  ChunkAssembler a(limits());
  DecodeLimits other = limits();
  other.run_id = "another-run";
  CHECK_THROWS_AS(decode_chunk(p[0], other), Rejection);
  std::vector<uint8_t> cut(p[0].begin(), p[0].begin() + 100);
  cut[4] = 'D', cut[5] = 'C', cut[6] = 'H', cut[7] = 'K';  // looks like a piece, does not verify
  auto r = a.add(record(cut, 0));
  CHECK_FALSE(r.message);
  REQUIRE(r.problems.size() == 1);
  CHECK(r.problems[0].reason == RejectReason::BadFlatbuffer);
  // A piece announcing a message above the limit.
  DecodeLimits small = limits();
  small.max_message_bytes = 5000;
  CHECK_THROWS_AS(decode_chunk(p[0], small), Rejection);
  // A record that is not a piece passes through untouched.
  const auto plain = random_bytes(50, 11);
  r = a.add(record(plain, 5));
  REQUIRE(r.message);
  CHECK(r.message->value == plain);
  CHECK(r.message->last_offset == 5);
}

// Found with fuzz/chunk_assembly.cc: the assembler sized a message's list of pieces by the count
// its first piece declared, so a record of about 100 bytes announcing kMaxChunks pieces held
// 24 MiB until the message was given up (16 such records: 384 MiB). Memory now follows the bytes
// that arrived.
TEST_CASE("a piece declaring a huge count costs memory for what arrived only", "[chunks]") {
  ChunkAssembler a(limits());
  const int64_t before = resident_bytes();
  for (int k = 0; k < 16; ++k) {
    const auto r = a.add(record(piece_of("sender-" + std::to_string(k), 0, kMaxChunks, kMaxChunks), k));
    CHECK_FALSE(r.message);
    CHECK(r.problems.empty());
  }
  CHECK(a.open_messages() == 16);
  CHECK(a.open_bytes() == 16);
  CHECK(resident_bytes() - before < (int64_t{64} << 20));
  CHECK(a.finish().size() == 16);  // each reported as incomplete at the end of the read
}

TEST_CASE("a reader after named messages collects only those and reports nothing else", "[chunks]") {
  auto x = split_message(random_bytes(9000, 12), id_of("learner-0", 1), 4096);
  auto y = split_message(random_bytes(9000, 13), id_of("learner-1", 1), 4096);
  ChunkAssembler a(limits(), [](const ConsumedMessage& head) { return head.offset == 1; });
  // y's first piece is at offset 1 (wanted), x's at 0 (not), and x's tail comes without problems.
  Fed fed = feed(a, {x[0], y[0], x[1], y[1], x[2], y[2]});
  CHECK(fed.problems.empty());
  REQUIRE(fed.messages.size() == 1);
  CHECK(fed.messages[0].offset == 1);
  // Tails of a message begun before the read are ignored silently too.
  ChunkAssembler b(limits(), [](const ConsumedMessage&) { return true; });
  fed = feed(b, {x[1], x[2]});
  CHECK(fed.problems.empty());
  CHECK(fed.messages.empty());
  CHECK(b.open_heads().empty());
}
