#include "core/fragments/partition.h"

#include <xxhash.h>

#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <utility>

#include "core/errors.h"

namespace diloco {
namespace {

// Strings are length-prefixed so that no choice of names can make two different inputs produce
// the same text.
void append_string(std::string& out, std::string_view s) {
  out += std::to_string(s.size());
  out += ':';
  out += s;
}

void append_tensor(std::string& out, const TensorSpec& t) {
  append_string(out, t.name);
  out += " " + shape_text(t.shape) + "\n";
}

uint64_t fingerprint(std::span<const TensorSpec> tensors, const FragmentLayout& layout) {
  std::string text = "diloco fragment layout v2\n";
  text += "tensors " + std::to_string(tensors.size()) + "\n";
  for (const auto& t : tensors) append_tensor(text, t);
  text += "fragments " + std::to_string(layout.fragments.size()) + "\n";
  for (size_t p = 0; p < layout.fragments.size(); ++p) {
    text += "fragment " + std::to_string(p) + "\n";
    for (const auto& t : layout.fragments[p]) append_tensor(text, t);
  }
  return XXH64(text.data(), text.size(), 0);
}


// Rows of a tensor: its first dimension; a 0-d tensor is one row of one value.
int64_t rows_of(const TensorSpec& t) { return t.shape.empty() ? 1 : t.shape[0]; }

// Every tensor whole, except those above `target` elements with more than one row: those become
// k = ceil(numel / target) blocks (at most one per row) of consecutive rows, the first rows % k
// blocks one row longer. In model order: by tensor, then by row.
std::vector<TensorPiece> row_blocks(std::span<const TensorSpec> tensors, int64_t target) {
  std::vector<TensorPiece> out;
  for (uint32_t i = 0; i < tensors.size(); ++i) {
    const int64_t numel = tensors[i].numel(), rows = rows_of(tensors[i]);
    const int64_t k = numel > target ? std::min(rows, (numel + target - 1) / target) : 1;
    if (k <= 1) {
      out.push_back(TensorPiece{.tensor = i, .row_begin = 0, .rows = rows, .offset = 0, .numel = numel, .whole = true});
      continue;
    }
    const int64_t per_row = numel / rows;
    int64_t row = 0;
    for (int64_t b = 0; b < k; ++b) {
      const int64_t n = rows / k + (b < rows % k ? 1 : 0);
      out.push_back(TensorPiece{.tensor = i, .row_begin = row, .rows = n, .offset = row * per_row,
                                .numel = n * per_row, .whole = false});
      row += n;
    }
  }
  return out;
}

// Greedy LPT of pieces into fragments: largest first (ties: smaller name first), each into the
// fragment with the fewest elements so far (ties: lowest index). members[p] lists positions in
// `pieces` in model order.
struct Packing {
  std::vector<TensorPiece> pieces;
  std::vector<TensorSpec> specs;
  std::vector<std::vector<size_t>> members;
  int64_t largest = 0;  // elements of the largest fragment
};

Packing pack(std::span<const TensorSpec> tensors, std::vector<TensorPiece> pieces, uint32_t num_fragments) {
  Packing out;
  out.specs.reserve(pieces.size());
  for (const auto& piece : pieces) out.specs.push_back(piece_spec(tensors[piece.tensor], piece));
  std::vector<size_t> by_size(pieces.size());
  std::iota(by_size.begin(), by_size.end(), size_t{0});
  std::sort(by_size.begin(), by_size.end(), [&](size_t a, size_t b) {
    if (pieces[a].numel != pieces[b].numel) return pieces[a].numel > pieces[b].numel;
    return out.specs[a].name < out.specs[b].name;
  });
  // The lightest fragment on top of a min-heap of (elements, index): among equals the lowest
  // index, as a scan for the first minimum would choose, in O(log P) per piece rather than O(P)
  // (a layout a message carries may list up to kMaxTensors tensors over kMaxFragments fragments).
  using Load = std::pair<int64_t, uint32_t>;
  std::vector<Load> heap(num_fragments);
  for (uint32_t p = 0; p < num_fragments; ++p) heap[p] = {0, p};  // sorted, hence a heap already
  out.members.resize(num_fragments);
  for (size_t i : by_size) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
    heap.back().first += pieces[i].numel;
    out.members[heap.back().second].push_back(i);
    std::push_heap(heap.begin(), heap.end(), std::greater<>{});
  }
  // Pieces are made in model order (tensor, then rows), so their index order is the model's.
  for (auto& m : out.members) std::sort(m.begin(), m.end());
  for (const auto& [elements, p] : heap) out.largest = std::max(out.largest, elements);
  out.pieces = std::move(pieces);
  return out;
}

}  // namespace

TensorSpec piece_spec(const TensorSpec& tensor, const TensorPiece& piece) {
  if (piece.whole) return tensor;
  // Appends rather than a stream: a layout may have tens of thousands of pieces.
  TensorSpec out{tensor.name + "[" + std::to_string(piece.row_begin) + ":" +
                     std::to_string(piece.row_begin + piece.rows) + "]",
                 tensor.shape};
  out.shape.at(0) = piece.rows;
  return out;
}

std::string shape_text(std::span<const int64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ',';
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

std::string describe_difference(std::span<const TensorSpec> run, std::span<const TensorSpec> here) {
  std::map<std::string_view, const TensorSpec*> theirs, ours;
  for (const auto& t : run) theirs[t.name] = &t;
  for (const auto& t : here) ours[t.name] = &t;
  for (const auto& t : run) {
    auto it = ours.find(t.name);
    if (it == ours.end())
      return detail::concat("tensor '", t.name, "' ", shape_text(t.shape), " of the run is missing here (",
                            run.size(), " tensors in the run, ", here.size(), " here)");
    if (it->second->shape != t.shape)
      return detail::concat("tensor '", t.name, "' is ", shape_text(t.shape), " in the run, ",
                            shape_text(it->second->shape), " here");
  }
  for (const auto& t : here)
    if (!theirs.count(t.name))
      return detail::concat("tensor '", t.name, "' ", shape_text(t.shape), " is not in the run (", run.size(),
                            " tensors in the run, ", here.size(), " here)");
  for (size_t i = 0; i < run.size() && i < here.size(); ++i)
    if (run[i].name != here[i].name)
      return detail::concat("the tensors are registered in another order: position ", i, " is '", run[i].name,
                            "' in the run, '", here[i].name, "' here");
  return {};
}

FragmentLayout partition_tensors(std::span<const TensorSpec> tensors, uint32_t num_fragments) {
  if (tensors.size() > kMaxTensors)
    throw InvalidInput(detail::concat(tensors.size(), " tensors: at most ", kMaxTensors, " can be registered"));
  if (tensors.empty()) throw InvalidInput("the model has no tensors: register at least one");
  if (num_fragments == 0 || num_fragments > kMaxFragments)
    throw InvalidInput(detail::concat("cannot split the model into ", num_fragments,
                                      " fragments: need 1 <= diloco.fragments <= ", kMaxFragments));
  std::set<std::string_view> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    // An empty name cannot name its tensor: its position in the registered list does.
    if (t.name.empty() || t.name.size() > kMaxTensorName)
      throw InvalidInput(detail::concat("tensor ", i, " of ", tensors.size(), ": a tensor name must have 1 to ",
                                        kMaxTensorName, " bytes, not ", t.name.size(),
                                        t.name.empty() ? "" : " ('" + t.name.substr(0, 64) + "...')"));
    if (!names.insert(t.name).second)
      throw InvalidInput(detail::concat("tensor name '", t.name, "' appears twice in the model"));
    if (t.shape.size() > kMaxTensorDims)
      throw InvalidInput(detail::concat("tensor '", t.name, "' has ", t.shape.size(), " dimensions, at most ",
                                        kMaxTensorDims, " are supported"));
    int64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 1)
        throw InvalidInput(detail::concat("tensor '", t.name, "' has shape ", shape_text(t.shape),
                                          ": every dimension must be at least 1"));
      if (numel > kMaxTensorNumel / d)
        throw InvalidInput(detail::concat("tensor '", t.name, "' has shape ", shape_text(t.shape), ": more than ",
                                          kMaxTensorNumel, " values"));
      numel *= d;
    }
  }

  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();

  // Whole tensors, unless cutting the tensors above the mean fragment into blocks of rows makes
  // the largest fragment smaller (or whole tensors are too few to fill every fragment).
  Packing packing = pack(tensors, row_blocks(tensors, total + 1), num_fragments);
  Packing cut = pack(tensors, row_blocks(tensors, (total + num_fragments - 1) / num_fragments), num_fragments);
  if (cut.pieces.size() < num_fragments)  // too few pieces: cut at the mean rounded down
    cut = pack(tensors, row_blocks(tensors, std::max<int64_t>(1, total / num_fragments)), num_fragments);
  if (packing.pieces.size() < num_fragments || cut.largest < packing.largest) packing = std::move(cut);
  if (packing.pieces.size() < num_fragments)
    throw InvalidInput(detail::concat("cannot split ", tensors.size(), " tensors into ", num_fragments,
                                      " fragments: even cut into blocks of rows they make only ", packing.pieces.size(),
                                      " pieces; lower diloco.fragments"));
  const auto& pieces = packing.pieces;
  const auto& specs = packing.specs;
  const auto& members = packing.members;
  for (size_t k = 0; k < pieces.size(); ++k)
    if (!pieces[k].whole && names.count(specs[k].name))
      throw InvalidInput(detail::concat("tensor '", tensors[pieces[k].tensor].name, "' is cut into blocks of rows, and '",
                                        specs[k].name, "', the name of one of them, is also a tensor of the model: rename it"));

  FragmentLayout layout;
  layout.tensors.assign(tensors.begin(), tensors.end());
  layout.fragments.resize(num_fragments);
  layout.pieces.resize(num_fragments);
  for (uint32_t p = 0; p < num_fragments; ++p) {
    for (size_t i : members[p]) {
      layout.fragments[p].push_back(specs[i]);
      layout.pieces[p].push_back(pieces[i]);
    }
  }
  layout.fingerprint = fingerprint(tensors, layout);
  return layout;
}

}  // namespace diloco
