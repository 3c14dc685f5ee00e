// ValueStore (core/files/value_store.h): per-tensor fp32 arrays in memory or spilled to a file
// that is let go of range by range.
#include <catch2/catch.hpp>

#include <fstream>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/files/value_store.h"
#include "tests/temp_dir.h"

using namespace diloco;
using Catch::Matchers::Contains;

namespace {

// The process's resident pages of mapped files, in KiB (/proc/self/status).
long rss_file_kib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("RssFile:", 0) == 0) return std::stol(line.substr(8));
  FAIL("no RssFile in /proc/self/status");
  return 0;
}

}  // namespace

TEST_CASE("a value store starts at zero and keeps what is written, in memory or spilled", "[value_store]") {
  test::TempDir dir("diloco-value-store");
  for (const std::string& where : {std::string(), dir.path.string()}) {
    ValueStore s({3, 0, 5000}, where);
    CHECK(s.spilled() == !where.empty());
    REQUIRE(s.size() == 3);
    CHECK(s[0].size() == 3);
    CHECK(s[1].empty());
    CHECK(s[2].size() == 5000);
    for (float v : s[2]) CHECK(v == 0.0f);
    for (size_t i = 0; i < 5000; ++i) s[2][i] = static_cast<float>(i) * 0.5f;
    s[0][1] = -7;
    s.release(2, 0, 5000);  // let go of, not lost
    s.release(2, 17, 3001);
    s.release_all();
    const auto copy = s.to_vectors();
    CHECK(copy[0] == std::vector<float>{0, -7, 0});
    CHECK(copy[1].empty());
    for (size_t i = 0; i < 5000; ++i) REQUIRE(copy[2][i] == static_cast<float>(i) * 0.5f);
    CHECK_THROWS_AS(s.release(0, 0, 4), InternalError);
    // Moved, the values stay where they are.
    ValueStore moved = std::move(s);
    CHECK(moved[0][1] == -7);
    CHECK(s.empty());
  }
  // The file is unlinked at once: nothing is left in the directory, even while the store lives.
  ValueStore held({1000}, dir.path.string());
  CHECK(dir.empty());
}

TEST_CASE("a value store made of vectors takes them in memory and copies them when spilled", "[value_store]") {
  test::TempDir dir("diloco-value-store");
  std::vector<std::vector<float>> values = {{1, 2, 3}, {4}};
  const float* data = values[0].data();
  ValueStore in_memory = ValueStore::of(values, {});
  CHECK(!in_memory.spilled());
  ValueStore taken = ValueStore::of(std::move(values), {});
  CHECK(taken[0].data() == data);  // no copy
  ValueStore spilled = ValueStore::of({{1, 2, 3}, {4}}, dir.path.string());
  CHECK(spilled.spilled());
  CHECK(spilled.to_vectors() == std::vector<std::vector<float>>{{1, 2, 3}, {4}});
}

TEST_CASE("a spilled store's released pages leave the process", "[value_store]") {
  test::TempDir dir("diloco-value-store");
  const size_t n = size_t{16} << 20;  // 64 MiB of values
  ValueStore s({n}, dir.path.string());
  const long before = rss_file_kib();
  for (size_t i = 0; i < n; ++i) s[0][i] = 1.0f;
  CHECK(rss_file_kib() - before > 60 * 1024);
  s.release(0, 0, n / 2);
  const long half = rss_file_kib();
  CHECK(half - before < 40 * 1024);
  s.release_all();
  CHECK(rss_file_kib() - before < 1024);
  // Read back from the page cache or the disk.
  double sum = 0;
  for (size_t i = 0; i < n; i += 1024) sum += s[0][i];
  CHECK(sum == static_cast<double>(n / 1024));
}

TEST_CASE("a spill directory that cannot hold the store is an IoError naming it", "[value_store]") {
  CHECK_THROWS_WITH(ValueStore({10}, "/nonexistent/spill"),
                    Contains("spill directory '/nonexistent/spill'") && Contains("cannot create a file"));
  CHECK_THROWS_AS(ValueStore({10}, "/nonexistent/spill"), IoError);
  // Sizes are never spilled when there is nothing to hold.
  CHECK(!ValueStore({0, 0}, "/nonexistent/spill").spilled());
}
