// Aggregation of the outer gradients of one tensor into one update, per merge rule:
//   WeightedAverage:   sum_i w_i d_i
//   RadialDirectional: (sum_i w_i ||d_i||) * normalize(sum_i w_i d_i / ||d_i||)
// RDA (Decoupled DiLoCo) keeps the length of the merged step at the weighted mean of the learners'
// step lengths, where plain averaging shrinks it as learners disagree in direction. Embeddings are
// always averaged plainly: most of their rows see few tokens per learner, so the rows' lengths say
// more about which tokens a learner saw than about how far it moved.
//
// Determinism: deltas are combined in the order given, element by element in fp32 (the parameters'
// precision), and norms are summed in double over a fixed number of lanes in a fixed order, per
// range of MergeWork::norm_block elements, the ranges' sums then added in range order. Threads
// (MergeWork::pool) take whole ranges, so the same inputs give the same bits on the same build
// whatever the number of threads.
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "core/codec/messages.h"
#include "core/parallel.h"
#include "merger/delta_tensors.h"

namespace diloco {

// How a merge divides its arithmetic. norm_block is part of the result (recorded in the merge
// record): 0 sums a norm over the whole tensor at once (the records before the field), otherwise
// per range of norm_block elements. pool only says who computes the ranges (null: the caller).
struct MergeWork {
  WorkPool* pool = nullptr;
  uint32_t norm_block = 0;
};

// The norm_block of new merges: 64 Ki elements (256 KiB of fp32), a unit of work large enough to
// hide a thread hand-off and small enough to share a 1M-element tensor between 16 threads.
inline constexpr uint32_t kNormBlock = 1u << 16;

// Tensors named "...embedding" ("token_embedding", "position_embedding").
bool is_embedding(std::string_view tensor_name);

// The rule actually applied to a tensor: `rule`, except WeightedAverage for embeddings.
MergeRule tensor_rule(MergeRule rule, std::string_view tensor_name);

// Raw weights scaled to sum 1, summed in the order given. Throws InvalidInput if `raw` is empty,
// holds a negative or non-finite weight, or sums to 0 (or overflows): a merge needs at least one
// delta that counts.
std::vector<double> normalised_weights(std::span<const double> raw);

// Euclidean norm of `x`, accumulated in double (fixed order, see above); without `work`, one sum
// over the whole span.
double l2_norm(std::span<const float> x);
double l2_norm(std::span<const float> x, const MergeWork& work);
// The same of a tensor read range by range (a quantized delta's tensor dequantized as it goes):
// the same bits as the norm of its fp32 values.
double l2_norm(const TensorReader& x, const MergeWork& work = {});

// Writes the aggregate of `deltas` (one tensor of each input, in merge order, all of out's size;
// quantized ones are dequantized range by range, so the call needs no fp32 copy of any input)
// with normalised `weights` (one per delta) into `out`. RDA details: a delta of (near) zero norm
// has no direction and only adds its (zero) length; with at most one delta that has a direction
// RDA equals the weighted average and is computed as such; when the directions cancel (their
// weighted sum is shorter than 1e-5 of their total weight, e.g. two opposite deltas) RDA falls
// back to the weighted average, since rescaling a near-zero sum would blow up rounding noise.
// Throws InternalError on mismatched sizes or an empty input list.
void aggregate_tensor(MergeRule rule, std::span<const TensorReader> deltas, std::span<const double> weights,
                      std::span<float> out, const MergeWork& work = {});
// The same of fp32 tensors.
void aggregate_tensor(MergeRule rule, std::span<const std::span<const float>> deltas,
                      std::span<const double> weights, std::span<float> out, const MergeWork& work = {});

// The aggregate of one tensor a range at a time, so that a merge need hold no buffer of the
// tensor: the constructor does what needs the whole tensor (for RDA: the deltas' norms, and the
// norm of their weighted directions, computed piece by piece), values() gives any range of the
// result. The weighted directions are kept in `keep` when it is given (the tensor's size), else
// dropped and computed again from the deltas by values(): one more pass over the inputs instead
// of 4 bytes per value (a plain average is computed once either way). The same bits as
// aggregate_tensor (which is built on it) for any division into ranges. Views `deltas` and
// `keep`: the caller keeps them alive. values() may be called from several threads at once.
class TensorAggregate {
 public:
  TensorAggregate(MergeRule rule, std::span<const TensorReader> deltas, std::span<const double> weights,
                  const MergeWork& work = {}, std::span<float> keep = {});
  size_t size() const { return deltas_[0].size(); }
  // Values [begin, end) of the aggregate into `out` (end - begin values).
  void values(size_t begin, size_t end, std::span<float> out) const;

 private:
  std::span<const TensorReader> deltas_;
  std::vector<float> coefficients_;  // per delta: its weight, or for RDA weight / norm
  float scale_ = 1.0f;               // RDA: mean norm / norm of the weighted directions
  bool scaled_ = false;
  std::span<const float> kept_;      // RDA: the weighted directions, when kept
};

}  // namespace diloco
