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

// out = sum_i coefficients[i] * deltas[i], one fp32 multiply-add per input and element, inputs
// in order: a plain contiguous loop per input, over ranges of the tensor (a quantized input is
// dequantized one range at a time).
void weighted_sum(std::span<const TensorReader> deltas, std::span<const float> coefficients, std::span<float> out,
                  const MergeWork& work) {
  for_ranges(work.pool, out.size(), kElementGrain, [&](size_t, size_t begin, size_t end) {
    thread_local std::vector<float> scratch;
    const size_t len = end - begin;
    float* o = out.data() + begin;
    {
      const float* x = deltas[0].read(begin, end, scratch).data();
      const float c = coefficients[0];
      for (size_t k = 0; k < len; ++k) o[k] = c * x[k];
    }
    for (size_t i = 1; i < deltas.size(); ++i) {
      const float* x = deltas[i].read(begin, end, scratch).data();
      const float c = coefficients[i];
      for (size_t k = 0; k < len; ++k) o[k] += c * x[k];
    }
  });
}

void weighted_average(std::span<const TensorReader> deltas, std::span<const double> weights, std::span<float> out,
                      const MergeWork& work) {
  std::vector<float> coefficients(weights.begin(), weights.end());
  weighted_sum(deltas, coefficients, out, work);
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
  DILOCO_ENFORCE(!deltas.empty(), "nothing to aggregate");
  DILOCO_ENFORCE_EQ(deltas.size(), weights.size());
  for (const auto& d : deltas) DILOCO_ENFORCE_EQ(d.size(), out.size());

  if (rule == MergeRule::WeightedAverage) return weighted_average(deltas, weights, out, work);
  DILOCO_ENFORCE(rule == MergeRule::RadialDirectional, "unknown merge rule ",
                 static_cast<int>(rule));

  double mean_norm = 0;      // sum_i w_i ||d_i||
  double directed_weight = 0;  // sum of the weights of deltas that have a direction
  size_t directed = 0;
  std::vector<float> coefficients(deltas.size(), 0.0f);
  for (size_t i = 0; i < deltas.size(); ++i) {
    const double norm = l2_norm(deltas[i], work);
    mean_norm += weights[i] * norm;
    if (norm <= kNoDirection || weights[i] == 0) continue;
    coefficients[i] = static_cast<float>(weights[i] / norm);
    directed_weight += weights[i];
    ++directed;
  }
  if (directed <= 1) return weighted_average(deltas, weights, out, work);

  weighted_sum(deltas, coefficients, out, work);
  const double direction_norm = l2_norm(out, work);
  if (direction_norm <= kCancelled * directed_weight)
    return weighted_average(deltas, weights, out, work);
  const float scale = static_cast<float>(mean_norm / direction_norm);
  for_ranges(work.pool, out.size(), kElementGrain, [&](size_t, size_t begin, size_t end) {
    for (size_t k = begin; k < end; ++k) out[k] *= scale;
  });
}

}  // namespace diloco
