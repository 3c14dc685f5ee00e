#include "merger/aggregate.h"

#include <algorithm>
#include <cmath>

#include "core/errors.h"

namespace diloco {

namespace {

// Norms below this are zero up to fp32 underflow; dividing by them would overflow the coefficient.
constexpr double kNoDirection = 1e-30;
// Directions whose weighted sum is shorter than this fraction of their weight have cancelled.
constexpr double kCancelled = 1e-5;

// Elements per unit of element-wise work: any value gives the same bits.
constexpr size_t kElementGrain = kNormBlock;

// o = sum_i coefficients[i] * deltas[i] over values [begin, end) of the tensor, one fp32
// multiply-add per input and element, inputs in order: a plain contiguous loop per input (a
// quantized input is dequantized for the range alone). Any division into ranges gives the same bits.
void weighted_sum_range(std::span<const TensorReader> deltas, std::span<const float> coefficients, size_t begin,
                        size_t end, float* o) {
  thread_local std::vector<float> scratch;
  const size_t len = end - begin;
  float* __restrict out = o;  // never one of the inputs: the loops may be vectorized
  {
    const float* __restrict x = deltas[0].read(begin, end, scratch).data();
    const float c = coefficients[0];
    for (size_t k = 0; k < len; ++k) out[k] = c * x[k];
  }
  for (size_t i = 1; i < deltas.size(); ++i) {
    const float* __restrict x = deltas[i].read(begin, end, scratch).data();
    const float c = coefficients[i];
    for (size_t k = 0; k < len; ++k) out[k] += c * x[k];
  }
}

// sum_k x[k]^2 in double over kLanes independent lanes (so the compiler vectorizes without
// reordering any single sum), the lanes then added in order. A sum can be fed in pieces: every
// piece but the last must hold a multiple of kLanes values.
constexpr size_t kLanes = 8;
struct Squares {
  double lanes[kLanes] = {};

  void add(std::span<const float> x) {
    const float* p = x.data();
    const size_t n = x.size();
    size_t k = 0;
    for (; k + kLanes <= n; k += kLanes)
      for (size_t j = 0; j < kLanes; ++j) lanes[j] += static_cast<double>(p[k + j]) * p[k + j];
    for (; k < n; ++k) lanes[0] += static_cast<double>(p[k]) * p[k];
  }
  double sum() const {
    double total = 0;
    for (double lane : lanes) total += lane;
    return total;
  }
};

// Values read per piece of a sum of squares (a multiple of kLanes).
constexpr size_t kReadGrain = size_t{1} << 14;

// sum_squares of values [begin, end) of x, read kReadGrain values at a time.
double sum_squares(const TensorReader& x, size_t begin, size_t end) {
  thread_local std::vector<float> scratch;
  Squares squares;
  for (size_t s = begin; s < end; s += kReadGrain) squares.add(x.read(s, std::min(end, s + kReadGrain), scratch));
  return squares.sum();
}

}  // namespace

bool is_embedding(std::string_view tensor_name) { return tensor_name.ends_with("embedding"); }

MergeRule tensor_rule(MergeRule rule, std::string_view tensor_name) {
  return is_embedding(tensor_name) ? MergeRule::WeightedAverage : rule;
}

std::vector<double> normalised_weights(std::span<const double> raw) {
  if (raw.empty()) throw InvalidInput("a merge needs at least one delta");
  double total = 0;
  for (size_t i = 0; i < raw.size(); ++i) {
    if (!std::isfinite(raw[i]) || raw[i] < 0)
      throw InvalidInput(detail::concat("weight ", raw[i], " of delta ", i,
                                        " is negative or not finite"));
    total += raw[i];
  }
  if (!(total > 0) || !std::isfinite(total))
    throw InvalidInput(detail::concat("the ", raw.size(), " delta weights sum to ", total,
                                      ": no delta counts"));
  std::vector<double> out(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) out[i] = raw[i] / total;
  return out;
}

double l2_norm(std::span<const float> x) { return l2_norm(TensorReader(x)); }

double l2_norm(std::span<const float> x, const MergeWork& work) { return l2_norm(TensorReader(x), work); }

double l2_norm(const TensorReader& x, const MergeWork& work) {
  const size_t block = work.norm_block;
  if (block == 0 || x.size() <= block) return std::sqrt(sum_squares(x, 0, x.size()));
  std::vector<double> partial(range_count(x.size(), block));
  for_ranges(work.pool, x.size(), block,
             [&](size_t k, size_t begin, size_t end) { partial[k] = sum_squares(x, begin, end); });
  double sum = 0;
  for (double p : partial) sum += p;
  return std::sqrt(sum);
}

void aggregate_tensor(MergeRule rule, std::span<const std::span<const float>> deltas,
                      std::span<const double> weights, std::span<float> out, const MergeWork& work) {
  const std::vector<TensorReader> readers(deltas.begin(), deltas.end());
  aggregate_tensor(rule, std::span<const TensorReader>(readers), weights, out, work);
}

void aggregate_tensor(MergeRule rule, std::span<const TensorReader> deltas, std::span<const double> weights,
                      std::span<float> out, const MergeWork& work) {
  const TensorAggregate aggregate(rule, deltas, weights, work);
  DILOCO_ENFORCE_EQ(aggregate.size(), out.size());
  for_ranges(work.pool, out.size(), kElementGrain,
             [&](size_t, size_t begin, size_t end) { aggregate.values(begin, end, out.subspan(begin, end - begin)); });
}

TensorAggregate::TensorAggregate(MergeRule rule, std::span<const TensorReader> deltas, std::span<const double> weights,
                                 const MergeWork& work, std::span<float> keep)
    : deltas_(deltas), coefficients_(weights.begin(), weights.end()) {
  DILOCO_ENFORCE(!deltas.empty(), "nothing to aggregate");
  DILOCO_ENFORCE_EQ(deltas.size(), weights.size());
  for (const auto& d : deltas) DILOCO_ENFORCE_EQ(d.size(), deltas[0].size());
  if (rule == MergeRule::WeightedAverage) return;
  DILOCO_ENFORCE(rule == MergeRule::RadialDirectional, "unknown merge rule ", static_cast<int>(rule));

  double mean_norm = 0;        // sum_i w_i ||d_i||
  double directed_weight = 0;  // sum of the weights of deltas that have a direction
  size_t directed = 0;
  std::vector<float> directions(deltas.size(), 0.0f);
  for (size_t i = 0; i < deltas.size(); ++i) {
    const double norm = l2_norm(deltas[i], work);
    mean_norm += weights[i] * norm;
    if (norm <= kNoDirection || weights[i] == 0) continue;
    directions[i] = static_cast<float>(weights[i] / norm);
    directed_weight += weights[i];
    ++directed;
  }
  if (directed <= 1) return;  // the weighted average

  // The norm of sum_i directions[i] d_i, piece by piece as l2_norm reads a tensor (the same
  // ranges, pieces and order, so the same bits as the norm of that sum held whole), each piece
  // computed into `keep` or computed and dropped.
  const size_t n = size();
  DILOCO_ENFORCE(keep.empty() || keep.size() == n, "a kept aggregate of ", keep.size(), " values for a tensor of ", n);
  const auto squares_of = [&](size_t begin, size_t end) {
    thread_local std::vector<float> piece;
    Squares squares;
    for (size_t s = begin; s < end; s += kReadGrain) {
      const size_t e = std::min(end, s + kReadGrain);
      float* o = keep.empty() ? (piece.resize(e - s), piece.data()) : keep.data() + s;
      weighted_sum_range(deltas, directions, s, e, o);
      squares.add(std::span<const float>(o, e - s));
    }
    return squares.sum();
  };
  double sum = 0;
  if (work.norm_block == 0 || n <= work.norm_block) {
    sum = squares_of(0, n);
  } else {
    std::vector<double> partial(range_count(n, work.norm_block));
    for_ranges(work.pool, n, work.norm_block,
               [&](size_t k, size_t begin, size_t end) { partial[k] = squares_of(begin, end); });
    for (double p : partial) sum += p;
  }
  const double direction_norm = std::sqrt(sum);
  if (direction_norm <= kCancelled * directed_weight) return;  // cancelled: the weighted average
  coefficients_ = std::move(directions);
  scale_ = static_cast<float>(mean_norm / direction_norm);
  scaled_ = true;
  kept_ = keep;
}

void TensorAggregate::values(size_t begin, size_t end, std::span<float> out) const {
  DILOCO_ENFORCE(begin <= end && end <= size() && out.size() == end - begin, "aggregate values [", begin, ", ", end,
                 ") of a tensor of ", size(), " into ", out.size());
  if (begin == end) return;
  if (kept_.empty())
    weighted_sum_range(deltas_, coefficients_, begin, end, out.data());
  else
    std::copy_n(kept_.data() + begin, end - begin, out.data());
  if (!scaled_) return;
  for (float& v : out) v *= scale_;
}

}  // namespace diloco
