// Tensor archives: named fp32 tensors in one libtorch archive (torch::serialize::OutputArchive,
// the container core/train/model_file.h uses too), as a Dict[str, Tensor] under one key, plus
// "info", a JSON string saying what the tensors are. Reading one back in C++:
//   torch::serialize::InputArchive a; a.load_from(path);
//   c10::IValue v; a.read("tensors", v); auto dict = v.toGenericDict();
#pragma once

#include <filesystem>
#include <span>
#include <string>

#include <nlohmann/json.hpp>

#include "core/codec/messages.h"
#include "core/fragments/layout.h"

namespace diloco {

// Writes `tensors` (layout order, named by `layout`) under `key`. Writes a temporary file and
// renames it, so a reader never sees half a file. Throws IoError when the file cannot be written.
void save_tensor_archive(const std::filesystem::path& path, const std::string& key,
                         std::span<const DenseTensor> tensors, std::span<const TensorSpec> layout,
                         const nlohmann::json& info);

}  // namespace diloco
