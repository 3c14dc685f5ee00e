// Exact top-k selection within one block of fp32 values, by magnitude, for the top-k codec
// (codec.topk, quantize_with_feedback). Pure functions, no I/O.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace diloco {

// Reused memory of select_topk (grows to the largest block seen).
struct TopkScratch {
  std::vector<uint8_t> bucket;
  std::vector<uint32_t> above, candidates;
  std::vector<uint32_t> keys;
  uint32_t guess = 200;  // where the search for the boundary bucket starts (the last block's)
};

// Writes to out[0, k) the positions, ascending, of the k values of x[0, n) of largest magnitude;
// 0 < k < n. Magnitudes are compared as float bits without the sign (a total order: finite values,
// then Inf, then NaN); of equal magnitudes the first ones (lowest positions) are kept. So the
// result is the first k of the positions sorted by (|x| descending, position ascending).
//
// A radix select, not a sort: one pass buckets each magnitude by its exponent and 3 mantissa
// bits (256 buckets counted down from the block's largest, the last one holding everything 32 or
// more binades below it), vector counting passes find the bucket holding the k-th largest, a
// vector pass collects the positions in it and above, and only that bucket's candidates are
// ranked (nth_element on their magnitudes gives the threshold; ties go to the first positions).
void select_topk(const float* x, size_t n, size_t k, uint32_t* out, TopkScratch& scratch);
// The same when the caller knows the largest magnitude of x (as float bits without the sign).
void select_topk(const float* x, size_t n, size_t k, uint32_t* out, TopkScratch& scratch, uint32_t max_magnitude);

}  // namespace diloco
