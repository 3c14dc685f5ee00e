// The largest message each fragment of a layout makes, against the one-message limit of Kafka
// (MAX_MESSAGE_BYTES in broker_config/limits.env, KafkaOptions::max_message_bytes). Every message
// of a fragment travels whole today: its delta, its parameters (FragmentParams, fp32) and its
// checkpoint (FragmentState: parameters and outer momentum, plus a second buffer for dn and cgad).
// A networked process checks this at start-up, so a model that cannot travel is refused with the
// numbers and the setting to change instead of failing mid-run.
#pragma once

#include <cstdint>
#include <string>

#include "core/codec/quantize.h"
#include "core/config/run_config.h"
#include "core/fragments/layout.h"

namespace diloco {

struct MessageBound {
  std::string kind;      // "delta", "parameters" or "checkpoint"
  uint32_t fragment = 0;
  int64_t numel = 0;     // parameters of that fragment
  uint64_t bytes = 0;    // upper bound of the encoded message
};

// Upper bounds of the encoded size (zstd's worst case included) for n values in `tensors` tensors.
uint64_t delta_bytes_bound(int64_t n, size_t tensors, DType dtype, uint32_t block_size);
uint64_t params_bytes_bound(int64_t n, size_t tensors);
uint64_t state_bytes_bound(int64_t n, size_t tensors, bool outer_state);

// The largest of the three bounds over every fragment of the layout.
MessageBound largest_message(const RunConfig& config, const FragmentLayout& layout);

// Throws InvalidInput when largest_message() exceeds max_message_bytes, naming the fragment, its
// size, the bound and the way out (more diloco.fragments, or a larger MAX_MESSAGE_BYTES when a
// single tensor is too large for any fragment count).
void check_message_sizes(const RunConfig& config, const FragmentLayout& layout, uint64_t max_message_bytes);

}  // namespace diloco
