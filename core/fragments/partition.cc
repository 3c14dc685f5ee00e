#include "core/fragments/partition.h"

#include <xxhash.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <string>

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
  out += " [";
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (i > 0) out += ',';
    out += std::to_string(t.shape[i]);
  }
  out += "]\n";
}

uint64_t fingerprint(std::span<const TensorSpec> tensors, const FragmentLayout& layout,
                     std::string_view architecture) {
  std::string text = "diloco fragment layout v1\narchitecture ";
  append_string(text, architecture);
  text += "\ntensors " + std::to_string(tensors.size()) + "\n";
  for (const auto& t : tensors) append_tensor(text, t);
  text += "fragments " + std::to_string(layout.fragments.size()) + "\n";
  for (size_t p = 0; p < layout.fragments.size(); ++p) {
    text += "fragment " + std::to_string(p) + "\n";
    for (const auto& t : layout.fragments[p]) append_tensor(text, t);
  }
  return XXH64(text.data(), text.size(), 0);
}

}  // namespace

FragmentLayout partition_tensors(std::span<const TensorSpec> tensors, uint32_t num_fragments,
                                 std::string_view architecture) {
  if (num_fragments == 0 || num_fragments > tensors.size())
    throw InvalidInput(detail::concat("cannot split ", tensors.size(), " tensors into ",
                                      num_fragments,
                                      " fragments: need 1 <= fragments <= number of tensors"));
  std::set<std::string_view> names;
  for (const auto& t : tensors)
    if (!names.insert(t.name).second)
      throw InvalidInput(detail::concat("tensor name '", t.name, "' appears twice in the model"));

  std::vector<size_t> by_size(tensors.size());
  std::iota(by_size.begin(), by_size.end(), size_t{0});
  std::sort(by_size.begin(), by_size.end(), [&](size_t a, size_t b) {
    if (tensors[a].numel() != tensors[b].numel()) return tensors[a].numel() > tensors[b].numel();
    return tensors[a].name < tensors[b].name;
  });

  std::vector<int64_t> load(num_fragments, 0);
  std::vector<std::vector<size_t>> members(num_fragments);
  for (size_t i : by_size) {
    // min_element returns the first minimum, i.e. the lowest fragment index among equals.
    auto p = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    load[p] += tensors[i].numel();
    members[p].push_back(i);
  }

  FragmentLayout layout;
  layout.fragments.resize(num_fragments);
  for (uint32_t p = 0; p < num_fragments; ++p) {
    std::sort(members[p].begin(), members[p].end());
    for (size_t i : members[p]) layout.fragments[p].push_back(tensors[i]);
  }
  layout.fingerprint = fingerprint(tensors, layout, architecture);
  return layout;
}

}  // namespace diloco
