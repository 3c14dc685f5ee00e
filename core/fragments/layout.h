// The fragment layout: which named tensors of the model (or which blocks of their rows) belong to
// which fragment, in which order. Identical in every process of a run; its fingerprint travels in every message so that a learner
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

// Where one tensor of a fragment comes from: a whole registered tensor, or a block of its rows
// (dimension 0) when the tensor is larger than a fragment should be. A row-major buffer holds a
// block's rows contiguously, so a piece is the elements [offset, offset + numel) of its tensor.
struct TensorPiece {
  uint32_t tensor = 0;    // position in FragmentLayout::tensors
  int64_t row_begin = 0;  // first row held (0 for a whole tensor)
  int64_t rows = 1;       // rows held (a 0-d tensor is one row)
  int64_t offset = 0;     // first element held: row_begin x (elements per row)
  int64_t numel = 0;      // elements held
  bool whole = true;      // the piece is the whole tensor

  bool operator==(const TensorPiece&) const = default;
};

struct FragmentLayout {
  // Every tensor of the model in the order the learner registered them.
  std::vector<TensorSpec> tensors;
  // fragments[p] lists the tensors of fragment p in wire order (Tensor.index is the position). A
  // whole tensor keeps its name and shape; a block of rows r0..r1-1 of tensor "t" is named
  // "t[r0:r1]" and has shape [r1 - r0, the tensor's other dimensions].
  std::vector<std::vector<TensorSpec>> fragments;
  // pieces[p][k]: where fragments[p][k] lies in its registered tensor.
  std::vector<std::vector<TensorPiece>> pieces;
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
