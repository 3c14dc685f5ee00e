// A fixed set of worker threads for data-parallel loops whose result must not depend on how many
// threads ran them. The division of work is the caller's: a loop is split into items whose
// boundaries depend only on the data (for_ranges: fixed-size ranges), every item writes its own
// output, and anything combined across items (a sum) is combined by the caller in item order
// after run() returns. Which thread runs an item is left to chance; what an item computes is not.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace diloco {

class WorkPool {
 public:
  // `threads` threads take part in a run, the caller's included (threads - 1 workers are
  // started); 0 means one per hardware thread. 1 runs every item on the caller's thread.
  explicit WorkPool(size_t threads = 0);
  ~WorkPool();
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  size_t threads() const { return workers_.size() + 1; }

  // Calls item(i) once for every i in [0, count), on the workers and the caller, and returns when
  // all have returned. If items throw, the first exception is rethrown here after every started
  // item has finished (items not yet started are skipped). Not reentrant: one run at a time.
  void run(size_t count, const std::function<void(size_t)>& item);

 private:
  void work();
  void take_items();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(size_t)>* item_ = nullptr;
  size_t count_ = 0, next_ = 0, running_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

// Splits [0, n) into ranges of `grain` elements (the last one shorter) and calls
// range(k, begin, end) for range k, on `pool` or, when pool is null or there is one range, on the
// caller's thread. The ranges depend only on n and grain.
void for_ranges(WorkPool* pool, size_t n, size_t grain,
                const std::function<void(size_t, size_t, size_t)>& range);

// The number of ranges for_ranges makes.
inline size_t range_count(size_t n, size_t grain) { return n == 0 ? 0 : (n + grain - 1) / grain; }

}  // namespace diloco
