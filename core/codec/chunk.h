// Chunks (schemas/chunk.fbs): a logical message larger than `codec.chunk_bytes` travels as
// pieces of at most that size, all-or-nothing. A message that fits travels as it always did, so
// small models pay nothing. The pieces are pure framing around the message's own bytes (already
// zstd-compressed); what they carry is decoded only once every piece is there and the whole
// message's size and xxh64 match (core/kafka/chunk_assembler.h puts them back together).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/codec/messages.h"

namespace diloco {

// Who numbers a message: (stream, fragment, message) names it among the pieces of one partition.
struct ChunkId {
  std::string run_id;
  std::string stream;     // learner id (deltas), merger instance (checkpoints)
  uint32_t fragment = 0;
  uint64_t message = 0;   // delta seq, checkpoint version
};

struct ChunkPiece {
  std::string stream;
  uint32_t fragment = 0;
  uint64_t message = 0;
  uint32_t index = 0;
  uint32_t count = 0;
  uint64_t total_bytes = 0;
  uint64_t checksum = 0;           // xxh64 of the whole message
  std::vector<uint8_t> data;
};

// Bytes a piece adds around its data, at most (FlatBuffer framing, run id and stream of up to
// 256 bytes each): a piece of `chunk_bytes` data needs a record limit of chunk_bytes + this.
inline constexpr uint64_t kChunkOverhead = 1024;
inline constexpr uint32_t kMaxChunks = 1u << 20;

// True when `bytes` is a piece (FlatBuffer with identifier "DCHK"); false for a whole message
// (a zstd frame) or anything else.
bool is_chunk(std::span<const uint8_t> bytes);

// `message` as it travels: itself when it fits in `chunk_bytes`, else pieces of at most
// `chunk_bytes` data each (InvalidInput for a chunk_bytes of 0 or a message needing more than
// kMaxChunks pieces).
std::vector<std::vector<uint8_t>> split_message(std::vector<uint8_t> message, const ChunkId& id, uint64_t chunk_bytes);

// How many pieces split_message makes of a message of `message_bytes` (1: the message itself).
uint64_t piece_count(uint64_t message_bytes, uint64_t chunk_bytes);

// The same pieces one at a time: piece(index, count, bytes) for each, in order, where `bytes` is
// valid only during the call (the message itself when it fits). A caller that hands each piece on
// (a producer copies it) never holds more than one piece beside the message.
void for_each_piece(std::span<const uint8_t> message, const ChunkId& id, uint64_t chunk_bytes,
                    const std::function<void(uint32_t, uint32_t, std::span<const uint8_t>)>& piece);

// Strict decoding of one piece: verifier, schema version, run id, index < count <= kMaxChunks,
// total_bytes within limits.max_message_bytes, data no longer than what is left of the message.
// Throws Rejection.
ChunkPiece decode_chunk(std::span<const uint8_t> bytes, const DecodeLimits& limits);

}  // namespace diloco
