// ChunkAssembler (core/kafka/chunk_assembler.h), which puts chunked messages back together from
// the records of a partition. Two ways in, by the first byte:
//   even: a log of records, each [partition byte][2-byte length, little endian][bytes]; whatever comes out
//         whole must be a record that is no piece, or a message whose size and xxh64 its pieces
//         declared; problems must name a position that was read;
//   odd:  [2 bytes: piece size, 1 to 256][2 bytes each: the piece left out, the piece sent twice,
//         the piece with one of another message before it (none when past the count)][message]:
//         the message split with split_message, its pieces fed in order as those say: the
//         message must come out whole, bit for bit, exactly when every piece arrived once, and an
//         incomplete one must be reported by finish().
#include <xxhash.h>

#include "core/codec/chunk.h"
#include "core/kafka/chunk_assembler.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

namespace {

// The input, read from the front.
struct Reader {
  const uint8_t* data;
  size_t size;
  size_t remaining_bytes() const { return size; }
  std::vector<uint8_t> bytes(size_t n) {
    n = std::min(n, size);
    std::vector<uint8_t> out(data, data + n);
    data += n;
    size -= n;
    return out;
  }
  uint8_t u8() { return size ? (--size, *data++) : 0; }
  uint16_t u16() {
    const uint8_t low = u8();
    return static_cast<uint16_t>(low | (u8() << 8));
  }
};

ConsumedMessage record(int32_t partition, int64_t offset, std::vector<uint8_t> value) {
  ConsumedMessage m;
  m.topic = "diloco.run-1.deltas.eu";
  m.partition = partition;
  m.offset = offset;
  m.value = std::move(value);
  return m;
}

bool read_here(const LogPosition& p, int64_t offsets) {
  return p.topic == "diloco.run-1.deltas.eu" && p.partition >= 0 && p.partition < 4 && p.offset >= 0 && p.offset < offsets;
}

void log_of_records(Reader& in) {
  ChunkAssembler assembler(limits());
  int64_t offset = 0;
  auto check = [&](const std::vector<ChunkProblem>& problems) {
    for (const auto& p : problems)
      if (!read_here(p.position, offset)) finding("a problem at a position never read: " + describe(p.position));
  };
  while (in.remaining_bytes() > 0) {
    const auto partition = static_cast<int32_t>(in.u8() % 4);
    const auto length = in.u16();
    const auto value = in.bytes(length);
    const bool piece = is_chunk(value);
    const auto result = assembler.add(record(partition, offset, value), static_cast<double>(offset));
    ++offset;
    check(result.problems);
    if (result.message) {
      const auto& m = *result.message;
      expect(read_here({m.topic, m.partition, m.offset}, offset) && m.last_offset >= m.offset && m.last_offset < offset,
             "a message handed on at a position never read");
      if (!piece) expect(m.value == value && m.last_offset == m.offset, "a record that is no piece changed on its way");
    }
    if (offset % 8 == 0) check(assembler.expire(static_cast<double>(offset) - 4));
  }
  check(assembler.finish());
  expect(assembler.open_messages() == 0 && assembler.open_bytes() == 0, "finish() left messages open");
}

void split_message_back(Reader& in) {
  const uint64_t chunk_bytes = in.u16() % 256 + 1;
  const uint16_t dropped = in.u16();   // a piece left out (if below the count)
  const uint16_t repeated = in.u16();  // a piece sent twice
  const uint16_t foreign = in.u16();   // a piece of another message before it
  const auto message = in.bytes(in.remaining_bytes());
  if (message.empty()) return;
  const ChunkId id{.run_id = "run-1", .stream = "learner-1", .fragment = 1, .message = 7};
  const auto pieces = split_message(message, id, chunk_bytes);
  if (pieces.size() == 1) {
    expect(pieces[0] == message, "a message that fits is sent as something else");
    return;
  }
  auto other_id = id;
  other_id.message = 8;
  auto other = message;
  other[0] ^= 1;
  const auto others = split_message(other, other_id, chunk_bytes);

  ChunkAssembler assembler(limits());
  int64_t offset = 0;
  std::optional<ConsumedMessage> whole;
  int64_t whole_at = -1;  // the offset of the piece that completed it
  size_t problems = 0;
  auto add = [&](const std::vector<uint8_t>& value) {
    auto result = assembler.add(record(0, offset, value));
    problems += result.problems.size();
    if (result.message) {
      expect(!whole, "a message handed on twice");
      whole = std::move(result.message);
      whole_at = offset;
    }
    ++offset;
  };
  bool complete = true;
  for (size_t k = 0; k < pieces.size(); ++k) {
    if (k == dropped) {
      complete = false;
      continue;
    }
    if (k == foreign && k < others.size()) {
      // The same stream and fragment with another message id: the open message is given up.
      add(others[k]);
      complete = false;
    }
    add(pieces[k]);
    if (k == repeated) add(pieces[k]);
  }
  const auto left = assembler.finish();
  if (complete) {
    expect(whole.has_value(), "every piece arrived once, yet no message came out");
    expect(whole->value == message, "the pieces reassemble to other bytes");
    expect(whole->offset == 0 && whole->last_offset == whole_at, "the whole message is not at its first piece");
    expect(XXH64(whole->value.data(), whole->value.size(), 0) == XXH64(message.data(), message.size(), 0), "xxh64");
  } else if (whole) {
    // Only a message that came out after a foreign message restarted the stream: it is then
    // the tail of a message whose head was given up, which must never be handed on.
    expect(whole->value == message, "a message handed on with a piece missing");
  } else {
    expect(problems + left.size() > 0, "an incomplete message went unreported");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in{data, size};
  if (in.u8() & 1) split_message_back(in);
  else log_of_records(in);
  return 0;
}
