// Splitting a model's named tensors into P fragments. Every process of a run (learners, mergers,
// replay) calls this with the same tensors and gets the same layout and fingerprint, so nothing
// about the layout has to travel on the wire except the fingerprint.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "core/fragments/layout.h"

namespace diloco {

// Balanced bin-packing by greedy LPT: tensors are taken largest numel first (ties: smaller name
// first) and each goes into the fragment with the fewest elements so far (ties: lowest index).
// Hence the largest fragment holds at most total/P + (largest tensor) elements. Inside a
// fragment the tensors keep the order they have in `tensors` (the model's order).
//
// The fingerprint is XXH64 over a canonical text of `architecture`, every tensor's name and shape
// in model order, and the resulting layout; any change to one of them changes it.
//
// Throws InvalidInput if num_fragments is 0 or larger than the number of tensors (a fragment would
// be empty), or if two tensors share a name.
FragmentLayout partition_tensors(std::span<const TensorSpec> tensors, uint32_t num_fragments,
                                 std::string_view architecture);

}  // namespace diloco
