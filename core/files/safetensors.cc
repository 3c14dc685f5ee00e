#include "core/files/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <fstream>
#include <functional>
#include <set>

#include <nlohmann/json.hpp>

#include "core/errors.h"

namespace diloco {

static_assert(std::endian::native == std::endian::little, "safetensors values are little endian");

namespace {

// Far above any real header; a hostile file cannot make the reader allocate gigabytes for it.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

// Saturates instead of overflowing (a hostile header's shape).
int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d != 0 && n > (int64_t{1} << 62) / d) return int64_t{1} << 62;
    n *= d;
  }
  return n;
}

}  // namespace

void save_safetensors(const std::filesystem::path& path, const std::vector<NamedTensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // In the order given (ordered_json): readers that keep header order see the model's order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    if (!names.insert(t.name).second) throw InvalidInput("safetensors: tensor '" + t.name + "' given twice");
    if (static_cast<int64_t>(t.values.size()) != numel(t.shape))
      throw InvalidInput(detail::concat("safetensors: tensor '", t.name, "' has ", t.values.size(),
                                        " values for its shape"));
    const uint64_t bytes = t.values.size() * sizeof(float);
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  try {
    if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw IoError("cannot open for writing");
    const uint64_t length = text.size();
    out.write(reinterpret_cast<const char*>(&length), sizeof(length));
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& t : tensors)
      out.write(reinterpret_cast<const char*>(t.values.data()), static_cast<std::streamsize>(t.values.size() * 4));
    out.close();
    if (!out) throw IoError("write failed (disk full?)");
    // On disk before the rename makes it the file: a power loss leaves the old file or the new one.
    const int fd = ::open(tmp.c_str(), O_RDONLY);
    if (fd < 0 || ::fsync(fd) != 0) {
      if (fd >= 0) ::close(fd);
      throw IoError("fsync failed");
    }
    ::close(fd);
    std::filesystem::rename(tmp, path);
  } catch (const std::exception& e) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw IoError("cannot write " + path.string() + ": " + e.what());
  }
}

namespace {

// Reads n bytes at `offset` of the file or buffer into `out`; false when they are not all there.
using ReadAt = std::function<bool(uint64_t offset, void* out, uint64_t n)>;

// The reader of both entry points: `size` bytes reached through `read_at`, `what` naming them in
// every error ("model file PATH").
SafetensorsFile read_safetensors(uint64_t size, const ReadAt& read_at, const std::string& what) {
  auto fail = [&](const std::string& why) { return InvalidInput(what + ": " + why); };
  uint64_t length = 0;
  if (size < 8 || !read_at(0, &length, 8))
    throw fail("not a safetensors file (shorter than its 8-byte header length)");
  if (length > kMaxHeaderBytes || length > size - 8)
    throw fail(detail::concat("not a safetensors file (a header of ", length, " bytes in a file of ", size, ")"));
  std::string text(length, '\0');
  if (!read_at(8, text.data(), length)) throw fail("the file ends inside its header");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw fail(std::string("not a safetensors file (its header is not JSON: ") + e.what() + ")");
  }
  if (!header.is_object()) throw fail("not a safetensors file (its header is not a JSON object)");
  const uint64_t data_bytes = size - 8 - length;
  SafetensorsFile out;
  struct Entry {
    uint64_t begin = 0, end = 0;
    NamedTensor tensor;
  };
  std::vector<Entry> entries;
  try {
    for (const auto& [name, value] : header.items()) {
      if (name == "__metadata__") {
        for (const auto& [key, text_value] : value.items()) out.metadata[key] = text_value.get<std::string>();
        continue;
      }
      const std::string dtype = value.at("dtype").get<std::string>();
      if (dtype != "F32")
        throw fail("tensor '" + name + "' is " + dtype + "; the project reads F32 tensors only");
      Entry e;
      e.tensor.name = name;
      // Whole numbers only: 2.5 or 1e30 would be truncated, or overflow the conversion.
      const auto& shape = value.at("shape");
      const auto& offsets = value.at("data_offsets");
      if (!shape.is_array() || !std::all_of(shape.begin(), shape.end(), [](const auto& d) { return d.is_number_integer(); }))
        throw fail("tensor '" + name + "': its shape is not a list of whole numbers");
      if (!offsets.is_array() || !std::all_of(offsets.begin(), offsets.end(), [](const auto& o) { return o.is_number_unsigned(); }))
        throw fail("tensor '" + name + "': bad data_offsets (not a list of whole numbers)");
      e.tensor.shape = shape.get<std::vector<int64_t>>();
      const auto range = offsets.get<std::vector<uint64_t>>();
      if (range.size() != 2 || range[0] > range[1] || range[1] > data_bytes) throw fail("tensor '" + name + "': bad data_offsets");
      for (int64_t d : e.tensor.shape)
        if (d < 0) throw fail("tensor '" + name + "': a negative dimension");
      // numel saturates at 2^62, which no byte range of the file reaches (times 4 it would wrap).
      if ((range[1] - range[0]) % 4 != 0 || (range[1] - range[0]) / 4 != static_cast<uint64_t>(numel(e.tensor.shape)))
        throw fail("tensor '" + name + "': its byte range does not hold its shape");
      e.begin = range[0];
      e.end = range[1];
      entries.push_back(std::move(e));
    }
  } catch (const nlohmann::json::exception& e) {
    throw fail(std::string("malformed header: ") + e.what());
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  for (auto& e : entries) {
    e.tensor.values.resize((e.end - e.begin) / 4);
    if (!read_at(8 + length + e.begin, e.tensor.values.data(), e.end - e.begin))
      throw fail("tensor '" + e.tensor.name + "': the file ends inside its data");
    out.tensors.push_back(std::move(e.tensor));
  }
  return out;
}

}  // namespace

SafetensorsFile load_safetensors(const std::filesystem::path& path) {
  const std::string what = "model file " + path.string();
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidInput(what + ": no such file, or it cannot be read");
  in.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(in.tellg());
  return read_safetensors(size, [&](uint64_t offset, void* out, uint64_t n) {
    in.seekg(static_cast<std::streamoff>(offset));
    return static_cast<bool>(in.read(static_cast<char*>(out), static_cast<std::streamsize>(n)));
  }, what);
}

SafetensorsFile parse_safetensors(std::span<const uint8_t> bytes, const std::string& name) {
  return read_safetensors(bytes.size(), [&](uint64_t offset, void* out, uint64_t n) {
    if (offset > bytes.size() || n > bytes.size() - offset) return false;
    if (n != 0) std::memcpy(out, bytes.data() + offset, n);
    return true;
  }, name);
}

}  // namespace diloco
