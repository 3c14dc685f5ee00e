// Puts chunked messages (core/codec/chunk.h) back together from records read in log order.
// Pieces of different messages may interleave in a partition (several learners write it); the
// pieces of one message (stream, fragment, message id) come in order from one producer. A
// message is handed on only when every piece is there and the whole size and xxh64 match: never
// a partial message. Everything else is a ChunkProblem with a typed reason and the position it
// concerns, for the caller to record (the merger writes them to `rejected`):
//   - a piece that fails strict decoding                     -> its reason, at the piece
//   - a piece that arrives twice                             -> ChunkDuplicate, at the repeat
//   - a piece whose count, size or checksum differs from its message's first piece
//                                                            -> ChunkMismatch, at the piece
//   - pieces that reassemble to other bytes (a piece of another message mixed in)
//                                                            -> ChunkMismatch, at the first piece
//   - a message left incomplete: the same stream starts its next message in the partition
//     (a producer that died mid-message), it expired, or the read ended  -> ChunkMissing, at the
//     first piece seen.
// Records that are not pieces pass through unchanged. No I/O, no clock (times are passed in).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core/codec/chunk.h"
#include "core/kafka/consumer.h"

namespace diloco {

struct ChunkProblem {
  LogPosition position;
  RejectReason reason = RejectReason::ChunkMissing;
  std::string detail;
  size_t payload_size = 0;  // of the record at `position`
};

class ChunkAssembler {
 public:
  // `limits`: run id, and max_message_bytes bounds a whole message. `start_filter`, when set,
  // decides from its first piece whether a message is collected at all; pieces of messages it
  // turned down, and of messages whose first piece was never seen, are then ignored silently
  // (a reader after a few named messages, not an auditor of the whole log).
  explicit ChunkAssembler(DecodeLimits limits, std::function<bool(const ConsumedMessage&)> start_filter = {});

  struct Result {
    std::optional<ConsumedMessage> message;  // a whole message, or a record that is no piece
    std::vector<ChunkProblem> problems;
  };
  // One record, in log order within its partition. `now` dates the message's latest piece.
  Result add(ConsumedMessage record, double now = 0);

  // Gives up the messages whose latest piece came before `before`.
  std::vector<ChunkProblem> expire(double before);
  // Gives up every incomplete message (the end of a read).
  std::vector<ChunkProblem> finish();
  // Forgets everything (a consumer rewound or reassigned).
  void clear() { open_.clear(); }
  // New bounds for the pieces that arrive from now on (a reader that learns the run's layout
  // tightens its bound on a whole message); messages being put together are kept.
  void set_limits(DecodeLimits limits) { limits_ = std::move(limits); }

  // First-piece positions of the incomplete messages: a consumer offset must not be committed
  // past them, or a restart would read only their tails.
  std::vector<LogPosition> open_heads() const;
  // Messages collected but not complete, and their bytes so far.
  size_t open_messages() const { return open_.size(); }
  uint64_t open_bytes() const;

 private:
  struct Open {
    uint64_t message = 0;
    std::string stream;
    uint32_t fragment = 0;
    uint32_t count = 0;
    uint64_t total_bytes = 0;
    uint64_t checksum = 0;
    bool collect = true;                   // false: turned down by the filter
    ConsumedMessage head;                  // first piece seen (value cleared)
    // The pieces arrived, by index: memory for what arrived only, never for the count a piece
    // declares (up to kMaxChunks: sized up front, one small record would cost 24 MiB).
    std::map<uint32_t, std::vector<uint8_t>> pieces;
    uint32_t arrived = 0;
    uint64_t bytes = 0;
    double last_seen = 0;
  };
  using Key = std::tuple<std::string, int32_t, std::string, uint32_t>;  // topic, partition, stream, fragment

  ChunkProblem incomplete(const Open& open, const std::string& why) const;

  DecodeLimits limits_;
  std::function<bool(const ConsumedMessage&)> start_filter_;
  std::map<Key, Open> open_;
};

}  // namespace diloco
