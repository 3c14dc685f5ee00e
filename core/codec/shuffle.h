// Byte-shuffle: store element bytes as planes (every element's byte 0, then every byte 1, ...).
// Float payloads compress far better this way because exponent bytes cluster.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace diloco {

// out.size() == in.size(); elem_size in {1, 2, 4}; in.size() need not be a multiple of
// elem_size (trailing bytes are copied as they are). elem_size 1 is a plain copy.
void byte_shuffle(std::span<const uint8_t> in, std::span<uint8_t> out, size_t elem_size);
void byte_unshuffle(std::span<const uint8_t> in, std::span<uint8_t> out, size_t elem_size);

}  // namespace diloco
