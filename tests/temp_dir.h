// A directory of its own for a test, under the system's temporary directory, removed with
// everything in it when the test ends.
#pragma once

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>

namespace diloco::test {

struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& prefix = "diloco-test") {
    path = std::filesystem::temp_directory_path() /
           (prefix + "-" + std::to_string(::getpid()) + "-" +
            std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  bool empty() const { return std::filesystem::is_empty(path); }
};

}  // namespace diloco::test
