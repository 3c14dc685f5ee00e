// decode_chunk on one piece of a chunked message (core/codec/chunk.h), as a Kafka record holds it:
// no mode byte, no compression (pieces are plain FlatBuffers). An accepted piece must keep the
// promises decode_chunk makes, and is_chunk must agree.
#include "core/codec/chunk.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  const bool chunk = is_chunk(bytes);
  const auto piece = accepted([&] { return decode_chunk(bytes, limits()); });
  if (!piece) return 0;
  expect(chunk, "decode_chunk accepts what is_chunk says is no piece");
  expect(piece->count >= 2 && piece->count <= kMaxChunks && piece->index < piece->count, "a piece accepted with a bad index or count");
  expect(!piece->data.empty() && piece->data.size() <= piece->total_bytes, "a piece accepted with more data than its message");
  expect(piece->total_bytes <= limits().max_message_bytes, "a piece of a message above the limit accepted");
  return 0;
}
