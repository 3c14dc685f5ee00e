// WorkPool and for_ranges: every item runs exactly once, on however many threads, errors come
// back to the caller, and the ranges depend only on the data.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/parallel.h"

using namespace diloco;

TEST_CASE("WorkPool runs every item exactly once, for any number of threads and items", "[parallel]") {
  for (size_t threads : {1u, 2u, 3u, 8u}) {
    WorkPool pool(threads);
    CHECK(pool.threads() == threads);
    for (size_t count : {0u, 1u, 2u, 7u, 1000u}) {
      INFO("threads " << threads << " items " << count);
      std::vector<std::atomic<int>> calls(count);
      pool.run(count, [&](size_t i) { calls[i].fetch_add(1); });
      size_t once = 0;
      for (auto& c : calls) once += c.load() == 1;
      CHECK(once == count);
    }
  }
}

TEST_CASE("WorkPool shares items between threads and survives many runs in a row", "[parallel]") {
  WorkPool pool(4);
  std::mutex mutex;
  std::set<std::thread::id> seen;
  std::atomic<uint64_t> sum = 0;
  for (int run = 0; run < 2000; ++run) {
    pool.run(16, [&](size_t i) {
      sum += i;
      if (run % 100 == 0) {
        // Slow items so that more than one thread takes part.
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        std::lock_guard lock(mutex);
        seen.insert(std::this_thread::get_id());
      }
    });
  }
  CHECK(sum == 2000u * (15u * 16u / 2u));
  CHECK(seen.size() > 1);
}

TEST_CASE("WorkPool hands an item's exception to the caller, and runs again afterwards", "[parallel]") {
  WorkPool pool(3);
  std::atomic<int> ran = 0;
  CHECK_THROWS_WITH(pool.run(50,
                             [&](size_t i) {
                               ++ran;
                               if (i == 5) throw std::runtime_error("item 5 failed");
                             }),
                    "item 5 failed");
  CHECK(ran.load() >= 1);
  CHECK(ran.load() <= 50);
  std::atomic<int> after = 0;
  pool.run(10, [&](size_t) { ++after; });
  CHECK(after.load() == 10);
}

TEST_CASE("for_ranges cuts fixed ranges whatever runs them", "[parallel]") {
  WorkPool pool(3);
  for (WorkPool* p : {static_cast<WorkPool*>(nullptr), &pool}) {
    std::vector<std::pair<size_t, size_t>> ranges(range_count(10, 4));
    for_ranges(p, 10, 4, [&](size_t k, size_t b, size_t e) { ranges[k] = {b, e}; });
    CHECK(ranges == std::vector<std::pair<size_t, size_t>>{{0, 4}, {4, 8}, {8, 10}});
  }
  CHECK(range_count(0, 4) == 0);
  size_t calls = 0;
  for_ranges(&pool, 0, 4, [&](size_t, size_t, size_t) { ++calls; });
  CHECK(calls == 0);
}
