// The largest message each fragment of a layout makes: its delta, a quantized downlink's update,
// its parameters (FragmentParams snapshots and GenesisProposal, fp32) and its checkpoint
// (FragmentState: parameters and outer momentum, plus a second buffer for dn and cgad and the
// residual of a quantized downlink). Messages travel in chunks of codec.chunk_bytes
// (core/codec/chunk.h), so what must fit one Kafka record (MAX_MESSAGE_BYTES in
// broker_config/limits.env, KafkaOptions::max_message_bytes) is a chunk; a whole message must fit
// one FlatBuffer (2 GiB), since it is built and decoded in one buffer. Checkpoints, snapshots and
// proposals above codec.segment_bytes of values travel streamed, so their largest message is one
// segment; deltas and updates are still whole messages (about 0.53 bytes a parameter with int4:
// some 4 billion parameters a fragment). A networked process checks both at start-up, so a model
// that cannot travel is refused with the numbers and the setting to change instead of failing
// mid-run.
#pragma once

#include <cstdint>
#include <string>

#include "core/codec/messages.h"
#include "core/codec/quantize.h"
#include "core/config/run_config.h"
#include "core/fragments/layout.h"

namespace diloco {

struct MessageBound {
  std::string kind;      // "delta", "update", "parameters" or "checkpoint"
  uint32_t fragment = 0;
  int64_t numel = 0;     // parameters of that fragment
  uint64_t bytes = 0;    // upper bound of the encoded message
};

// Upper bounds of the encoded size (zstd's worst case included) for n values in `tensors` tensors.
uint64_t delta_bytes_bound(int64_t n, size_t tensors, DType dtype, uint32_t block_size);
uint64_t params_bytes_bound(int64_t n, size_t tensors);
uint64_t state_bytes_bound(int64_t n, size_t tensors, bool outer_state, bool residual = false);

// The largest of the three bounds over every fragment of the layout.
MessageBound largest_message(const RunConfig& config, const FragmentLayout& layout);

// What one whole message may take, at most (FlatBuffers' limit of one buffer).
inline constexpr uint64_t kMaxLogicalMessageBytes = (1ull << 31) - (1ull << 20);

// The largest whole message (compressed or not) a reader of this run must accept: the layout's
// largest bound, a whole checkpoint's up to kMaxLogicalMessageBytes (one written whole before
// checkpoints streamed, or with a larger codec.segment_bytes), and never below 64 MiB
// (DecodeLimits::max_message_bytes and max_decompressed_bytes).
uint64_t logical_message_limit(const RunConfig& config, const FragmentLayout& layout);

// What every reader of the run's messages expects: its run id, the layout's fingerprint and
// shapes, and logical_message_limit() for whole messages (compressed and decompressed).
DecodeLimits run_decode_limits(const RunConfig& config, const FragmentLayout& layout);

// Throws InvalidInput, naming the numbers and the setting to change, when a chunk of
// codec.chunk_bytes does not fit a Kafka record of max_record_bytes. Needs no model: a merger
// checks it at start, before any learner told it the layout.
void check_chunk_bytes(const RunConfig& config, uint64_t max_record_bytes);

// check_chunk_bytes, and throws InvalidInput (as it does) when largest_message()
// exceeds kMaxLogicalMessageBytes (more diloco.fragments, or a smaller model when a single tensor
// is too large for any fragment count).
void check_message_sizes(const RunConfig& config, const FragmentLayout& layout, uint64_t max_record_bytes);

}  // namespace diloco
