// The sparse wire form of a top-k INT8 or INT4 tensor (schemas/common.fbs: Codec.sparse,
// Tensor.gaps and Tensor.values). Pure functions, no I/O.
//
// A tensor of n values in blocks of block_size, at most topk of them not 0 per block, travels as
// its scales (one per block, as dense) and two byte vectors instead of the payload:
//   gaps:   for each value that is not 0, in order of position: d = position - previous position - 1
//           (the previous position of the first is -1), written as d / 255 bytes of 255 followed
//           by one byte d % 255 (below 255). So each value ends with exactly one byte below 255.
//   values: the quantized values that are not 0, in the same order: INT8 one byte each (two's
//           complement), INT4 two per byte (low nibble first; an odd count leaves the last high
//           nibble 0).
// Positions are global in the tensor, so they increase strictly across blocks too; the block of a
// value is its position / block_size. Values that quantized to 0 are not sent (0 is what the
// receiver fills in), so the form is canonical: one tensor, one encoding.
//
// Why this layout: zstd sees two homogeneous byte streams. With k of 1024 kept the gaps are
// small numbers (mean 1024 / k) that its Huffman stage codes in about log2(e * 1024 / k) bits,
// and the int4 values about 3.5 bits each.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/codec/quantize.h"

namespace diloco {

// The sparse form of a dense INT8/INT4 payload (payload_bytes(dtype, n) bytes), appended to
// `gaps` and `values` after clearing them. Throws InvalidInput when a block holds more than topk
// values that are not 0 (a tensor that was not made by top-k selection) or on sizes that do not
// fit.
void sparse_pack(DType dtype, uint32_t block_size, uint32_t topk, size_t n, std::span<const uint8_t> payload,
                 std::vector<uint8_t>& gaps, std::vector<uint8_t>& values);

// Strict checks of a sparse form, from a message: every position below n, at most topk per block,
// no gap run without its final byte, `values` exactly as long as the count needs, no value 0 and
// an odd INT4 count's padding nibble 0. Returns the number of values; throws InvalidInput naming
// the first problem. Nothing is decoded.
size_t sparse_check(DType dtype, uint32_t block_size, uint32_t topk, size_t n, std::span<const uint8_t> gaps,
                    std::span<const uint8_t> values);

// A checked sparse form back to the dense payload (payload_bytes(dtype, n) bytes): zeros, then
// each value at its position. Bit for bit the payload the sender packed.
void sparse_unpack(DType dtype, size_t n, std::span<const uint8_t> gaps, std::span<const uint8_t> values,
                   std::span<uint8_t> payload);

// A checked sparse form straight to fp32 (out.size() == n): +0 everywhere, then q * scale of its
// block at each position. The same bits as dequantize_into of the unpacked payload (a value 0
// dequantizes to 0 * scale = +0 there, scales being finite and without a sign bit once checked).
void sparse_dequantize(DType dtype, uint32_t block_size, std::span<const float> scales,
                       std::span<const uint8_t> gaps, std::span<const uint8_t> values, std::span<float> out);

}  // namespace diloco
