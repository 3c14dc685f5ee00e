#include "core/fragments/partition.h"

#include <xxhash.h>

#include <algorithm>
#include <map>
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

}  // namespace

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
  if (num_fragments == 0 || num_fragments > tensors.size())
    throw InvalidInput(detail::concat("cannot split ", tensors.size(), " tensors into ",
                                      num_fragments,
                                      " fragments: need 1 <= diloco.fragments <= number of tensors"));
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
  layout.tensors.assign(tensors.begin(), tensors.end());
  layout.fragments.resize(num_fragments);
  for (uint32_t p = 0; p < num_fragments; ++p) {
    std::sort(members[p].begin(), members[p].end());
    for (size_t i : members[p]) layout.fragments[p].push_back(tensors[i]);
  }
  layout.fingerprint = fingerprint(tensors, layout);
  return layout;
}

}  // namespace diloco
