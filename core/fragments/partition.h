// Splitting a model's named tensors into P fragments. Every process of a run (learners, mergers,
// replay) calls this with the same tensors and gets the same layout and fingerprint, so nothing
// about the layout has to travel on the wire except the fingerprint.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "core/fragments/layout.h"

namespace diloco {

// Balanced bin-packing by greedy LPT: tensors are taken largest numel first (ties: smaller name
// first) and each goes into the fragment with the fewest elements so far (ties: lowest index).
// Hence the largest fragment holds at most total/P + (largest tensor) elements. Inside a
// fragment the tensors keep the order they have in `tensors` (the model's order).
//
// The fingerprint is XXH64 over a canonical text of every tensor's name and shape in model order
// and the resulting layout; any change to one of them changes it. Nothing else goes in: a C++
// learner of the built-in model and a Python learner of the same tensors share a run.
//
// Throws InvalidInput, naming the tensor, if num_fragments is 0 or larger than the number of
// tensors (a fragment would be empty), if two tensors share a name, or for a name that is empty or
// longer than kMaxTensorName bytes, a dimension below 1, or more than kMaxTensorDims dimensions.
FragmentLayout partition_tensors(std::span<const TensorSpec> tensors, uint32_t num_fragments);

inline constexpr size_t kMaxTensorName = 1024;
inline constexpr size_t kMaxTensorDims = 8;
inline constexpr size_t kMaxTensors = 1u << 20;
inline constexpr int64_t kMaxTensorNumel = int64_t{1} << 40;

// The first difference between two tensor lists ("tensor 'a' is [3,4] in the run, [3,5] here",
// "the run has 12 tensors, this one 11: 'head.weight' is missing here", ...), from the point of
// view of `here` joining a run of `run`; empty when they are equal.
std::string describe_difference(std::span<const TensorSpec> run, std::span<const TensorSpec> here);

// "[3,4]": how messages write a shape.
std::string shape_text(std::span<const int64_t> shape);

}  // namespace diloco
