#include "learner/fragment_track.h"

#include <functional>
#include <span>
#include <utility>

#include "core/errors.h"

namespace diloco {
namespace {

// One value of a blend (Streaming DiLoCo's mixing); blend() and adopt_into() share it.
float blend_value(double alpha, float local, float received) {
  return static_cast<float>(alpha * local + (1 - alpha) * received);
}

// A cut's arithmetic on one tensor, a range at a time: x = (anchor - values) + residual, quantized
// with error feedback (dtype, block_size, topk). With `q` (sized by feedback_result) it is filled and
// `residual` only read; without, `residual` is overwritten with what quantization held back, each
// range quantized on its own (ranges start on whole blocks, so the bits are those of the whole).
constexpr size_t kRangeValues = size_t{1} << 20;

// Called after each range [b, b + len) of a tensor is done (to copy or let go of it).
using AfterRange = std::function<void(size_t b, size_t len)>;

void quantize_progress(std::span<const float> anchor, std::span<const float> values, std::span<float> residual,
                       DType dtype, uint32_t block_size, uint32_t topk, QuantizedTensor* q,
                       const AfterRange& after_range) {
  const size_t n = anchor.size();
  const size_t align = feedback_alignment(dtype, block_size);
  const size_t range = std::max(align, kRangeValues / align * align);
  std::vector<float> delta(std::min(range, n)), kept(q ? std::min(range, n) : 0), scratch;
  for (size_t b = 0; b < n; b += range) {
    const size_t len = std::min(range, n - b);
    for (size_t i = 0; i < len; ++i) delta[i] = anchor[b + i] - values[b + i];
    const std::span<const float> d(delta.data(), len);
    if (q) {  // the carried residual stays as it is: a later cut on this base starts from it again
      std::copy_n(residual.begin() + static_cast<std::ptrdiff_t>(b), len, kept.begin());
      feedback_range(*q, d, std::span<float>(kept.data(), len), {}, b, b + len, scratch, topk);
    } else {
      QuantizedTensor part = feedback_result(0, {static_cast<int64_t>(len)}, dtype, block_size);
      feedback_range(part, d, residual.subspan(b, len), {}, 0, len, scratch, topk);
    }
    if (after_range) after_range(b, len);
  }
}

FragmentTrack::Model spans_of(std::vector<DenseTensor>& tensors) {
  FragmentTrack::Model out;
  for (auto& t : tensors) out.emplace_back(t.values);
  return out;
}

FragmentTrack::Model spans_of(const ValueStore& store) {
  FragmentTrack::Model out;
  for (size_t t = 0; t < store.size(); ++t) out.push_back(store[t]);
  return out;
}

FragmentTrack::Model spans_of(std::vector<std::vector<float>>& vectors) {
  FragmentTrack::Model out;
  for (auto& v : vectors) out.emplace_back(v);
  return out;
}

}  // namespace

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
    for (size_t i = 0; i < v.size(); ++i) v[i] = blend_value(alpha, local[t].values[i], received[t].values[i]);
  }
  return out;
}

FragmentTrack::FragmentTrack(std::vector<DenseTensor> anchor, uint64_t version, uint64_t checksum,
                             const std::string& spill_dir)
    : FragmentTrack(std::make_shared<const std::vector<DenseTensor>>(std::move(anchor)), version, checksum,
                    spill_dir) {}

FragmentTrack::FragmentTrack(Version anchor, uint64_t version, uint64_t checksum, const std::string& spill_dir)
    : spill_dir_(spill_dir), version_(version), checksum_(checksum), anchor_(std::move(anchor)) {
  DILOCO_ENFORCE(anchor_ != nullptr, "FragmentTrack: a null anchor");
  std::vector<size_t> sizes;
  for (const auto& t : *anchor_) sizes.push_back(t.values.size());
  carried_ = ValueStore(sizes, spill_dir_);
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
  const Model spans = spans_of(current);
  if (!spill_dir_.empty()) return cut_into(spans, nullptr, dtype, block_size, topk);
  // Kept, not copied: one fragment's values fewer at a cut (moving the vectors keeps their data).
  ValueStore kept = ValueStore::of(std::move(current), {});
  return cut_into(spans, &kept, dtype, block_size, topk);
}

CutDelta FragmentTrack::cut_from(const Model& current, DType dtype, uint32_t block_size, uint32_t topk) {
  return cut_into(current, nullptr, dtype, block_size, topk);
}

CutDelta FragmentTrack::cut_into(const Model& current, ValueStore* kept, DType dtype, uint32_t block_size,
                                 uint32_t topk) {
  const std::vector<DenseTensor>& anchors = anchor();
  if (current.size() != anchors.size())
    throw InvalidInput(detail::concat("delta: ", current.size(), " tensors, the anchor has ", anchors.size()));
  for (uint32_t t = 0; t < current.size(); ++t)
    if (current[t].size() != anchors[t].values.size())
      throw InvalidInput(detail::concat("delta: tensor ", t, " has ", current[t].size(), " values, the anchor ",
                                        anchors[t].values.size()));
  // The values at the cut: those given (already the current values), or a copy made range by range.
  const bool copy = kept == nullptr;
  ValueStore point;
  if (copy) {
    std::vector<size_t> sizes;
    for (const auto& v : current) sizes.push_back(v.size());
    point = ValueStore(sizes, spill_dir_);
  } else {
    point = std::move(*kept);
  }
  const CutCodec codec{.dtype = dtype, .block_size = block_size, .topk = topk};
  CutDelta out{.base_version = version_, .inner_steps = steps_, .tokens = tokens_, .tensors = {}};
  out.tensors.reserve(current.size());
  // An earlier cut on this base is superseded: start from the carried residual.
  for (uint32_t t = 0; t < current.size(); ++t) {
    QuantizedTensor q = feedback_result(t, anchors[t].shape, dtype, block_size);
    quantize_progress(anchors[t].values, current[t], carried_[t], dtype, block_size, topk, &q,
                      [&](size_t b, size_t len) {
                        if (copy) std::copy_n(current[t].begin() + static_cast<std::ptrdiff_t>(b), len,
                                              point[t].begin() + static_cast<std::ptrdiff_t>(b));
                        point.release(t, b, b + len);
                        carried_.release(t, b, b + len);
                      });
    out.tensors.push_back(std::move(q));
  }
  point.release_all();
  carried_.release_all();
  sent_on_base_ = true;
  last_cut_.clear();
  cut_codec_ = codec;
  cut_point_ = std::move(point);
  steps_at_cut_ = steps_;
  tokens_at_cut_ = tokens_;
  return out;
}

void FragmentTrack::residual_after_cut(const Model& residual, const ValueStore* store) const {
  DILOCO_ENFORCE(cut_codec_ && residual.size() == cut_point_.size(), "no cut to compute the residual of");
  for (size_t t = 0; t < residual.size(); ++t)
    quantize_progress(anchor()[t].values, cut_point_[t], residual[t], cut_codec_->dtype, cut_codec_->block_size,
                      cut_codec_->topk, nullptr, [&](size_t b, size_t len) {
                        cut_point_.release(t, b, b + len);
                        if (store) store->release(t, b, b + len);
                      });
  cut_point_.release_all();
  if (store) store->release_all();
}

void FragmentTrack::check_received(const std::vector<DenseTensor>& received, const Model& model,
                                   const char* what) const {
  if (received.size() != anchor().size())
    throw InvalidInput(detail::concat(what, ": ", received.size(), " tensors, the anchor has ", anchor().size()));
  if (model.size() != received.size())
    throw InvalidInput(detail::concat(what, ": ", model.size(), " local tensors, ", received.size(), " received"));
  for (size_t t = 0; t < model.size(); ++t)
    if (model[t].size() != received[t].values.size() || received[t].values.size() != anchor()[t].values.size())
      throw InvalidInput(detail::concat(what, ": tensor ", t, " has ", model[t].size(), " local values and ",
                                        received[t].values.size(), " received"));
}

// The bookkeeping every adoption shares: the residual carried into the new base (computed while
// the old anchor and the values at the cut are still held), the new anchor and base, and the end
// of a wait for it. Counters are the caller's.
void FragmentTrack::start_base(uint64_t version, uint64_t checksum, Version received) {
  if (sent_on_base_) {
    if (!last_cut_.empty())
      carried_ = ValueStore::of(std::move(last_cut_), spill_dir_);
    else
      residual_after_cut(spans_of(carried_), &carried_);
  }
  last_cut_.clear();
  cut_codec_.reset();
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

void FragmentTrack::rebase_into(uint64_t version, uint64_t checksum, Version received_version, const Model& model) {
  DILOCO_ENFORCE(received_version != nullptr, "rebase: no version");
  const std::vector<DenseTensor>& received = *received_version;
  check_received(received, model, "rebase");
  // received + (local - from), written over the local values.
  for (size_t t = 0; t < model.size(); ++t) {
    const std::span<const float> from = sent_on_base_ ? cut_point_[t] : std::span<const float>(anchor()[t].values);
    const auto& r = received[t].values;
    const std::span<float> v = model[t];
    for (size_t b = 0; b < v.size(); b += kRangeValues) {
      const size_t end = std::min(v.size(), b + kRangeValues);
      for (size_t i = b; i < end; ++i) v[i] = r[i] + (v[i] - from[i]);
      if (sent_on_base_) cut_point_.release(t, b, end);
    }
  }
  cut_point_.release_all();
  if (sent_on_base_) {
    steps_ -= steps_at_cut_;
    tokens_ -= tokens_at_cut_;
  }
  start_base(version, checksum, std::move(received_version));
}

std::vector<DenseTensor> FragmentTrack::rebase(uint64_t version, uint64_t checksum, std::vector<DenseTensor> received,
                                               std::vector<DenseTensor> local) {
  return rebase(version, checksum, std::make_shared<const std::vector<DenseTensor>>(std::move(received)),
                std::move(local));
}

std::vector<DenseTensor> FragmentTrack::rebase(uint64_t version, uint64_t checksum, Version received,
                                               std::vector<DenseTensor> local) {
  rebase_into(version, checksum, std::move(received), spans_of(local));
  return local;
}

void FragmentTrack::adopt_into(uint64_t version, uint64_t checksum, Version received_version, double alpha,
                               const Model& model) {
  DILOCO_ENFORCE(received_version != nullptr, "adopt: no version");
  const std::vector<DenseTensor>& received = *received_version;
  check_received(received, model, "adopt");
  for (size_t t = 0; t < model.size(); ++t) {
    const auto& r = received[t].values;
    const std::span<float> v = model[t];
    if (alpha > 0)
      for (size_t i = 0; i < v.size(); ++i) v[i] = blend_value(alpha, v[i], r[i]);
    else
      std::copy(r.begin(), r.end(), v.begin());
  }
  start_base(version, checksum, std::move(received_version));
  steps_ = 0;
  tokens_ = 0;
}

std::vector<DenseTensor> FragmentTrack::adopt(uint64_t version, uint64_t checksum, std::vector<DenseTensor> received,
                                              double alpha, const std::vector<DenseTensor>& local) {
  return adopt(version, checksum, std::make_shared<const std::vector<DenseTensor>>(std::move(received)), alpha, local);
}

std::vector<DenseTensor> FragmentTrack::adopt(uint64_t version, uint64_t checksum, Version received, double alpha,
                                              const std::vector<DenseTensor>& local) {
  DILOCO_ENFORCE(received != nullptr, "adopt: no version");
  std::vector<DenseTensor> model = alpha > 0 ? local : *received;
  adopt_into(version, checksum, std::move(received), alpha, spans_of(model));
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

std::vector<std::vector<float>> FragmentTrack::carried_residual() const { return carried_.to_vectors(); }

FragmentTrack::Saved FragmentTrack::save() const {
  std::vector<std::vector<float>> last_cut;
  if (sent_on_base_) {
    last_cut = last_cut_.empty() ? carried_.to_vectors() : last_cut_;
    if (last_cut_.empty()) residual_after_cut(spans_of(last_cut), nullptr);
  }
  return Saved{.version = version_, .checksum = checksum_, .anchor = anchor(), .carried = carried_.to_vectors(),
               .last_cut = std::move(last_cut), .sent_on_base = sent_on_base_, .steps = steps_, .tokens = tokens_,
               .cut_point = cut_point_.to_vectors(), .steps_at_cut = steps_at_cut_, .tokens_at_cut = tokens_at_cut_};
}

FragmentTrack FragmentTrack::restore(Saved saved, const std::string& spill_dir) {
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
  FragmentTrack out(std::move(saved.anchor), saved.version, saved.checksum, spill_dir);
  out.carried_ = ValueStore::of(std::move(saved.carried), spill_dir);
  out.last_cut_ = std::move(saved.last_cut);
  out.sent_on_base_ = saved.sent_on_base;
  out.steps_ = saved.steps;
  out.tokens_ = saved.tokens;
  if (!saved.cut_point.empty()) out.cut_point_ = ValueStore::of(std::move(saved.cut_point), spill_dir);
  out.steps_at_cut_ = saved.steps_at_cut;
  out.tokens_at_cut_ = saved.tokens_at_cut;
  return out;
}

}  // namespace diloco
