// Helpers of the tests that compare fp32 tensors: seeded gaussian tensors of a layout, and
// bit-for-bit equality (a merge, a rebuild or a reconstruction must give the very same bits).
#pragma once

#include <cstring>
#include <random>
#include <vector>

#include "core/codec/messages.h"

namespace diloco::testing {

inline std::vector<DenseTensor> random_tensors(std::mt19937& rng, float scale, const std::vector<TensorSpec>& layout) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<DenseTensor> out;
  for (uint32_t t = 0; t < layout.size(); ++t) {
    DenseTensor tensor{t, layout[t].shape, std::vector<float>(static_cast<size_t>(layout[t].numel()))};
    for (auto& v : tensor.values) v = dist(rng);
    out.push_back(std::move(tensor));
  }
  return out;
}

// Same shapes, and every value's bits.
inline bool same_bits(const std::vector<DenseTensor>& a, const std::vector<DenseTensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t t = 0; t < a.size(); ++t)
    if (a[t].shape != b[t].shape || a[t].values.size() != b[t].values.size() ||
        std::memcmp(a[t].values.data(), b[t].values.data(), a[t].values.size() * sizeof(float)) != 0)
      return false;
  return true;
}

}  // namespace diloco::testing
