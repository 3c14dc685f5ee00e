// Byte planes, transposed in blocks of kBlock elements. Each block is a fixed-size loop over
// local arrays, which GCC vectorizes at -O2 as well as -O3 (the -O2 cost model only vectorizes
// loops whose trip count is a known multiple of the vector width), with plain SSE2.
#include "core/codec/shuffle.h"

#include <cstring>

#include "core/errors.h"

namespace diloco {
namespace {

constexpr size_t kBlock = 64;

// out[k * n + i] = byte k of element i.
void shuffle4(const uint8_t* __restrict in, size_t n, uint8_t* __restrict out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    uint32_t w[kBlock];
    uint8_t b0[kBlock], b1[kBlock], b2[kBlock], b3[kBlock];
    std::memcpy(w, in + 4 * i, sizeof w);
    for (size_t j = 0; j < kBlock; ++j) {
      b0[j] = static_cast<uint8_t>(w[j]);
      b1[j] = static_cast<uint8_t>(w[j] >> 8);
      b2[j] = static_cast<uint8_t>(w[j] >> 16);
      b3[j] = static_cast<uint8_t>(w[j] >> 24);
    }
    std::memcpy(out + i, b0, kBlock);
    std::memcpy(out + n + i, b1, kBlock);
    std::memcpy(out + 2 * n + i, b2, kBlock);
    std::memcpy(out + 3 * n + i, b3, kBlock);
  }
  for (; i < n; ++i)
    for (size_t k = 0; k < 4; ++k) out[k * n + i] = in[4 * i + k];
}

void unshuffle4(const uint8_t* __restrict in, size_t n, uint8_t* __restrict out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const uint8_t* __restrict p0 = in + i;
    const uint8_t* __restrict p1 = in + n + i;
    const uint8_t* __restrict p2 = in + 2 * n + i;
    const uint8_t* __restrict p3 = in + 3 * n + i;
    uint8_t* __restrict o = out + 4 * i;
    for (size_t j = 0; j < kBlock; ++j) {
      o[4 * j] = p0[j];
      o[4 * j + 1] = p1[j];
      o[4 * j + 2] = p2[j];
      o[4 * j + 3] = p3[j];
    }
  }
  for (; i < n; ++i)
    for (size_t k = 0; k < 4; ++k) out[4 * i + k] = in[k * n + i];
}

void shuffle2(const uint8_t* __restrict in, size_t n, uint8_t* __restrict out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    uint16_t w[kBlock];
    uint8_t b0[kBlock], b1[kBlock];
    std::memcpy(w, in + 2 * i, sizeof w);
    for (size_t j = 0; j < kBlock; ++j) {
      b0[j] = static_cast<uint8_t>(w[j]);
      b1[j] = static_cast<uint8_t>(w[j] >> 8);
    }
    std::memcpy(out + i, b0, kBlock);
    std::memcpy(out + n + i, b1, kBlock);
  }
  for (; i < n; ++i) {
    out[i] = in[2 * i];
    out[n + i] = in[2 * i + 1];
  }
}

void unshuffle2(const uint8_t* __restrict in, size_t n, uint8_t* __restrict out) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    uint8_t b0[kBlock], b1[kBlock];
    uint16_t w[kBlock];
    std::memcpy(b0, in + i, kBlock);
    std::memcpy(b1, in + n + i, kBlock);
    for (size_t j = 0; j < kBlock; ++j) w[j] = static_cast<uint16_t>(b0[j] | b1[j] << 8);
    std::memcpy(out + 2 * i, w, sizeof w);
  }
  for (; i < n; ++i) {
    out[2 * i] = in[i];
    out[2 * i + 1] = in[n + i];
  }
}

void check_args(std::span<const uint8_t> in, std::span<uint8_t> out, size_t elem_size) {
  if (elem_size != 1 && elem_size != 2 && elem_size != 4)
    throw InvalidInput(detail::concat("byte shuffle: elem_size ", elem_size, " not in {1, 2, 4}"));
  if (in.size() != out.size())
    throw InvalidInput(detail::concat("byte shuffle: in ", in.size(), " bytes, out ", out.size()));
  // The kernels use __restrict: the spans must not overlap.
  const auto in_begin = reinterpret_cast<uintptr_t>(in.data());
  const auto out_begin = reinterpret_cast<uintptr_t>(out.data());
  DILOCO_ENFORCE(in.empty() || in_begin + in.size() <= out_begin ||
                     out_begin + out.size() <= in_begin,
                 "byte shuffle in place is not supported");
}

}  // namespace

void byte_shuffle(std::span<const uint8_t> in, std::span<uint8_t> out, size_t elem_size) {
  check_args(in, out, elem_size);
  const size_t n = in.size() / elem_size;
  const size_t body = n * elem_size;
  if (elem_size == 4) shuffle4(in.data(), n, out.data());
  else if (elem_size == 2) shuffle2(in.data(), n, out.data());
  else if (body) std::memcpy(out.data(), in.data(), body);
  if (in.size() > body) std::memcpy(out.data() + body, in.data() + body, in.size() - body);
}

void byte_unshuffle(std::span<const uint8_t> in, std::span<uint8_t> out, size_t elem_size) {
  check_args(in, out, elem_size);
  const size_t n = in.size() / elem_size;
  const size_t body = n * elem_size;
  if (elem_size == 4) unshuffle4(in.data(), n, out.data());
  else if (elem_size == 2) unshuffle2(in.data(), n, out.data());
  else if (body) std::memcpy(out.data(), in.data(), body);
  if (in.size() > body) std::memcpy(out.data() + body, in.data() + body, in.size() - body);
}

}  // namespace diloco
