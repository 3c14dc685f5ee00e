#include "learner/fragment_track.h"

#include <span>
#include <utility>

#include "core/errors.h"

namespace diloco {

std::vector<DenseTensor> blend(const std::vector<DenseTensor>& local, const std::vector<DenseTensor>& received,
                               double alpha) {
  if (local.size() != received.size())
    throw InvalidInput(detail::concat("blend: ", local.size(), " local tensors, ", received.size(), " received"));
  std::vector<DenseTensor> out = received;
  for (size_t t = 0; t < out.size(); ++t) {
    if (local[t].values.size() != received[t].values.size())
      throw InvalidInput(detail::concat("blend: tensor ", t, " has ", local[t].values.size(), " local values and ",
                                        received[t].values.size(), " received"));
    auto& v = out[t].values;
    for (size_t i = 0; i < v.size(); ++i)
      v[i] = static_cast<float>(alpha * local[t].values[i] + (1 - alpha) * received[t].values[i]);
  }
  return out;
}

FragmentTrack::FragmentTrack(std::vector<DenseTensor> anchor, uint64_t version, uint64_t checksum)
    : version_(version), checksum_(checksum), anchor_(std::move(anchor)) {
  for (const auto& t : anchor_) carried_.emplace_back(static_cast<int64_t>(t.values.size()));
}

void FragmentTrack::count_step(uint64_t tokens) {
  ++steps_;
  tokens_ += tokens;
}

CutDelta FragmentTrack::cut(const std::vector<std::vector<float>>& current, DType dtype, uint32_t block_size,
                           uint32_t topk) {
  if (current.size() != anchor_.size())
    throw InvalidInput(detail::concat("delta: ", current.size(), " tensors, the anchor has ", anchor_.size()));
  CutDelta out{.base_version = version_, .inner_steps = steps_, .tokens = tokens_, .tensors = {}};
  out.tensors.reserve(current.size());
  last_cut_ = carried_;  // an earlier cut on this base is superseded: start from the carried residual
  std::vector<float> delta;
  for (uint32_t t = 0; t < current.size(); ++t) {
    const auto& anchor = anchor_[t].values;
    if (current[t].size() != anchor.size())
      throw InvalidInput(detail::concat("delta: tensor ", t, " has ", current[t].size(), " values, the anchor ",
                                        anchor.size()));
    delta.resize(anchor.size());
    for (size_t i = 0; i < anchor.size(); ++i) delta[i] = anchor[i] - current[t][i];
    out.tensors.push_back(last_cut_[t].push(t, anchor_[t].shape, delta, dtype, block_size, topk));
  }
  sent_on_base_ = true;
  cut_point_ = current;
  steps_at_cut_ = steps_;
  tokens_at_cut_ = tokens_;
  return out;
}

void FragmentTrack::check_received(const std::vector<DenseTensor>& received, const char* what) const {
  if (received.size() != anchor_.size())
    throw InvalidInput(detail::concat(what, ": ", received.size(), " tensors, the anchor has ", anchor_.size()));
}

// The bookkeeping every adoption shares: the residual carried into the new base, the new anchor
// and base, and the end of a wait for it. Counters are the caller's.
void FragmentTrack::start_base(uint64_t version, uint64_t checksum, std::vector<DenseTensor> received) {
  if (sent_on_base_) carried_ = std::move(last_cut_);
  last_cut_.clear();
  cut_point_.clear();
  version_ = version;
  checksum_ = checksum;
  anchor_ = std::move(received);
  sent_on_base_ = false;
  if (awaiting_ && version_ > awaiting_->base) awaiting_.reset();
}

std::vector<DenseTensor> FragmentTrack::rebase(uint64_t version, uint64_t checksum, std::vector<DenseTensor> received,
                                               const std::vector<DenseTensor>& local) {
  check_received(received, "rebase");
  if (local.size() != received.size())
    throw InvalidInput(detail::concat("rebase: ", local.size(), " local tensors, ", received.size(), " received"));
  std::vector<DenseTensor> model = received;
  for (size_t t = 0; t < model.size(); ++t) {
    const std::vector<float>& from = sent_on_base_ ? cut_point_.at(t) : anchor_[t].values;
    auto& v = model[t].values;
    if (local[t].values.size() != v.size() || from.size() != v.size())
      throw InvalidInput(detail::concat("rebase: tensor ", t, " has ", local[t].values.size(), " local values and ",
                                        v.size(), " received"));
    for (size_t i = 0; i < v.size(); ++i) v[i] += local[t].values[i] - from[i];
  }
  if (sent_on_base_) {
    steps_ -= steps_at_cut_;
    tokens_ -= tokens_at_cut_;
  }
  start_base(version, checksum, std::move(received));
  return model;
}

std::vector<DenseTensor> FragmentTrack::adopt(uint64_t version, uint64_t checksum, std::vector<DenseTensor> received,
                                              double alpha, const std::vector<DenseTensor>& local) {
  check_received(received, "adopt");
  std::vector<DenseTensor> model = alpha > 0 ? blend(local, received, alpha) : received;
  start_base(version, checksum, std::move(received));
  steps_ = 0;
  tokens_ = 0;
  return model;
}

bool FragmentTrack::cut_before_adopting(uint64_t arriving_version, double fraction, uint32_t H) const {
  return fraction > 0 && arriving_version > version_ && !sent_on_base_ && steps_ > 0 &&
         static_cast<double>(steps_) >= fraction * H;
}

void FragmentTrack::expect_merge(uint64_t cut_step, int64_t wait_steps) {
  if (wait_steps < 0) return;
  awaiting_ = Wait{.base = version_, .until_step = cut_step + static_cast<uint64_t>(wait_steps)};
}

bool FragmentTrack::must_wait(uint64_t step) const { return awaiting_ && step >= awaiting_->until_step; }

std::optional<uint64_t> FragmentTrack::awaited_base() const {
  if (!awaiting_) return std::nullopt;
  return awaiting_->base;
}

std::vector<std::vector<float>> FragmentTrack::carried_residual() const {
  std::vector<std::vector<float>> out;
  for (const auto& f : carried_) {
    auto r = f.residual();
    out.emplace_back(r.begin(), r.end());
  }
  return out;
}

}  // namespace diloco
