// A learner's bookkeeping for one fragment: the global version it trains on (its base), the
// anchor its deltas are measured from, the error-feedback residual, the counters sent with each
// delta, and whether it waits for a merge. Pure logic on plain values: the learner copies the
// fragment's parameters out of the model before cut() and writes adopt()'s result back into it.
//
// Error feedback. The merger merges at most one delta per learner and base (a later delta on the
// same base contains the earlier one's progress, since both are measured from the same anchor).
// So every cut on one base starts from the residual carried into that base, not from the residual
// of an earlier cut on the same base (that cut is superseded: only one of them is merged).
// On adoption, the residual of the last cut on the old base becomes the carried residual (what
// quantization held back of the progress that went out); if no delta was sent on the old base,
// the carried residual stays as it was (none of it has gone out yet).
//
// Memory. A track holds the anchor (shared with the parameter inbox), the carried residual and,
// after a cut, the parameters at the cut: three values per parameter of its own. The residual
// after the last cut is not kept: at adoption it is computed again from the anchor, the values at
// the cut and the carried residual, with the cut's codec settings (quantization is deterministic,
// so these are the bits the cut left), and a cut or a recomputation works a range of values at a
// time, with no buffer of a whole tensor. With a spill directory the carried residual and the
// values at the cut live in files there (ValueStore), read and written a range at a time and let
// go of after each range: the track then holds one value per parameter in memory, the anchor.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/codec/messages.h"
#include "core/codec/quantize.h"
#include "core/files/value_store.h"

namespace diloco {

// What a cut produced: the quantized outer gradient and the header fields it was measured with.
struct CutDelta {
  uint64_t base_version = 0;
  uint32_t inner_steps = 0;  // on this fragment since the base was adopted
  uint64_t tokens = 0;
  std::vector<QuantizedTensor> tensors;
};

// theta = alpha * local + (1 - alpha) * received, tensor by tensor (Streaming DiLoCo's mixing).
// Throws InvalidInput if the shapes differ.
std::vector<DenseTensor> blend(const std::vector<DenseTensor>& local, const std::vector<DenseTensor>& received,
                               double alpha);

class FragmentTrack {
 public:
  // Everything the track holds but a pending wait: what a learner's saved state keeps of it.
  struct Saved {
    uint64_t version = 0;
    uint64_t checksum = 0;
    std::vector<DenseTensor> anchor;
    std::vector<std::vector<float>> carried;   // residual carried into the base, per tensor
    std::vector<std::vector<float>> last_cut;  // residual after the last cut on the base (empty: none)
    bool sent_on_base = false;
    uint32_t steps = 0;
    uint64_t tokens = 0;
    std::vector<std::vector<float>> cut_point;  // parameters at the last cut on the base (empty: none)
    uint32_t steps_at_cut = 0;
    uint64_t tokens_at_cut = 0;
  };

  // A version's parameters, shared with whoever else holds them (the parameter inbox, which
  // applies the next update to them): the anchor is never written, only replaced.
  using Version = std::shared_ptr<const std::vector<DenseTensor>>;

  FragmentTrack() = default;
  // Starts on `version` whose parameters are `anchor`, with zero residual and counters. With a
  // `spill_dir`, the residual and the values at a cut are kept in files there (see Memory above);
  // IoError when it cannot hold them.
  FragmentTrack(std::vector<DenseTensor> anchor, uint64_t version, uint64_t checksum = 0,
                const std::string& spill_dir = {});
  FragmentTrack(Version anchor, uint64_t version, uint64_t checksum = 0, const std::string& spill_dir = {});

  // One inner step done (every fragment trains at every step).
  void count_step(uint64_t tokens);

  // The outer gradient anchor - current (+ carried residual), quantized (its topk largest values
  // per block when topk > 0); `current` holds the fragment's parameters now, one flat vector per
  // tensor in layout order. Marks the base as carrying this learner's progress. Throws
  // InvalidInput on a tensor count or size mismatch.
  CutDelta cut(std::vector<std::vector<float>> current, DType dtype, uint32_t block_size, uint32_t topk = 0);

  // The model's fragment as it is held: one span per tensor of the fragment, in layout order (the
  // learner's host buffers). adopt_into and rebase_into write the adopted values straight into it.
  using Model = std::vector<std::span<float>>;

  // The same cut read from the model's buffers (only read): the values at the cut are copied a
  // range at a time into the track's store, never whole into memory when it spills.
  CutDelta cut_from(const Model& current, DType dtype, uint32_t block_size, uint32_t topk = 0);

  // Adopts a newer version: it becomes the anchor and base, the counters restart at 0 and a wait
  // for a version above the last cut's base ends. `model` (which holds the local values) is
  // written with what the model's fragment must hold: `received` itself when alpha is 0
  // (overwrite), else blend(local, received, alpha), value by value in place. Throws InvalidInput
  // (and changes nothing) when the sizes differ.
  void adopt_into(uint64_t version, uint64_t checksum, Version received, double alpha, const Model& model);
  // The same on copies: returns what the model's fragment must hold.
  std::vector<DenseTensor> adopt(uint64_t version, uint64_t checksum, std::vector<DenseTensor> received,
                                 double alpha = 0, const std::vector<DenseTensor>& local = {});
  std::vector<DenseTensor> adopt(uint64_t version, uint64_t checksum, Version received, double alpha = 0,
                                 const std::vector<DenseTensor>& local = {});

  // Adoption that keeps this learner's unsent progress (diloco.adopt = "rebase"): the model's
  // fragment becomes received + (local - from), where `from` is the parameters at the last cut on
  // the current base (that progress is in the merge, or on its way to the next one) or, when
  // nothing was cut on the base, the anchor (none of it has gone out: it goes with the next cut,
  // measured from the new anchor). The counters keep the steps and tokens of the kept progress.
  // Otherwise as adopt(). With local equal to the last cut (a synchronous learner that waited
  // right after cutting) it is exactly an overwrite.
  void rebase_into(uint64_t version, uint64_t checksum, Version received, const Model& model);
  // The same on copies: returns what the model's fragment must hold.
  std::vector<DenseTensor> rebase(uint64_t version, uint64_t checksum, std::vector<DenseTensor> received,
                                  std::vector<DenseTensor> local);
  std::vector<DenseTensor> rebase(uint64_t version, uint64_t checksum, Version received,
                                  std::vector<DenseTensor> local);

  // Cut before an overwrite (diloco.cut_on_arrival): true when a version above the base arrives,
  // no delta was sent on the base since it was adopted (so the arriving version cannot contain
  // this learner's progress) and at least `fraction` * H inner steps were done on the base.
  // fraction 0 disables it.
  bool cut_before_adopting(uint64_t arriving_version, double fraction, uint32_t H) const;

  // Synchronous modes (diloco.wait_steps = k >= 0): after a cut on base b at step s, the learner
  // must not start an inner step past s + k until it holds a version above b. True when a wait is
  // pending and `step` (inner steps completed) has reached s + k. give_up_wait() ends it anyway.
  void expect_merge(uint64_t cut_step, int64_t wait_steps);
  bool must_wait(uint64_t step) const;
  void give_up_wait() { awaiting_.reset(); }
  std::optional<uint64_t> awaited_base() const;

  uint64_t version() const { return version_; }
  uint64_t checksum() const { return checksum_; }
  const std::vector<DenseTensor>& anchor() const;
  const Version& anchor_version() const { return anchor_; }
  uint32_t steps() const { return steps_; }
  uint64_t tokens() const { return tokens_; }
  bool sent_on_base() const { return sent_on_base_; }
  // Residual the next cut on the current base starts from (one vector per tensor).
  std::vector<std::vector<float>> carried_residual() const;

  // A copy of everything (the residual after the last cut computed again when not held).
  Saved save() const;
  // Throws InvalidInput when the saved sizes do not agree with its anchor. The residual after the
  // last cut is kept as saved (the codec settings it was cut with are not saved).
  static FragmentTrack restore(Saved saved, const std::string& spill_dir = {});
  bool spilled() const { return carried_.spilled(); }

 private:
  struct Wait {
    uint64_t base = 0;
    uint64_t until_step = 0;  // the learner may complete inner steps up to this count
  };

  // How the latest cut on the base was quantized: what recomputing its residual needs.
  struct CutCodec {
    DType dtype = DType::F32;
    uint32_t block_size = 0;
    uint32_t topk = 0;
  };

  std::string spill_dir_;  // empty: the residual and the values at a cut in memory
  uint64_t version_ = 0;
  uint64_t checksum_ = 0;
  Version anchor_;  // null until a version is held
  ValueStore carried_;                        // residual carried into the current base
  std::vector<std::vector<float>> last_cut_;  // residual after the latest cut, only as restored
  std::optional<CutCodec> cut_codec_;         // set by a cut on the current base
  bool sent_on_base_ = false;
  uint32_t steps_ = 0;
  uint64_t tokens_ = 0;
  ValueStore cut_point_;  // the parameters at the latest cut on the base
  uint32_t steps_at_cut_ = 0;
  uint64_t tokens_at_cut_ = 0;
  std::optional<Wait> awaiting_;

  void check_received(const std::vector<DenseTensor>& received, const Model& model, const char* what) const;
  // The residual the latest cut on the base left, per tensor: `residual` holds the carried one
  // and is overwritten (`store`, when given, is what it spans: its ranges are let go of as done).
  void residual_after_cut(const Model& residual, const ValueStore* store) const;
  // A cut of `current`; `kept` (when given) already holds those values and becomes the cut point.
  CutDelta cut_into(const Model& current, ValueStore* kept, DType dtype, uint32_t block_size, uint32_t topk);
  void start_base(uint64_t version, uint64_t checksum, Version received);
};

}  // namespace diloco
