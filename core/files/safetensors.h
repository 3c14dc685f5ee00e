// Model files in the safetensors format (https://huggingface.co/docs/safetensors): an 8-byte
// little-endian header length, a JSON header naming each tensor's dtype, shape and byte range,
// and the raw little-endian values. Every tool of the project writes fp32 tensors this way (the
// evaluator's final model, diloco-replay's rebuilt versions and dumped deltas), and users read
// them with `safetensors.numpy.load_file`, `safetensors.torch.load_file` or
// `decoupled_diloco.safetensors.load_file`, without the project's code or libtorch.
//
// "__metadata__" holds strings only; the project puts its facts there as JSON text under "info".
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace diloco {

struct NamedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// Writes the tensors (fp32, in the order given, in the header as in the data) atomically: a temporary file, then a rename, so a
// reader never sees half a file and a crash leaves the previous file. Throws IoError naming the
// file, InvalidInput for a name given twice or values that do not match a shape.
void save_safetensors(const std::filesystem::path& path, const std::vector<NamedTensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  std::vector<NamedTensor> tensors;  // in the order of their data in the file
  std::map<std::string, std::string> metadata;
};

// Reads every tensor. Throws InvalidInput naming the file and the problem for a missing file, a
// malformed header, a dtype other than F32 (naming the tensor), or byte ranges that do not fit.
SafetensorsFile load_safetensors(const std::filesystem::path& path);

// The same reader on a file's bytes in memory; `name` stands for the file in error messages
// ("model file NAME: ..." for load_safetensors).
SafetensorsFile parse_safetensors(std::span<const uint8_t> bytes, const std::string& name);

}  // namespace diloco
