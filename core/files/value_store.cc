#include "core/files/value_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "core/errors.h"

namespace diloco {
namespace {

size_t page_size() {
  static const size_t size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

std::string spill_error(const std::string& dir, const char* what, int err) {
  return detail::concat("spill directory '", dir, "': ", what, ": ", std::strerror(err),
                        " (name an existing, writable directory with room for the learner's residual and cut "
                        "values, 8 bytes per parameter, or leave the spill directory unset to keep them in memory)");
}

}  // namespace

ValueStore::ValueStore(const std::vector<size_t>& sizes, const std::string& spill_dir) {
  size_t total = 0;
  for (size_t n : sizes) total += n;
  if (spill_dir.empty() || total == 0) {
    for (size_t n : sizes) memory_.emplace_back(n, 0.0f);
    for (auto& v : memory_) spans_.emplace_back(v);
    return;
  }
  std::string name = spill_dir + "/diloco-spill-XXXXXX";
  const int fd = mkstemp(name.data());
  if (fd < 0) throw IoError(spill_error(spill_dir, "cannot create a file", errno));
  unlink(name.c_str());  // gone with the process, however it ends
  const size_t bytes = total * sizeof(float);
  if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0) {
    close(fd);
    throw IoError(spill_error(spill_dir, detail::concat("cannot reserve ", bytes, " bytes").c_str(), err));
  }
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_err = errno;
  close(fd);  // the mapping keeps the file
  if (map == MAP_FAILED) throw IoError(spill_error(spill_dir, "cannot map its file", map_err));
  map_ = map;
  map_bytes_ = bytes;
  float* at = static_cast<float*>(map_);
  for (size_t n : sizes) {
    spans_.emplace_back(at, n);
    at += n;
  }
}

ValueStore ValueStore::of(std::vector<std::vector<float>> values, const std::string& spill_dir) {
  if (spill_dir.empty()) {
    ValueStore out;
    out.memory_ = std::move(values);
    for (auto& v : out.memory_) out.spans_.emplace_back(v);
    return out;
  }
  std::vector<size_t> sizes;
  for (const auto& v : values) sizes.push_back(v.size());
  ValueStore out(sizes, spill_dir);
  for (size_t t = 0; t < values.size(); ++t) {
    std::copy(values[t].begin(), values[t].end(), out.spans_[t].begin());
    std::vector<float>().swap(values[t]);
  }
  out.release_all();
  return out;
}

ValueStore::ValueStore(ValueStore&& other) noexcept
    : memory_(std::move(other.memory_)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      spans_(std::move(other.spans_)) {
  other.spans_.clear();
}

ValueStore& ValueStore::operator=(ValueStore&& other) noexcept {
  if (this != &other) {
    clear();
    memory_ = std::move(other.memory_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    spans_ = std::move(other.spans_);
    other.spans_.clear();
  }
  return *this;
}

ValueStore::~ValueStore() { clear(); }

void ValueStore::release(size_t t, size_t begin, size_t end) const {
  const std::span<float> s = spans_.at(t);
  DILOCO_ENFORCE(end <= s.size(), "ValueStore::release past the end of a tensor");
  if (map_ == nullptr || begin >= end) return;
  const size_t page = page_size();
  auto first = reinterpret_cast<uintptr_t>(s.data() + begin);
  auto last = reinterpret_cast<uintptr_t>(s.data() + end);
  first = (first + page - 1) / page * page;  // only pages wholly inside the range
  last = last / page * page;
  if (first < last) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

void ValueStore::release_all() const {
  if (map_ != nullptr) madvise(map_, map_bytes_, MADV_DONTNEED);
}

std::vector<std::vector<float>> ValueStore::to_vectors() const {
  std::vector<std::vector<float>> out;
  out.reserve(spans_.size());
  for (size_t t = 0; t < spans_.size(); ++t) {
    out.emplace_back(spans_[t].begin(), spans_[t].end());
    release(t, 0, spans_[t].size());
  }
  return out;
}

void ValueStore::clear() {
  if (map_ != nullptr) munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  memory_.clear();
  spans_.clear();
}

}  // namespace diloco
