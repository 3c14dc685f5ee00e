// Real processes for integration tests: spawn a project binary with arguments, stop it with a
// real signal (SIGTERM or SIGKILL), wait with a bound. Output goes to a log file the test prints
// when it fails.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

namespace diloco::testing {

class ChildProcess {
 public:
  ChildProcess(std::vector<std::string> args, const std::string& log_path, const std::string& cwd = DILOCO_SOURCE_DIR)
      : log_path_(log_path) {
    // Flush first: the child would otherwise inherit and write out our buffered output.
    std::fflush(stdout);
    std::fflush(stderr);
    pid_ = fork();
    if (pid_ == 0) {
      if (chdir(cwd.c_str()) != 0) _exit(127);
      FILE* log = freopen(log_path.c_str(), "w", stdout);
      if (!log || dup2(fileno(stdout), STDERR_FILENO) < 0) _exit(127);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
  }
  ChildProcess(const ChildProcess&) = delete;
  ~ChildProcess() {
    if (running()) {
      ::kill(pid_, SIGKILL);
      wait_exit(std::chrono::seconds(10));
    }
  }

  pid_t pid() const { return pid_; }
  bool running() {
    if (exit_status_) return false;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exit_status_ = status;
      return false;
    }
    return true;
  }
  void signal(int sig) { ::kill(pid_, sig); }
  // Exit code, or -signal when killed; nullopt if still running after `limit`.
  std::optional<int> wait_exit(std::chrono::milliseconds limit) {
    auto deadline = std::chrono::steady_clock::now() + limit;
    while (running() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (!exit_status_) return std::nullopt;
    if (WIFEXITED(*exit_status_)) return WEXITSTATUS(*exit_status_);
    return -WTERMSIG(*exit_status_);
  }
  std::string log() const {
    std::ifstream in(log_path_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  // Resident set size in kB (from /proc), 0 if gone.
  long rss_kb() const {
    std::ifstream in("/proc/" + std::to_string(pid_) + "/status");
    for (std::string line; std::getline(in, line);)
      if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
    return 0;
  }

 private:
  pid_t pid_ = -1;
  std::string log_path_;
  std::optional<int> exit_status_;
};

// Every record of a JSON-lines file (a half-written last line is skipped).
inline std::vector<nlohmann::json> read_json_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded()) out.push_back(std::move(j));
  }
  return out;
}

// How many lines of a metrics.jsonl are `event` events.
inline size_t count_events(const std::string& path, const std::string& event) {
  size_t n = 0;
  for (const auto& j : read_json_lines(path)) n += j.value("event", "") == event;
  return n;
}

// The last record with "event" == event, if any.
inline std::optional<nlohmann::json> last_event(const std::string& path, const std::string& event) {
  std::optional<nlohmann::json> found;
  for (auto& j : read_json_lines(path))
    if (j.value("event", "") == event) found = std::move(j);
  return found;
}

// Polls `condition` every 100 ms until it holds or `limit` passes.
template <typename F>
bool eventually(F&& condition, std::chrono::milliseconds limit) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return condition();
}

inline std::string temp_dir(const std::string& name) {
  std::string dir = "/tmp/diloco-test-" + name + "-" + std::to_string(::getpid()) + "-" +
                    std::to_string(std::chrono::steady_clock::now().time_since_epoch().count() % 1000000);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace diloco::testing
