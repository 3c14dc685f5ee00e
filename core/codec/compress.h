// zstd framing of whole messages. Decompression is bounded: the frame must declare its content
// size and that size must be within the caller's limit before a single byte is decompressed.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace diloco {

// One frame with its content size and a content checksum (so a flipped bit is a rejection).
std::vector<uint8_t> zstd_compress(std::span<const uint8_t> in, int level);

// Throws Rejection (see reject.h): NotZstd, SizeUnknown, DecompressedTooLarge, CorruptFrame.
std::vector<uint8_t> zstd_decompress_bounded(std::span<const uint8_t> in, uint64_t max_bytes);
// Same, into `out` (resized to the content size), so a reader can reuse one buffer per thread.
void zstd_decompress_bounded_into(std::span<const uint8_t> in, uint64_t max_bytes,
                                  std::vector<uint8_t>& out);

}  // namespace diloco
