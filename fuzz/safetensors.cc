// parse_safetensors (the reader behind load_safetensors) on a model file's bytes. An accepted
// file must hold, for every tensor, as many values as its shape says, and must survive
// save_safetensors and load_safetensors: the same tensors (by name, shape and bits) and metadata.
#include <unistd.h>

#include <filesystem>
#include <map>

#include "core/files/safetensors.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

namespace {

// Where the round trip writes: tmpfs when there is one (save_safetensors syncs the file).
const std::filesystem::path& scratch_file() {
  static const std::filesystem::path path = [] {
    const std::filesystem::path dir = std::filesystem::is_directory("/dev/shm") ? std::filesystem::path("/dev/shm")
                                                                               : std::filesystem::temp_directory_path();
    return dir / ("diloco-fuzz-safetensors-" + std::to_string(::getpid()) + ".safetensors");
  }();
  return path;
}

bool holds_its_shape(const NamedTensor& t) {
  uint64_t n = 1;
  for (const int64_t d : t.shape)
    if (d < 0 || __builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) return false;
  return n == t.values.size();
}

std::map<std::string, const NamedTensor*> by_name(const SafetensorsFile& f) {
  std::map<std::string, const NamedTensor*> out;
  for (const auto& t : f.tensors) out[t.name] = &t;
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto file = accepted([&] { return parse_safetensors({data, size}, "fuzz input"); });
  if (!file) return 0;
  for (const auto& t : file->tensors)
    if (!holds_its_shape(t)) finding("tensor '" + t.name + "' accepted with values that do not fill its shape");
  must_accept([&] { save_safetensors(scratch_file(), file->tensors, file->metadata); return 0; }, "save_safetensors");
  const auto again = must_accept([&] { return load_safetensors(scratch_file()); }, "load_safetensors");
  std::filesystem::remove(scratch_file());
  expect(again.metadata == file->metadata, "the metadata changed through save and load");
  const auto before = by_name(*file), after = by_name(again);
  expect(before.size() == file->tensors.size() && after.size() == before.size(), "tensors lost or named twice");
  for (const auto& [name, t] : before) {
    const auto it = after.find(name);
    if (it == after.end() || it->second->shape != t->shape || !same_bits(it->second->values, t->values))
      finding("tensor '" + name + "' changed through save and load");
  }
  return 0;
}
