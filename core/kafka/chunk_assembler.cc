#include "core/kafka/chunk_assembler.h"

#include <xxhash.h>

namespace diloco {

namespace {

LogPosition position_of(const ConsumedMessage& m) { return {m.topic, m.partition, m.offset}; }

}  // namespace

ChunkAssembler::ChunkAssembler(DecodeLimits limits, std::function<bool(const ConsumedMessage&)> start_filter)
    : limits_(std::move(limits)), start_filter_(std::move(start_filter)) {}

ChunkProblem ChunkAssembler::incomplete(const Open& open, const std::string& why) const {
  return {position_of(open.head), RejectReason::ChunkMissing,
          "chunked message " + std::to_string(open.message) + " of " + open.stream + " (fragment " + std::to_string(open.fragment) +
              "): " + std::to_string(open.arrived) + " of " + std::to_string(open.count) + " pieces arrived, " + why,
          0};
}

ChunkAssembler::Result ChunkAssembler::add(ConsumedMessage record, double now) {
  Result result;
  if (record.tombstone || !is_chunk(record.value)) {
    record.last_offset = record.offset;
    result.message = std::move(record);
    return result;
  }
  const LogPosition at = position_of(record);
  ChunkPiece piece;
  try {
    piece = decode_chunk(record.value, limits_);
  } catch (const Rejection& e) {
    if (!start_filter_) result.problems.push_back({at, e.reason, e.what(), record.value.size()});
    return result;
  }
  const Key key{record.topic, record.partition, piece.stream, piece.fragment};
  auto it = open_.find(key);
  if (it != open_.end() && it->second.message != piece.message) {
    // Pieces of one stream come in order: its next message means the open one will never end.
    if (it->second.collect && !start_filter_)
      result.problems.push_back(incomplete(it->second, "then message " + std::to_string(piece.message) +
                                                           " of the same sender started at " + describe(at)));
    open_.erase(it);
    it = open_.end();
  }
  if (it == open_.end()) {
    Open open;
    open.message = piece.message;
    open.stream = piece.stream;
    open.fragment = piece.fragment;
    open.count = piece.count;
    open.total_bytes = piece.total_bytes;
    open.checksum = piece.checksum;
    open.collect = !start_filter_ || (piece.index == 0 && start_filter_(record));
    open.head = record;
    open.head.value.clear();
    it = open_.emplace(key, std::move(open)).first;
  }
  Open& open = it->second;
  open.last_seen = now;
  if (!open.collect) return result;
  if (piece.count != open.count || piece.total_bytes != open.total_bytes || piece.checksum != open.checksum) {
    result.problems.push_back({at, RejectReason::ChunkMismatch,
                               "piece " + std::to_string(piece.index) + " of message " + std::to_string(piece.message) +
                                   " says " + std::to_string(piece.count) + " pieces, " +
                                   std::to_string(piece.total_bytes) + " bytes; its first piece at " +
                                   describe(position_of(open.head)) + " said " + std::to_string(open.count) + ", " +
                                   std::to_string(open.total_bytes),
                               record.value.size()});
    return result;
  }
  if (open.pieces.count(piece.index)) {
    result.problems.push_back({at, RejectReason::ChunkDuplicate,
                               "piece " + std::to_string(piece.index) + " of message " + std::to_string(piece.message) +
                                   " arrived again (first piece at " + describe(position_of(open.head)) + ")",
                               record.value.size()});
    return result;
  }
  if (open.bytes + piece.data.size() > open.total_bytes) {
    result.problems.push_back({at, RejectReason::ChunkMismatch,
                               "piece " + std::to_string(piece.index) + " of message " + std::to_string(piece.message) +
                                   " overflows the message's " + std::to_string(open.total_bytes) + " bytes",
                               record.value.size()});
    return result;
  }
  open.bytes += piece.data.size();
  open.pieces.emplace(piece.index, std::move(piece.data));
  if (++open.arrived < open.count) return result;

  ConsumedMessage whole = std::move(open.head);
  whole.last_offset = record.offset;
  whole.pieces = open.count;
  whole.value.clear();
  whole.value.reserve(open.bytes);  // what arrived (at most total_bytes, which a piece only declares)
  for (auto& piece_data : open.pieces) {
    whole.value.insert(whole.value.end(), piece_data.second.begin(), piece_data.second.end());
    std::vector<uint8_t>().swap(piece_data.second);
  }
  const uint64_t message = open.message;
  const uint64_t checksum = open.checksum;
  const uint64_t total = open.total_bytes;
  open_.erase(it);
  if (whole.value.size() != total || XXH64(whole.value.data(), whole.value.size(), 0) != checksum) {
    result.problems.push_back({position_of(whole), RejectReason::ChunkMismatch,
                               "the pieces of message " + std::to_string(message) + " (" + describe(position_of(whole)) +
                                   " to offset " + std::to_string(record.offset) +
                                   ") do not reassemble to its size and checksum: a piece of another message is mixed in",
                               0});
    return result;
  }
  result.message = std::move(whole);
  return result;
}

std::vector<ChunkProblem> ChunkAssembler::expire(double before) {
  std::vector<ChunkProblem> out;
  for (auto it = open_.begin(); it != open_.end();) {
    if (it->second.last_seen < before) {
      if (it->second.collect && !start_filter_) out.push_back(incomplete(it->second, "and no piece came for too long"));
      it = open_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

std::vector<ChunkProblem> ChunkAssembler::finish() {
  std::vector<ChunkProblem> out;
  for (const auto& [key, open] : open_)
    if (open.collect && !start_filter_) out.push_back(incomplete(open, "then the log ended"));
  open_.clear();
  return out;
}

std::vector<LogPosition> ChunkAssembler::open_heads() const {
  std::vector<LogPosition> out;
  for (const auto& [key, open] : open_)
    if (open.collect) out.push_back(position_of(open.head));
  return out;
}

uint64_t ChunkAssembler::open_bytes() const {
  uint64_t total = 0;
  for (const auto& [key, open] : open_) total += open.bytes;
  return total;
}

}  // namespace diloco
