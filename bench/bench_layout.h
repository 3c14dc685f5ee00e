// The layout the bench tools fake a run of: the built-in model of the config (the tensor list
// only, nothing allocated), or, with --tensors, a list of tensors of the user's shapes, laid out
// over diloco.fragments as a learner registering them would (tensors larger than a fragment
// cut into blocks of rows).
//
//   --tensors "embed=128256x4096,final_norm=4096"
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "core/config/run_config.h"
#include "core/errors.h"
#include "core/fragments/partition.h"
#include "core/model/builtin_specs.h"

namespace diloco::bench {

inline std::vector<TensorSpec> parse_tensors(const std::string& text) {
  std::vector<TensorSpec> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, end - start);
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size())
      throw InvalidInput("--tensors: '" + item + "' is not NAME=D0xD1x... (e.g. embed=128256x4096)");
    TensorSpec spec{item.substr(0, eq), {}};
    size_t d = eq + 1;
    while (d <= item.size()) {
      const size_t x = std::min(item.find('x', d), item.size());
      const std::string dim = item.substr(d, x - d);
      if (dim.empty() || dim.find_first_not_of("0123456789") != std::string::npos || dim.size() > 12 ||
          dim.find_first_not_of('0') == std::string::npos)
        throw InvalidInput("--tensors: '" + item + "': dimension '" + dim + "' is not a positive integer");
      spec.shape.push_back(std::stoll(dim));
      d = x + 1;
    }
    out.push_back(std::move(spec));
    start = end + 1;
  }
  return out;
}

inline FragmentLayout bench_layout(const RunConfig& config, const std::string& tensors) {
  if (tensors.empty()) return builtin_layout(config);
  return partition_tensors(parse_tensors(tensors), config.diloco.fragments);
}

// The fragments a bench process takes part in: --only "0,3" (a model too large for the machine,
// of which only these fragments travel), each once, or every fragment of the layout when empty.
inline std::vector<uint32_t> bench_fragments(const FragmentLayout& layout, const std::string& only) {
  std::vector<uint32_t> out;
  if (only.empty()) {
    for (uint32_t p = 0; p < layout.num_fragments(); ++p) out.push_back(p);
    return out;
  }
  size_t start = 0;
  while (start <= only.size()) {
    const size_t end = std::min(only.find(',', start), only.size());
    const std::string item = only.substr(start, end - start);
    if (item.empty() || item.size() > 9 || item.find_first_not_of("0123456789") != std::string::npos ||
        std::stoul(item) >= layout.num_fragments())
      throw InvalidInput("--only: '" + item + "' is not a fragment of the layout (0 to " +
                         std::to_string(layout.num_fragments() - 1) + ")");
    const auto p = static_cast<uint32_t>(std::stoul(item));
    if (std::find(out.begin(), out.end(), p) != out.end())
      throw InvalidInput("--only: fragment " + item + " is listed twice");
    out.push_back(p);
    start = end + 1;
  }
  return out;
}

}  // namespace diloco::bench
