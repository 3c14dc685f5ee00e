#include "core/parallel.h"

#include <algorithm>
#include <utility>

#include "core/errors.h"

namespace diloco {

WorkPool::WorkPool(size_t threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  workers_.reserve(threads - 1);
  for (size_t i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
}

WorkPool::~WorkPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

// Claims items until none is left; the mutex is held on entry and on return.
void WorkPool::take_items() {
  std::unique_lock lock(mutex_, std::adopt_lock);
  while (next_ < count_ && !error_) {
    const size_t i = next_++;
    ++running_;
    lock.unlock();
    std::exception_ptr error;
    try {
      (*item_)(i);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    --running_;
    if (error && !error_) error_ = error;
  }
  if (running_ == 0) done_.notify_all();
  lock.release();
}

void WorkPool::work() {
  uint64_t seen = 0;
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    lock.release();  // still locked: take_items adopts the mutex
    take_items();
    lock = std::unique_lock(mutex_, std::adopt_lock);
  }
}

void WorkPool::run(size_t count, const std::function<void(size_t)>& item) {
  if (count == 0) return;
  if (workers_.empty() || count == 1) {
    for (size_t i = 0; i < count; ++i) item(i);
    return;
  }
  std::unique_lock lock(mutex_);
  DILOCO_ENFORCE(item_ == nullptr, "WorkPool::run is not reentrant");
  item_ = &item;
  count_ = count;
  next_ = 0;
  error_ = nullptr;
  ++generation_;
  wake_.notify_all();
  lock.release();
  take_items();
  lock = std::unique_lock(mutex_, std::adopt_lock);
  done_.wait(lock, [&] { return running_ == 0 && (next_ >= count_ || error_); });
  item_ = nullptr;
  count_ = 0;
  std::exception_ptr error = std::exchange(error_, nullptr);
  lock.unlock();
  if (error) std::rethrow_exception(error);
}

void for_ranges(WorkPool* pool, size_t n, size_t grain,
                const std::function<void(size_t, size_t, size_t)>& range) {
  DILOCO_ENFORCE(grain > 0, "for_ranges with grain 0");
  const size_t count = range_count(n, grain);
  auto item = [&](size_t k) { range(k, k * grain, std::min(n, (k + 1) * grain)); };
  if (pool == nullptr || count <= 1) {
    for (size_t k = 0; k < count; ++k) item(k);
    return;
  }
  pool->run(count, item);
}

}  // namespace diloco
