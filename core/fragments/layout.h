// The fragment layout: which named tensors of the model belong to which fragment, in which order.
// Identical in every process of a run; its fingerprint travels in every message so that a learner
// and a merger built from different models or layouts can never mix their tensors. Learners
// derive it from the tensors they register; every other process from the `tensors` list that
// checkpoints and genesis proposals carry (schemas/common.fbs ModelLayout).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace diloco {

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;

  int64_t numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
  bool operator==(const TensorSpec&) const = default;
};

struct FragmentLayout {
  // Every tensor of the model in the order the learner registered them.
  std::vector<TensorSpec> tensors;
  // fragments[p] lists the tensors of fragment p in wire order (Tensor.index is the position).
  std::vector<std::vector<TensorSpec>> fragments;
  uint64_t fingerprint = 0;

  uint32_t num_fragments() const { return static_cast<uint32_t>(fragments.size()); }
  int64_t fragment_numel(uint32_t p) const {
    int64_t n = 0;
    for (const auto& t : fragments.at(p)) n += t.numel();
    return n;
  }
  int64_t numel() const {
    int64_t n = 0;
    for (const auto& t : tensors) n += t.numel();
    return n;
  }
};

}  // namespace diloco
