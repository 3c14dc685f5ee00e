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
    : FragmentTrack(std::make_shared<const std::vector<DenseTensor>>(std::move(anchor)), version, checksum) {}

FragmentTrack::FragmentTrack(Version anchor, uint64_t version, uint64_t checksum)
    : version_(version), checksum_(checksum), anchor_(std::move(anchor)) {
  DILOCO_ENFORCE(anchor_ != nullptr, "FragmentTrack: a null anchor");
  for (const auto& t : *anchor_) carried_.emplace_back(static_cast<int64_t>(t.values.size()));
}

const std::vector<DenseTensor>& FragmentTrack::anchor() const {
  static const std::vector<DenseTensor> none;
  return anchor_ ? *anchor_ : none;
}

void FragmentTrack::count_step(uint64_t tokens) {
  ++steps_;
  tokens_ += tokens;
}

CutDelta FragmentTrack::cut(std::vector<std::vector<float>> current, DType dtype, uint32_t block_size,
                           uint32_t topk) {
  const std::vector<DenseTensor>& anchors = anchor();
  if (current.size() != anchors.size())
    throw InvalidInput(detail::concat("delta: ", current.size(), " tensors, the anchor has ", anchors.size()));
  CutDelta out{.base_version = version_, .inner_steps = steps_, .tokens = tokens_, .tensors = {}};
  out.tensors.reserve(current.size());
  last_cut_ = carried_;  // an earlier cut on this base is superseded: start from the carried residual
  std::vector<float> delta;
  for (uint32_t t = 0; t < current.size(); ++t) {
    const auto& anchor = anchors[t].values;
    if (current[t].size() != anchor.size())
      throw InvalidInput(detail::concat("delta: tensor ", t, " has ", current[t].size(), " values, the anchor ",
                                        anchor.size()));
    delta.resize(anchor.size());
    for (size_t i = 0; i < anchor.size(); ++i) delta[i] = anchor[i] - current[t][i];
    out.tensors.push_back(last_cut_[t].push(t, anchors[t].shape, delta, dtype, block_size, topk));
  }
  sent_on_base_ = true;
  cut_point_ = std::move(current);  // kept, not copied: one fragment's values fewer at a cut
  steps_at_cut_ = steps_;
  tokens_at_cut_ = tokens_;
  return out;
}

void FragmentTrack::check_received(const std::vector<DenseTensor>& received, const char* what) const {
  if (received.size() != anchor().size())
    throw InvalidInput(detail::concat(what, ": ", received.size(), " tensors, the anchor has ", anchor().size()));
}

// The bookkeeping every adoption shares: the residual carried into the new base, the new anchor
// and base, and the end of a wait for it. Counters are the caller's.
void FragmentTrack::start_base(uint64_t version, uint64_t checksum, Version received) {
  if (sent_on_base_) carried_ = std::move(last_cut_);
  last_cut_.clear();
  // The new base has no cut yet (a saved track checks its counters against these).
  cut_point_.clear();
  steps_at_cut_ = 0;
  tokens_at_cut_ = 0;
  version_ = version;
  checksum_ = checksum;
  anchor_ = std::move(received);
  sent_on_base_ = false;
  if (awaiting_ && version_ > awaiting_->base) awaiting_.reset();
}

std::vector<DenseTensor> FragmentTrack::rebase(uint64_t version, uint64_t checksum, std::vector<DenseTensor> received,
                                               std::vector<DenseTensor> local) {
  return rebase(version, checksum, std::make_shared<const std::vector<DenseTensor>>(std::move(received)),
                std::move(local));
}

std::vector<DenseTensor> FragmentTrack::rebase(uint64_t version, uint64_t checksum, Version received_version,
                                               std::vector<DenseTensor> local) {
  DILOCO_ENFORCE(received_version != nullptr, "rebase: no version");
  const std::vector<DenseTensor>& received = *received_version;
  check_received(received, "rebase");
  if (local.size() != received.size())
    throw InvalidInput(detail::concat("rebase: ", local.size(), " local tensors, ", received.size(), " received"));
  for (size_t t = 0; t < local.size(); ++t) {
    const std::vector<float>& from = sent_on_base_ ? cut_point_.at(t) : anchor()[t].values;
    const auto& r = received[t].values;
    if (local[t].values.size() != r.size() || from.size() != r.size())
      throw InvalidInput(detail::concat("rebase: tensor ", t, " has ", local[t].values.size(), " local values and ",
                                        r.size(), " received"));
  }
  // Written over `local` (no third copy of the fragment): received + (local - from), the same bits.
  std::vector<DenseTensor> model = std::move(local);
  for (size_t t = 0; t < model.size(); ++t) {
    const std::vector<float>& from = sent_on_base_ ? cut_point_.at(t) : anchor()[t].values;
    const auto& r = received[t].values;
    auto& v = model[t].values;
    for (size_t i = 0; i < v.size(); ++i) v[i] = r[i] + (v[i] - from[i]);
  }
  if (sent_on_base_) {
    steps_ -= steps_at_cut_;
    tokens_ -= tokens_at_cut_;
  }
  start_base(version, checksum, std::move(received_version));
  return model;
}

std::vector<DenseTensor> FragmentTrack::adopt(uint64_t version, uint64_t checksum, std::vector<DenseTensor> received,
                                              double alpha, const std::vector<DenseTensor>& local) {
  return adopt(version, checksum, std::make_shared<const std::vector<DenseTensor>>(std::move(received)), alpha, local);
}

std::vector<DenseTensor> FragmentTrack::adopt(uint64_t version, uint64_t checksum, Version received_version,
                                              double alpha, const std::vector<DenseTensor>& local) {
  DILOCO_ENFORCE(received_version != nullptr, "adopt: no version");
  const std::vector<DenseTensor>& received = *received_version;
  check_received(received, "adopt");
  std::vector<DenseTensor> model = alpha > 0 ? blend(local, received, alpha) : received;
  start_base(version, checksum, std::move(received_version));
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

FragmentTrack::Saved FragmentTrack::save() const {
  auto residuals = [](const std::vector<ErrorFeedback>& list) {
    std::vector<std::vector<float>> out;
    for (const auto& f : list) out.emplace_back(f.residual().begin(), f.residual().end());
    return out;
  };
  return Saved{.version = version_, .checksum = checksum_, .anchor = anchor(), .carried = residuals(carried_),
               .last_cut = residuals(last_cut_), .sent_on_base = sent_on_base_, .steps = steps_, .tokens = tokens_,
               .cut_point = cut_point_, .steps_at_cut = steps_at_cut_, .tokens_at_cut = tokens_at_cut_};
}

FragmentTrack FragmentTrack::restore(Saved saved) {
  const size_t n = saved.anchor.size();
  auto sizes_match = [&](const std::vector<std::vector<float>>& list, bool may_be_empty) {
    if (list.empty()) return may_be_empty;
    if (list.size() != n) return false;
    for (size_t t = 0; t < n; ++t)
      if (list[t].size() != saved.anchor[t].values.size()) return false;
    return true;
  };
  if (!sizes_match(saved.carried, false) || !sizes_match(saved.last_cut, !saved.sent_on_base) ||
      !sizes_match(saved.cut_point, !saved.sent_on_base) || saved.steps_at_cut > saved.steps ||
      saved.tokens_at_cut > saved.tokens)
    throw InvalidInput("a saved fragment's residuals, cut point or counters do not agree with its anchor");
  FragmentTrack out(std::move(saved.anchor), saved.version, saved.checksum);
  out.carried_.clear();
  for (auto& r : saved.carried) out.carried_.emplace_back(std::move(r));
  for (auto& r : saved.last_cut) out.last_cut_.emplace_back(std::move(r));
  out.sent_on_base_ = saved.sent_on_base;
  out.steps_ = saved.steps;
  out.tokens_ = saved.tokens;
  out.cut_point_ = std::move(saved.cut_point);
  out.steps_at_cut_ = saved.steps_at_cut;
  out.tokens_at_cut_ = saved.tokens_at_cut;
  return out;
}

}  // namespace diloco
