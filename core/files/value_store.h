// Per-tensor fp32 arrays that a process keeps for a while but reads only a range at a time (the
// learner's carried residual and the values at its last cut): in memory, or in a file of a spill
// directory that the process maps and lets go of range by range.
//
// Spilled. One file per store, created in the directory and unlinked at once (nothing is left
// behind when the process ends, however it ends), its blocks reserved with posix_fallocate (a
// full disk is an IoError when the store is made, never a SIGBUS on a later write) and mapped
// shared. release() drops a range's pages from the process (madvise MADV_DONTNEED): what was
// written stays in the file (the page cache writes it back), so between two uses the store costs
// the process no resident memory and the machine only page cache it can reclaim. Reads of a
// released range come back from the page cache or the disk.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace diloco {

class ValueStore {
 public:
  // Holds no tensor.
  ValueStore() = default;
  // One zeroed array per size; in memory when `spill_dir` is empty, else in a file there. Throws
  // IoError naming the directory when the file cannot be made or its blocks reserved.
  ValueStore(const std::vector<size_t>& sizes, const std::string& spill_dir);
  // Takes `values` in memory when `spill_dir` is empty (no copy), else copies them into a file.
  static ValueStore of(std::vector<std::vector<float>> values, const std::string& spill_dir);

  ValueStore(ValueStore&& other) noexcept;
  ValueStore& operator=(ValueStore&& other) noexcept;
  ValueStore(const ValueStore&) = delete;
  ValueStore& operator=(const ValueStore&) = delete;
  ~ValueStore();

  size_t size() const { return spans_.size(); }
  bool empty() const { return spans_.empty(); }
  bool spilled() const { return map_ != nullptr; }
  std::span<float> operator[](size_t t) const { return spans_.at(t); }

  // Lets go of the whole pages inside values [begin, end) of tensor t (nothing when in memory).
  void release(size_t t, size_t begin, size_t end) const;
  void release_all() const;
  // A copy in memory.
  std::vector<std::vector<float>> to_vectors() const;
  void clear();

 private:
  std::vector<std::vector<float>> memory_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  std::vector<std::span<float>> spans_;
};

}  // namespace diloco
