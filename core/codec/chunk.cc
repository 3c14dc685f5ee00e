#include "core/codec/chunk.h"

#include <xxhash.h>

#include <algorithm>

#include "core/codec/tensor_wire.h"
#include "schemas/chunk_generated.h"

namespace diloco {

using namespace tensor_wire;

bool is_chunk(std::span<const uint8_t> bytes) {
  return bytes.size() >= 8 && flatbuffers::BufferHasIdentifier(bytes.data(), wire::ChunkIdentifier());
}

uint64_t piece_count(uint64_t message_bytes, uint64_t chunk_bytes) {
  if (chunk_bytes == 0) throw InvalidInput("chunk_bytes must be positive");
  return message_bytes <= chunk_bytes ? 1 : (message_bytes + chunk_bytes - 1) / chunk_bytes;
}

void for_each_piece(std::span<const uint8_t> message, const ChunkId& id, uint64_t chunk_bytes,
                    const std::function<void(uint32_t, uint32_t, std::span<const uint8_t>)>& piece) {
  const uint64_t count = piece_count(message.size(), chunk_bytes);
  if (count == 1) return piece(0, 1, message);
  if (count > kMaxChunks)
    throw InvalidInput("a message of " + std::to_string(message.size()) + " bytes needs " + std::to_string(count) +
                       " chunks of " + std::to_string(chunk_bytes) + " bytes, more than " +
                       std::to_string(kMaxChunks) + ": raise codec.chunk_bytes");
  const uint64_t checksum = XXH64(message.data(), message.size(), 0);
  flatbuffers::FlatBufferBuilder fbb(std::min<uint64_t>(chunk_bytes, message.size()) + 512);
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t begin = i * chunk_bytes;
    const uint64_t size = std::min<uint64_t>(chunk_bytes, message.size() - begin);
    fbb.Clear();
    const auto run_id = fbb.CreateString(id.run_id);
    const auto stream = fbb.CreateString(id.stream);
    const auto data = fbb.CreateVector(message.data() + begin, size);
    const auto root = wire::CreateChunk(fbb, kSchemaVersion, run_id, stream, id.fragment, id.message,
                                        static_cast<uint32_t>(i), static_cast<uint32_t>(count), message.size(),
                                        checksum, data);
    wire::FinishChunkBuffer(fbb, root);
    piece(static_cast<uint32_t>(i), static_cast<uint32_t>(count), {fbb.GetBufferPointer(), fbb.GetSize()});
  }
}

std::vector<std::vector<uint8_t>> split_message(std::vector<uint8_t> message, const ChunkId& id, uint64_t chunk_bytes) {
  std::vector<std::vector<uint8_t>> out;
  if (chunk_bytes > 0 && message.size() <= chunk_bytes) {
    out.push_back(std::move(message));
    return out;
  }
  for_each_piece(message, id, chunk_bytes, [&](uint32_t, uint32_t count, std::span<const uint8_t> bytes) {
    if (out.empty()) out.reserve(count);
    out.emplace_back(bytes.begin(), bytes.end());
  });
  return out;
}

ChunkPiece decode_chunk(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  if (bytes.size() > limits.max_message_bytes + kChunkOverhead)
    reject(RejectReason::TooLarge, "chunk of " + std::to_string(bytes.size()) + " bytes, limit " +
                                       std::to_string(limits.max_message_bytes));
  flatbuffers::Verifier verifier(bytes.data(), bytes.size());
  if (!is_chunk(bytes) || !wire::VerifyChunkBuffer(verifier)) reject(RejectReason::BadFlatbuffer, "not a valid Chunk");
  const wire::Chunk& c = *wire::GetChunk(bytes.data());
  check_schema_version(c.schema_version(), "Chunk");
  check_run_id(c.run_id(), limits);
  ChunkPiece piece;
  piece.stream = required(c.stream(), "stream");
  piece.fragment = c.fragment();
  piece.message = c.message();
  piece.index = c.index();
  piece.count = c.count();
  piece.total_bytes = c.total_bytes();
  piece.checksum = c.checksum();
  if (piece.count < 2 || piece.count > kMaxChunks)
    reject(RejectReason::BadCounter, "chunk count " + std::to_string(piece.count) + " (2 to " +
                                         std::to_string(kMaxChunks) + ")");
  if (piece.index >= piece.count)
    reject(RejectReason::BadCounter, "chunk index " + std::to_string(piece.index) + " of " + std::to_string(piece.count));
  if (piece.total_bytes > limits.max_message_bytes)
    reject(RejectReason::TooLarge, "chunked message of " + std::to_string(piece.total_bytes) + " bytes, limit " +
                                       std::to_string(limits.max_message_bytes));
  const auto* data = c.data();
  if (!data || data->size() == 0) reject(RejectReason::MissingField, "chunk without data");
  if (data->size() > piece.total_bytes)
    reject(RejectReason::BadCounter, "chunk data of " + std::to_string(data->size()) + " bytes in a message of " +
                                         std::to_string(piece.total_bytes));
  piece.data.assign(data->begin(), data->end());
  return piece;
}

}  // namespace diloco
