// Shared by every long-running binary: the wall clock of messages, a stop flag set by SIGINT/SIGTERM (the librdkafka example
// shape: the handler only sets the flag, the main loop notices and shuts down in bounded time),
// and the bootstrap-servers default.
#pragma once

#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <malloc.h>
#include <string>

#include "core/errors.h"

namespace diloco {

inline std::atomic<bool>& stop_requested() {
  static std::atomic<bool> flag{false};
  return flag;
}

inline void install_stop_handlers() {
  auto handler = [](int) { stop_requested() = true; };
  std::signal(SIGINT, handler);
  std::signal(SIGTERM, handler);
}

// Blocks of 1 MiB or more (tensors, messages) are mapped on their own and go back to the system
// when freed. glibc's default threshold grows up to 32 MiB as large blocks are freed, and blocks
// below it stay in the heap, where a fragment's worth of freed tensors can keep the resident set
// far above what is live (bench/RESULTS.md, the data plane at model scale). Learners do not call
// it: their training steps allocate activations of that size every step, and a mapping each time
// costs page faults on every step.
inline void return_large_buffers() { mallopt(M_MMAP_THRESHOLD, 1 << 20); }

// Wall-clock time in microseconds since the Unix epoch: what messages and metrics lines carry.
inline int64_t unix_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A fault-injection count for tests ($NAME: 0 or unset is off, N: the Nth event fails).
// Throws InvalidInput naming the variable when it is not a count.
inline int fault_count_from_environment(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return 0;
  int n = 0;
  const char* end = v + std::strlen(v);
  auto [ptr, ec] = std::from_chars(v, end, n);
  if (ec != std::errc() || ptr != end || n < 0)
    throw InvalidInput(std::string(name) + " must be a count (0: off, N: the Nth one fails), not \"" + v +
                       "\"; unset it outside fault tests");
  return n;
}

// $DILOCO_BOOTSTRAP, or the address scripts/broker uses.
inline std::string default_bootstrap_servers() {
  const char* env = std::getenv("DILOCO_BOOTSTRAP");
  return env && *env ? env : "127.0.0.1:19092";
}

}  // namespace diloco
