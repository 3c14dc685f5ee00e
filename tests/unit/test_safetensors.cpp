// Model files in the safetensors format (core/files/safetensors.h): what the project writes is
// the format's layout read back by hand (an 8-byte little-endian header length, a JSON header,
// 8-byte aligned raw values), a file another writer made is read, the write is atomic, and a
// file that is not fp32 or not whole is refused with a message naming the file and the tensor.
#include <catch2/catch.hpp>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "core/files/safetensors.h"
#include "tests/temp_dir.h"

using namespace diloco;
using Catch::Matchers::Contains;

namespace {

struct TempDir : test::TempDir {
  TempDir() : test::TempDir("diloco-safetensors") {}
};

std::string read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file as another writer makes it: the header in its own order, then the values.
std::string file_of(const nlohmann::json& header, const std::string& data) {
  const std::string text = header.dump();
  std::string out(8, '\0');
  const uint64_t length = text.size();
  std::memcpy(out.data(), &length, 8);  // little endian (the project builds for little-endian hosts)
  return out + text + data;
}

std::string bytes_of(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

std::string refusal(const std::filesystem::path& path) {
  try {
    (void)load_safetensors(path);
  } catch (const InvalidInput& e) {
    return e.what();
  }
  return "accepted";
}

const std::vector<NamedTensor> kTensors = {
    {"blocks.0.attn.qkv.weight", {2, 3}, {1, -2, 3.5f, 0, 1e-30f, -7}},
    {"scale", {}, {0.25f}},
    {"head.bias", {3}, {9, 8, 7}},
};

}  // namespace

TEST_CASE("save_safetensors writes the format's layout: header length, JSON header, aligned values", "[safetensors]") {
  TempDir dir;
  const auto path = dir.path / "model.safetensors";
  save_safetensors(path, kTensors, {{"info", "{\"run\":\"r\"}"}});
  const std::string file = read_bytes(path);
  REQUIRE(file.size() >= 8);
  uint64_t length = 0;
  std::memcpy(&length, file.data(), 8);
  CHECK((8 + length) % 8 == 0);  // the values start 8-byte aligned
  const auto header = nlohmann::json::parse(file.substr(8, length));
  CHECK(header["__metadata__"]["info"] == "{\"run\":\"r\"}");
  const std::string data = file.substr(8 + length);
  CHECK(data.size() == (6 + 1 + 3) * sizeof(float));
  uint64_t offset = 0;
  for (const auto& t : kTensors) {
    INFO(t.name);
    const auto& entry = header.at(t.name);
    CHECK(entry["dtype"] == "F32");
    CHECK(entry["shape"].get<std::vector<int64_t>>() == t.shape);
    const auto range = entry["data_offsets"].get<std::vector<uint64_t>>();
    CHECK(range == std::vector<uint64_t>{offset, offset + t.values.size() * 4});  // in the order given
    CHECK(data.substr(range[0], range[1] - range[0]) == bytes_of(t.values));
    offset += t.values.size() * 4;
  }
}

TEST_CASE("load_safetensors reads back what save_safetensors wrote", "[safetensors]") {
  TempDir dir;
  const auto path = dir.path / "nested" / "model.safetensors";  // folders are created
  save_safetensors(path, kTensors, {{"model", "{}"}, {"info", "x"}});
  const SafetensorsFile got = load_safetensors(path);
  REQUIRE(got.tensors.size() == kTensors.size());
  for (size_t i = 0; i < kTensors.size(); ++i) {
    CHECK(got.tensors[i].name == kTensors[i].name);
    CHECK(got.tensors[i].shape == kTensors[i].shape);
    CHECK(got.tensors[i].values == kTensors[i].values);
  }
  CHECK(got.metadata == std::map<std::string, std::string>{{"model", "{}"}, {"info", "x"}});
}

TEST_CASE("load_safetensors reads another writer's file, tensors in the order of their data", "[safetensors]") {
  TempDir dir;
  const auto path = dir.path / "theirs.safetensors";
  // Header keys sorted by name, data in another order; no metadata.
  nlohmann::json header = {{"a", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {12, 20}}}},
                           {"b", {{"dtype", "F32"}, {"shape", {1, 3}}, {"data_offsets", {0, 12}}}}};
  write_bytes(path, file_of(header, bytes_of({4, 5, 6}) + bytes_of({1, 2})));
  const SafetensorsFile got = load_safetensors(path);
  REQUIRE(got.tensors.size() == 2);
  CHECK(got.tensors[0].name == "b");
  CHECK(got.tensors[0].shape == std::vector<int64_t>{1, 3});
  CHECK(got.tensors[0].values == std::vector<float>{4, 5, 6});
  CHECK(got.tensors[1].name == "a");
  CHECK(got.tensors[1].values == std::vector<float>{1, 2});
  CHECK(got.metadata.empty());
}

TEST_CASE("a tensor that is not F32 is refused, naming the tensor and its dtype", "[safetensors]") {
  TempDir dir;
  const auto path = dir.path / "half.safetensors";
  nlohmann::json header = {{"w", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4}}}},
                           {"emb", {{"dtype", "F16"}, {"shape", {2}}, {"data_offsets", {4, 8}}}}};
  write_bytes(path, file_of(header, bytes_of({1}) + std::string(4, '\0')));
  CHECK_THAT(refusal(path), Contains(path.string()) && Contains("tensor 'emb' is F16"));
}

TEST_CASE("a truncated or malformed file is refused with the file's name, never read past its end", "[safetensors]") {
  TempDir dir;
  const auto whole = dir.path / "whole.safetensors";
  save_safetensors(whole, kTensors);
  const std::string bytes = read_bytes(whole);
  const auto cut = dir.path / "cut.safetensors";
  for (size_t n = 0; n < bytes.size(); ++n) {
    INFO(n << " of " << bytes.size() << " bytes");
    write_bytes(cut, bytes.substr(0, n));
    CHECK_THAT(refusal(cut), Contains(cut.string()));
  }
  CHECK_THAT(refusal(dir.path / "missing.safetensors"), Contains("missing.safetensors"));

  const auto bad = dir.path / "bad.safetensors";
  nlohmann::json header = {{"w", {{"dtype", "F32"}, {"shape", {3}}, {"data_offsets", {0, 8}}}}};
  write_bytes(bad, file_of(header, bytes_of({1, 2})));
  CHECK_THAT(refusal(bad), Contains("tensor 'w'"));  // 8 bytes do not hold 3 values
  header = {{"w", {{"dtype", "F32"}, {"shape", {-2}}, {"data_offsets", {0, 8}}}}};
  write_bytes(bad, file_of(header, bytes_of({1, 2})));
  CHECK_THAT(refusal(bad), Contains("tensor 'w'"));
  write_bytes(bad, file_of(nlohmann::json::array({1, 2}), ""));
  CHECK_THAT(refusal(bad), Contains("not a JSON object"));
  std::string huge(8, '\xff');  // a header length far past the end
  write_bytes(bad, huge + "{}");
  CHECK_THAT(refusal(bad), Contains("not a safetensors file"));
}

// Found by fuzz/safetensors.cc: a shape of 2^31 x 2^31 counted 2^62 values, whose 2^64 bytes
// wrapped to 0 and matched an empty byte range, so the file was read as a tensor without values;
// a shape or range of fractions (or 1e30) was cast to integers (truncated, or undefined).
TEST_CASE("a shape or byte range that is not whole numbers, or whose size wraps around, is refused", "[safetensors]") {
  TempDir dir;
  const auto bad = dir.path / "bad.safetensors";
  const int64_t big = int64_t{1} << 31;
  nlohmann::json header = {{"w", {{"dtype", "F32"}, {"shape", {big, big}}, {"data_offsets", {0, 0}}}}};
  write_bytes(bad, file_of(header, ""));
  CHECK_THAT(refusal(bad), Contains("tensor 'w': its byte range does not hold its shape"));
  header = {{"w", {{"dtype", "F32"}, {"shape", {2.5}}, {"data_offsets", {0, 8}}}}};
  write_bytes(bad, file_of(header, bytes_of({1, 2})));
  CHECK_THAT(refusal(bad), Contains("tensor 'w': its shape is not a list of whole numbers"));
  header = {{"w", {{"dtype", "F32"}, {"shape", {1e30}}, {"data_offsets", {0, 8}}}}};
  write_bytes(bad, file_of(header, bytes_of({1, 2})));
  CHECK_THAT(refusal(bad), Contains("tensor 'w': its shape is not a list of whole numbers"));
  header = {{"w", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8.5}}}}};
  write_bytes(bad, file_of(header, bytes_of({1, 2, 3})));
  CHECK_THAT(refusal(bad), Contains("tensor 'w': bad data_offsets"));
}

TEST_CASE("parse_safetensors reads a file's bytes as load_safetensors reads the file", "[safetensors]") {
  TempDir dir;
  const auto path = dir.path / "model.safetensors";
  save_safetensors(path, kTensors, {{"info", "{}"}});
  const std::string bytes = read_bytes(path);
  const auto loaded = load_safetensors(path);
  const auto parsed = parse_safetensors({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, "in memory");
  REQUIRE(parsed.tensors.size() == loaded.tensors.size());
  for (size_t i = 0; i < parsed.tensors.size(); ++i) {
    CHECK(parsed.tensors[i].name == loaded.tensors[i].name);
    CHECK(parsed.tensors[i].shape == loaded.tensors[i].shape);
    CHECK(parsed.tensors[i].values == loaded.tensors[i].values);
  }
  CHECK(parsed.metadata == loaded.metadata);
  try {
    (void)parse_safetensors({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size() - 1}, "in memory");
    FAIL("a cut file was accepted");
  } catch (const InvalidInput& e) {
    CHECK_THAT(e.what(), Contains("in memory: tensor"));
  }
}

TEST_CASE("a write replaces the file whole or not at all", "[safetensors]") {
  TempDir dir;
  const auto path = dir.path / "model.safetensors";
  save_safetensors(path, kTensors);
  const std::string before = read_bytes(path);
  std::filesystem::path tmp = path;
  tmp += ".tmp";

  SECTION("a new file replaces the old one and leaves no temporary file") {
    save_safetensors(path, {kTensors[2]});
    CHECK(load_safetensors(path).tensors.size() == 1);
    CHECK_FALSE(std::filesystem::exists(tmp));
  }
  SECTION("invalid tensors are refused before the file is touched") {
    CHECK_THROWS_AS(save_safetensors(path, {kTensors[0], kTensors[0]}), InvalidInput);  // a name twice
    CHECK_THROWS_AS(save_safetensors(path, {NamedTensor{"short", {4}, {1, 2, 3}}}), InvalidInput);
    CHECK(read_bytes(path) == before);
    CHECK_FALSE(std::filesystem::exists(tmp));
  }
  SECTION("a write that cannot complete leaves what was there and no temporary file") {
    const auto occupied = dir.path / "occupied";
    std::filesystem::create_directories(occupied / "inside");  // the rename onto it fails
    CHECK_THROWS_AS(save_safetensors(occupied, kTensors), IoError);
    CHECK(std::filesystem::is_directory(occupied / "inside"));
    CHECK_FALSE(std::filesystem::exists(dir.path / "occupied.tmp"));
    CHECK(read_bytes(path) == before);
  }
}
