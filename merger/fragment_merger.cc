#include "merger/fragment_merger.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "core/errors.h"
#include "merger/aggregate.h"
#include "merger/weighting.h"

namespace diloco {

namespace {

bool before(const LogPosition& a, const LogPosition& b) {
  return std::tie(a.topic, a.partition, a.offset) < std::tie(b.topic, b.partition, b.offset);
}

// Whether `a` is a later delta of the same learner than `b`: a learner's base only grows, and on
// one base its seq does. Seqs come from the learner's wall clock, which may step back across a
// restart; the restarted learner adopts a version first, so its deltas win by their base.
bool newer(const DeltaRef& a, const DeltaRef& b) {
  if (a.base_version != b.base_version) return a.base_version > b.base_version;
  return a.seq > b.seq;
}

}  // namespace

const char* merger_state_name(MergerState state) {
  switch (state) {
    case MergerState::Collecting: return "COLLECTING";
    case MergerState::Grace: return "GRACE";
    case MergerState::Merging: return "MERGING";
    case MergerState::Publish: return "PUBLISH";
    case MergerState::Stopped: return "STOPPED";
  }
  return "unknown";
}

DeltaRef delta_ref(const DeltaHeader& header, const LogPosition& position) {
  DeltaRef ref;
  ref.position = position;
  ref.learner_id = header.learner_id;
  ref.seq = header.seq;
  ref.base_version = header.base_version;
  ref.inner_steps = header.inner_steps;
  ref.tokens = header.tokens;
  return ref;
}

FragmentMerger::FragmentMerger(uint32_t fragment, uint64_t version, const OuterHyper& hyper,
                               double /*now*/, std::map<std::string, uint64_t> merged_bases,
                               InputBounds bounds)
    : fragment_(fragment), version_(version), hyper_(hyper), merged_base_(std::move(merged_bases)),
      bounds_(bounds) {
  validate_outer_hyper(hyper_);
}

void FragmentMerger::expect(MergerState state, const char* call) const {
  if (state_ != state)
    throw InternalError(detail::concat("fragment ", fragment_, ": ", call, " in state ",
                                       merger_state_name(state_), ", expected ",
                                       merger_state_name(state)));
}

DroppedDelta FragmentMerger::record_drop(DroppedDelta dropped) {
  dropped_.push_back(dropped);
  return dropped;
}

std::optional<DroppedDelta> FragmentMerger::check(DeltaRef& ref, std::optional<double> norm) const {
  if (norm && bounds_.max_norm_ratio > 0 && norms_.size() >= bounds_.norm_min) {
    std::vector<double> recent(norms_.begin(), norms_.end());
    std::nth_element(recent.begin(), recent.begin() + static_cast<std::ptrdiff_t>(recent.size() / 2), recent.end());
    const double median = recent[recent.size() / 2];
    if (!(*norm <= bounds_.max_norm_ratio * median))
      return DroppedDelta{ref, DropReason::Invalid,
                          detail::concat("L2 norm ", *norm, " is above merger.max_norm_ratio ",
                                         bounds_.max_norm_ratio, " x ", median,
                                         ", the median of the fragment's last ", recent.size(),
                                         " accepted deltas")};
  }
  if (ref.base_version > version_)
    return DroppedDelta{ref, DropReason::Invalid,
                        detail::concat("base from the future: base version ", ref.base_version,
                                       ", current version ", version_)};
  if (auto merged = merged_base_.find(ref.learner_id);
      merged != merged_base_.end() && ref.base_version <= merged->second)
    return DroppedDelta{ref, DropReason::Superseded,
                        detail::concat("base already merged from this learner (base version ",
                                       ref.base_version, ", merged base ", merged->second, ")")};
  weigh(ref, version_, hyper_);
  if (too_stale(ref.staleness, hyper_.max_staleness))
    return DroppedDelta{ref, DropReason::TooStale,
                        detail::concat("staleness ", ref.staleness, " above max_staleness ",
                                       hyper_.max_staleness)};
  if (!(ref.weight > 0) || !std::isfinite(ref.weight))
    return DroppedDelta{ref, DropReason::Invalid,
                        detail::concat("weight ", ref.weight, " (", ref.tokens, " tokens, ",
                                       ref.inner_steps, " steps, staleness ", ref.staleness, ")")};
  return std::nullopt;
}

std::optional<DroppedDelta> FragmentMerger::offer(DeltaRef delta, DeltaTensors tensors, double now,
                                                  std::optional<DeclaredBatch> declared) {
  if (state_ == MergerState::Stopped)
    throw InternalError(detail::concat("fragment ", fragment_, ": offer after stop"));
  // Tokens never change, so unlike the checks below this one is made once, here.
  if (declared && declared->tokens_per_step() > 0 &&
      static_cast<unsigned __int128>(delta.tokens) >
          static_cast<unsigned __int128>(delta.inner_steps) * declared->tokens_per_step())
    return record_drop({delta, DropReason::Invalid,
                        detail::concat(delta.tokens, " tokens in ", delta.inner_steps,
                                       " inner steps, more than the ", declared->batch, " sequences x ",
                                       declared->context, " tokens per step that learner ", delta.learner_id,
                                       " announced")});
  std::optional<double> norm;
  if (bounds_.max_norm_ratio > 0) {
    const DeltaView view(tensors);
    double squares = 0;
    for (size_t t = 0; t < view.size(); ++t) squares += std::pow(l2_norm(view.tensor(t)), 2);
    norm = std::sqrt(squares);
  }
  if (auto rejected = check(delta, norm)) return record_drop(std::move(*rejected));
  if (norm) {
    norms_.push_back(*norm);
    while (norms_.size() > bounds_.norm_window) norms_.pop_front();
  }

  auto it = pending_.find(delta.learner_id);
  if (it == pending_.end()) {
    const std::string learner = delta.learner_id;
    pending_.emplace(learner, HeldDelta{std::move(delta), std::move(tensors)});
    if (state_ == MergerState::Collecting) {
      if (!first_at_) first_at_ = now;
      if (!quorum_at_ && pending_.size() >= hyper_.quorum) quorum_at_ = now;
    }
    return std::nullopt;
  }
  HeldDelta& held = it->second;
  if (!newer(delta, held.ref))
    return record_drop({std::move(delta), DropReason::Superseded,
                        detail::concat("older than the pending delta (base ", held.ref.base_version,
                                       ", seq ", held.ref.seq, ") of this learner")});
  DroppedDelta replaced = record_drop({std::move(held.ref), DropReason::Superseded,
                                       detail::concat("replaced by seq ", delta.seq,
                                                      " of this learner")});
  held = HeldDelta{std::move(delta), std::move(tensors)};
  return replaced;
}

bool FragmentMerger::poll(double now, std::span<const std::string> live_learners,
                          const GraceWindow& grace) {
  switch (state_) {
    case MergerState::Collecting:
      if (!quorum_at_) return false;
      granted_grace_ = grace.grace(std::max(0.0, *quorum_at_ - first_at_.value_or(*quorum_at_)));
      deadline_ = *quorum_at_ + granted_grace_;
      state_ = MergerState::Grace;
      [[fallthrough]];
    case MergerState::Grace: {
      const bool all_live_pending =
          !live_learners.empty() &&
          std::all_of(live_learners.begin(), live_learners.end(),
                      [&](const std::string& learner) { return pending_.contains(learner); });
      if (now < *deadline_ && !all_live_pending) return false;
      deadline_.reset();
      state_ = MergerState::Merging;
      return true;
    }
    case MergerState::Merging: return taken_.empty();
    case MergerState::Publish: return false;
    case MergerState::Stopped: break;
  }
  throw InternalError(detail::concat("fragment ", fragment_, ": poll after stop"));
}

MergePlan FragmentMerger::take_merge_inputs(double now) {
  expect(MergerState::Merging, "take_merge_inputs");
  if (!taken_.empty())
    throw InternalError(detail::concat("fragment ", fragment_,
                                       ": take_merge_inputs twice for one merge"));
  DILOCO_ENFORCE(!pending_.empty(), "fragment ", fragment_, ": MERGING with nothing pending");
  std::vector<HeldDelta> held;
  merged_base_before_ = merged_base_;
  for (auto& [learner, h] : pending_) {
    weigh(h.ref, version_, hyper_);
    uint64_t& merged = merged_base_[learner];
    merged = std::max(merged, h.ref.base_version);
    held.push_back(std::move(h));
  }
  pending_.clear();
  std::sort(held.begin(), held.end(), [](const HeldDelta& a, const HeldDelta& b) {
    return before(a.ref.position, b.ref.position);
  });

  MergePlan plan;
  plan.version = version_;
  for (auto& h : held) {
    taken_.push_back(h.ref);
    plan.tensors.push_back(std::move(h.tensors));
  }
  for (size_t i = 0; i < held.size(); ++i) plan.inputs.push_back({taken_[i], plan.tensors[i]});
  plan.dropped = std::move(dropped_);
  dropped_.clear();
  merge_started_ = now;
  return plan;
}

std::vector<DroppedDelta> FragmentMerger::merge_committed(uint64_t new_version) {
  expect(MergerState::Merging, "merge_committed");
  if (taken_.empty())
    throw InternalError(detail::concat("fragment ", fragment_,
                                       ": merge_committed before take_merge_inputs"));
  if (new_version != version_ + 1)
    throw InternalError(detail::concat("fragment ", fragment_, ": committed version ",
                                       new_version, " after version ", version_));
  version_ = new_version;
  taken_.clear();
  state_ = MergerState::Publish;

  std::vector<DroppedDelta> dropped;
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (auto rejected = check(it->second.ref)) {
      dropped.push_back(record_drop(std::move(*rejected)));
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
  return dropped;
}

void FragmentMerger::start_round(double now) {
  state_ = MergerState::Collecting;
  // Deltas that arrived during the merge open the next round now.
  first_at_.reset();
  quorum_at_.reset();
  if (!pending_.empty()) first_at_ = now;
  if (pending_.size() >= hyper_.quorum) quorum_at_ = now;
}

double FragmentMerger::published(double now) {
  expect(MergerState::Publish, "published");
  start_round(now);
  return now - merge_started_;
}

std::vector<DroppedDelta> FragmentMerger::merge_abandoned(const std::string& reason, double now) {
  expect(MergerState::Merging, "merge_abandoned");
  if (taken_.empty())
    throw InternalError(detail::concat("fragment ", fragment_,
                                       ": merge_abandoned before take_merge_inputs"));
  merged_base_ = std::move(merged_base_before_);
  std::vector<DroppedDelta> out;
  for (auto& ref : taken_) out.push_back({std::move(ref), DropReason::Invalid, reason});
  taken_.clear();
  start_round(now);
  return out;
}

std::vector<DroppedDelta> FragmentMerger::stop() {
  if (state_ == MergerState::Stopped)
    throw InternalError(detail::concat("fragment ", fragment_, ": stop twice"));
  std::vector<DroppedDelta> out = std::move(dropped_);
  dropped_.clear();
  std::vector<DeltaRef> held;
  for (auto& ref : taken_) held.push_back(std::move(ref));
  for (auto& [learner, h] : pending_) held.push_back(std::move(h.ref));
  std::sort(held.begin(), held.end(),
            [](const DeltaRef& a, const DeltaRef& b) { return before(a.position, b.position); });
  for (auto& ref : held)
    out.push_back({std::move(ref), DropReason::PendingAtStop,
                   detail::concat("pending at version ", version_, " when the merger stopped")});
  taken_.clear();
  pending_.clear();
  deadline_.reset();
  state_ = MergerState::Stopped;
  return out;
}

std::optional<double> FragmentMerger::grace_deadline() const { return deadline_; }

std::vector<LogPosition> FragmentMerger::uncommitted_positions() const {
  std::vector<LogPosition> out;
  for (const auto& [learner, held] : pending_) out.push_back(held.ref.position);
  for (const auto& d : dropped_) out.push_back(d.delta.position);
  return out;
}

}  // namespace diloco
