// Splitting a model's named tensors into P fragments. Every process of a run (learners, mergers,
// replay) calls this with the same tensors and gets the same layout and fingerprint, so nothing
// about the layout has to travel on the wire except the fingerprint.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "core/fragments/layout.h"

namespace diloco {

// Balanced bin-packing by greedy LPT: pieces are taken largest numel first (ties: smaller name
// first) and each goes into the fragment with the fewest elements so far (ties: lowest index).
// The pieces are the model's tensors whole, unless cutting gives a smaller largest fragment or
// whole tensors are fewer than P: then every tensor larger than the mean fragment
// (ceil(total / P) elements) is cut into k = ceil(numel / mean) blocks of consecutive rows
// (dimension 0; at most one block per row, the first rows % k blocks one row longer), and, when
// that still makes fewer than P pieces, at the mean rounded down. Hence the largest fragment
// holds at most total/P + (largest piece) elements, a model whose tensors are all at most the
// mean is laid out whole, and a tensor of any size spreads over as many fragments as it needs.
// Inside a fragment the pieces keep the model's order (tensor, then row). A block of rows
// r0..r1-1 of "t" is named "t[r0:r1]" and has shape [r1 - r0, t's other dimensions] (piece_spec).
// Work: O(n log n + n log P) for n pieces (at most about 2P + the number of tensors), so a layout
// a message carries (up to kMaxTensors tensors, kMaxFragments fragments) is rebuilt in moments.
//
// The fingerprint is XXH64 over a canonical text of every tensor's name and shape in model order
// and the resulting layout (each piece by its name and shape); any change to one of them changes
// it. Nothing else goes in: a C++ learner of the built-in model and a Python learner of the same
// tensors share a run.
//
// Throws InvalidInput, naming the tensor, if num_fragments is 0 or above kMaxFragments, if the
// tensors cannot make num_fragments pieces (a fragment would be empty), if two tensors share a
// name (or a block's name is the name of another tensor), or for a name that is empty or longer
// than kMaxTensorName bytes, a dimension below 1, or more than kMaxTensorDims dimensions.
FragmentLayout partition_tensors(std::span<const TensorSpec> tensors, uint32_t num_fragments);

// The name and shape of a piece of `tensor` as its fragment lists it.
TensorSpec piece_spec(const TensorSpec& tensor, const TensorPiece& piece);

inline constexpr uint32_t kMaxFragments = 1u << 16;
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
