// The model file: a trained model's parameters, its architecture and a few facts about where it
// came from, in one libtorch archive. The learner (--export) writes it, diloco-sample reads it.
//
// The archive holds three attributes: "tensors" (a Dict[str, Tensor] keyed by the names of
// Transformer::parameter_names), "options" (int64 [vocab, layers, width, heads, context]) and
// "info" (a JSON string: run id, fragment versions, held-out loss, ...), read with
// torch::serialize::InputArchive (load_model_file below does).
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/model/transformer.h"

namespace diloco {

// Writes `archive` to `path` atomically (a temporary file, then rename): a reader never sees half
// a file, and a crash leaves the previous file in place. Throws IoError naming the file.
void save_archive(torch::serialize::OutputArchive& archive, const std::filesystem::path& path);

// Writes atomically, as save_archive.
void save_model_file(const std::filesystem::path& path, const Transformer& model, const nlohmann::json& info);

struct LoadedModel {
  Transformer model;
  nlohmann::json info;
};

// Throws InvalidInput naming the file for a missing, unreadable or inconsistent archive.
LoadedModel load_model_file(const std::filesystem::path& path);

}  // namespace diloco
