#include "core/fragments/message_budget.h"

#include <zstd.h>

#include <algorithm>
#include <cmath>

#include "core/codec/chunk.h"
#include "core/codec/messages.h"
#include "core/errors.h"

namespace diloco {

namespace {

// Generous per-message and per-tensor framing (FlatBuffers tables, shapes, header strings), and
// the checkpoint's bookkeeping (consumed offsets, per-learner seqs and bases, recent positions).
constexpr uint64_t kHeaderBytes = 16 << 10;
constexpr uint64_t kTensorBytes = 256;
constexpr uint64_t kStateBookkeepingBytes = 1 << 20;

uint64_t framed(uint64_t payload, size_t tensors, uint64_t extra = 0) {
  const uint64_t raw = payload + tensors * kTensorBytes + kHeaderBytes + extra;
  return ZSTD_compressBound(raw);  // zstd never grows its input by more than this
}

uint64_t mib(uint64_t bytes) { return (bytes + (1 << 20) - 1) >> 20; }

}  // namespace

uint64_t delta_bytes_bound(int64_t n, size_t tensors, DType dtype, uint32_t block_size) {
  const uint64_t scales = 4 * static_cast<uint64_t>(num_blocks(dtype, block_size, n));
  return framed(payload_bytes(dtype, n) + scales, tensors);
}

uint64_t params_bytes_bound(int64_t n, size_t tensors) { return framed(payload_bytes(DType::F32, n), tensors); }

uint64_t state_bytes_bound(int64_t n, size_t tensors, bool outer_state, bool residual) {
  // params and momentum, + dn's or cgad's second buffer, + the quantized downlink's residual
  const uint64_t buffers = 2 + (outer_state ? 1 : 0) + (residual ? 1 : 0);
  return framed(buffers * payload_bytes(DType::F32, n), buffers * tensors, kStateBookkeepingBytes);
}

namespace {

bool keeps_outer_state(const RunConfig& config) {
  const auto kind = parse_outer_optimizer(config.merger.optimizer);
  return kind && has_outer_state(*kind);
}

bool keeps_residual(const RunConfig& config) { return config.codec.downlink_dtype != DType::F32; }

}  // namespace

MessageBound largest_message(const RunConfig& config, const FragmentLayout& layout) {
  const bool outer = keeps_outer_state(config);
  const bool residual = keeps_residual(config);
  // Checkpoints and proposals carry the whole model's list of tensors (schemas/common.fbs
  // ModelLayout): its names and shapes, with FlatBuffers' framing per entry.
  uint64_t layout_bytes = 64;
  for (const auto& t : layout.tensors) layout_bytes += t.name.size() + 8 * t.shape.size() + 32;
  MessageBound largest;
  for (uint32_t p = 0; p < layout.num_fragments(); ++p) {
    const int64_t n = layout.fragment_numel(p);
    const size_t tensors = layout.fragments[p].size();
    // A checkpoint, a snapshot or a proposal above codec.segment_bytes of values travels
    // streamed: its largest message is a segment (core/codec/messages.h).
    const uint64_t buffers = 2 + (outer ? 1 : 0) + (residual ? 1 : 0);
    const uint64_t state_values = buffers * payload_bytes(DType::F32, n);
    const uint64_t checkpoint =
        state_values <= config.codec.segment_bytes
            ? state_bytes_bound(n, tensors, outer, residual)
            : framed(config.codec.segment_bytes, buffers * tensors, kStateBookkeepingBytes);
    const uint64_t parameters = payload_bytes(DType::F32, n) <= config.codec.segment_bytes
                                    ? params_bytes_bound(n, tensors)
                                    : framed(config.codec.segment_bytes, tensors);
    // Deltas and a quantized downlink's updates travel whole.
    const uint64_t update =
        residual ? delta_bytes_bound(n, tensors, config.codec.downlink_dtype, config.codec.downlink_block_size) : 0;
    const MessageBound candidates[] = {
        {"delta", p, n, delta_bytes_bound(n, tensors, config.codec.dtype, config.codec.block_size)},
        {"update", p, n, update},
        {"parameters", p, n, parameters + layout_bytes},
        {"checkpoint", p, n, checkpoint + layout_bytes},
    };
    for (const auto& c : candidates)
      if (c.bytes > largest.bytes) largest = c;
  }
  return largest;
}

uint64_t logical_message_limit(const RunConfig& config, const FragmentLayout& layout) {
  // Checkpoints written whole by binaries that predate streaming (or with a larger
  // codec.segment_bytes) stay readable: up to what one FlatBuffer holds.
  uint64_t whole_checkpoint = 0;
  for (uint32_t p = 0; p < layout.num_fragments(); ++p)
    whole_checkpoint = std::max(whole_checkpoint, state_bytes_bound(layout.fragment_numel(p), layout.fragments[p].size(),
                                                                    keeps_outer_state(config), keeps_residual(config)));
  return std::max({uint64_t{64} << 20, largest_message(config, layout).bytes,
                   std::min(whole_checkpoint, kMaxLogicalMessageBytes)});
}

DecodeLimits run_decode_limits(const RunConfig& config, const FragmentLayout& layout) {
  const uint64_t limit = logical_message_limit(config, layout);
  return DecodeLimits{.run_id = config.run.id, .fingerprint = layout.fingerprint, .layout = &layout,
                      .max_message_bytes = limit, .max_decompressed_bytes = limit};
}

void check_chunk_bytes(const RunConfig& config, uint64_t max_record_bytes) {
  const uint64_t chunk = config.codec.chunk_bytes;
  if (chunk + kChunkOverhead > max_record_bytes)
    throw InvalidInput("codec.chunk_bytes is " + std::to_string(chunk) + " bytes: with " +
                       std::to_string(kChunkOverhead) + " bytes of chunk framing a record can reach " +
                       std::to_string(chunk + kChunkOverhead) + " bytes, above the " + std::to_string(max_record_bytes) +
                       "-byte limit of one Kafka record (MAX_MESSAGE_BYTES in broker_config/limits.env, " +
                       std::to_string(mib(max_record_bytes)) + " MiB): lower codec.chunk_bytes to at most " +
                       std::to_string(max_record_bytes > kChunkOverhead ? max_record_bytes - kChunkOverhead : 0) +
                       " or raise MAX_MESSAGE_BYTES");
}

void check_message_sizes(const RunConfig& config, const FragmentLayout& layout, uint64_t max_record_bytes) {
  check_chunk_bytes(config, max_record_bytes);
  const MessageBound largest = largest_message(config, layout);
  if (largest.bytes <= kMaxLogicalMessageBytes) return;
  int64_t total = 0;
  for (const auto& fragment : layout.fragments)
    for (const auto& t : fragment) total += t.numel();
  // The largest whole message is a delta or an update (checkpoints, snapshots and proposals
  // travel streamed): its bytes per parameter, from a large fragment's bound, say how many
  // fragments bring it under one buffer. The largest fragment holds at least total / P parameters,
  // and tensors larger than a fragment are cut into blocks of rows (core/fragments/partition.h).
  const double per_param = static_cast<double>(largest.bytes) / static_cast<double>(std::max<int64_t>(largest.numel, 1));
  const uint64_t usable = kMaxLogicalMessageBytes - (1u << 20);
  const uint64_t at_least = std::max<uint64_t>(
      layout.num_fragments() + 1,
      static_cast<uint64_t>(std::ceil(static_cast<double>(total) * per_param / static_cast<double>(usable))));
  throw InvalidInput("fragment " + std::to_string(largest.fragment) + " has " + std::to_string(largest.numel) +
                     " parameters: its " + largest.kind + " message can reach " + std::to_string(largest.bytes) +
                     " bytes (" + std::to_string(mib(largest.bytes)) + " MiB), above the " +
                     std::to_string(kMaxLogicalMessageBytes) + "-byte limit of one message (" +
                     std::to_string(mib(kMaxLogicalMessageBytes)) + " MiB, what one FlatBuffer can hold; it travels in " +
                     "chunks of codec.chunk_bytes, but is built and decoded whole: only checkpoints, snapshots and "
                     "proposals travel streamed); set diloco.fragments to at least " + std::to_string(at_least) +
                     " (now " + std::to_string(layout.num_fragments()) + ")" +
                     (largest.kind == "delta" && config.codec.dtype != DType::INT4
                          ? ", or send smaller deltas (codec.dtype = \"int4\")"
                          : ""));
}

}  // namespace diloco
