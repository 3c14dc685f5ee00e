// The model file of the built-in model: its parameters by name in a safetensors file
// (core/files/safetensors.h), with two metadata entries: "model", the architecture as JSON
// ({"vocab", "layers", "width", "heads", "context"}), and "info", JSON facts about where it came
// from (run id, fragment versions, held-out loss, ...). The evaluator (--export) and
// diloco-replay rebuild write it, diloco-sample reads it; any safetensors reader opens it.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/model/transformer.h"

namespace diloco {

// Writes atomically (a temporary file, then a rename). Throws IoError naming the file.
void save_model_file(const std::filesystem::path& path, const Transformer& model, const nlohmann::json& info);

struct LoadedModel {
  Transformer model;
  nlohmann::json info;
};

// Throws InvalidInput naming the file for a missing, unreadable or inconsistent file. A file
// without the "model" entry (diloco-replay rebuild of a run it had no model options for) takes
// the architecture from `fallback` when given.
LoadedModel load_model_file(const std::filesystem::path& path, const ModelOptions* fallback = nullptr);

// The "model" metadata entry of a built-in model's options.
nlohmann::json model_options_json(const ModelOptions& options);

}  // namespace diloco
