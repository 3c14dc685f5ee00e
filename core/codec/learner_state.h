// A learner's saved local progress (schemas/learner_state.fbs): what learner/runtime.h
// save_state() returns and load_state() takes. Decoding is strict like every message's: a saved
// state of another run, model or learner, or corrupt bytes, are refused with a reason.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/codec/messages.h"

namespace diloco {

struct SavedFragment {
  uint32_t fragment = 0;
  uint64_t version = 0;
  uint64_t checksum = 0;
  std::vector<DenseTensor> anchor;
  std::vector<std::vector<float>> carried, last_cut, cut_point;  // per tensor (last_cut, cut_point may be empty)
  bool sent_on_base = false;
  uint32_t steps = 0;
  uint64_t tokens = 0;
  uint32_t steps_at_cut = 0;
  uint64_t tokens_at_cut = 0;
  uint64_t seq = 0;
};

struct SavedLearner {
  std::string run_id;
  uint64_t fingerprint = 0;
  std::string learner_id;
  uint64_t step = 0;
  uint64_t tokens = 0;
  std::vector<SavedFragment> fragments;
};

std::vector<uint8_t> encode_learner_state(const SavedLearner& state);
// Checks the run id and fingerprint against `limits` (whose layout gives every shape), one entry
// per fragment saved (at least one, each a fragment of the layout, once), finite values. Throws
// Rejection.
SavedLearner decode_learner_state(std::span<const uint8_t> bytes, const DecodeLimits& limits);

}  // namespace diloco
