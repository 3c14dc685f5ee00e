// The merger's writes to the durable logs (`merges` and `state`). Every write is part of a Kafka
// transaction that also commits the merger group's consumed offsets, so an instance fenced by a
// newer one with the same transactional id commits nothing (KIP-447): genesis checkpoints, each
// merge (record, and every checkpoint_every versions the fragment's checkpoint) and the records
// of a clean stop. Callers encode and compress everything first, so the transaction covers only
// the produce and commit round trips (and the framing of a checkpoint's pieces, a copy); its
// timeout grows with the bytes the largest transaction writes (transaction_timeout_ms below), so
// a large checkpoint over a slow link to the broker still commits.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/codec/chunk.h"
#include "core/codec/messages.h"
#include "core/kafka/consumer.h"
#include "core/kafka/producer.h"
#include "merger/merger_process.h"

namespace diloco {

struct LogWrite {
  std::string topic;
  int32_t partition = 0;
  std::string key;
  std::vector<uint8_t> value;
  // Set for a message that may be larger than a chunk (a checkpoint): `value` goes out as the
  // pieces of core/codec/chunk.h, built one at a time as they are produced (keys "<key>/<i>"
  // when there is more than one), so they never exist all at once beside the message.
  std::optional<ChunkId> chunk_id;
  uint64_t chunk_bytes = 0;
  // The pieces this key's previous value went out in (0: none, or not known). The keys of those
  // pieces this write does not overwrite get tombstones in the same transaction: the topic is
  // compacted by key, so a piece of a checkpoint that shrank would stay forever.
  uint64_t replaces_pieces = 0;
  // Set instead of `value` for a streamed checkpoint (core/codec/messages.h): called inside the
  // transaction, it encodes the segments one at a time and hands each to the sink, which sends it
  // as `value` would be sent (pieces of chunk_bytes under chunk_id). Its records are keyed
  // "<key>/<r>", r counting every record of the checkpoint, so compaction and the tombstones of
  // `replaces_pieces` treat them as the pieces of one message.
  std::function<void(const SegmentSink&)> segments;
};

// The keys of a value's earlier pieces (`before` of them) that a value of `now` pieces leaves
// behind: "<key>/<i>" for i >= now (or every one when `now` is 1, written under "<key>"), and
// "<key>" when the earlier value was whole and the new one is in pieces.
std::vector<std::string> stale_piece_keys(const std::string& key, uint64_t before, uint64_t now);

// The broker's default transaction.max.timeout.ms: a producer may not ask for more.
inline constexpr int kMaxTransactionTimeoutMs = 900000;

// The transaction timeout for transactions of up to `bytes`: `base_seconds` for the round trips,
// plus the time to write `bytes` at `min_bytes_per_s` (the slowest write rate to the broker the
// merger must tolerate), at most kMaxTransactionTimeoutMs.
int transaction_timeout_ms(uint64_t bytes, double base_seconds, double min_bytes_per_s);

// The bytes of the largest transaction a merger of `layout` writes: a clean stop writes the
// checkpoint of every fragment it owns, and one merger may own them all. A checkpoint holds the
// parameters, the momentum, the downlink residual (`residual`) and the outer state (`outer_state`),
// fp32 each (an upper bound: zstd only makes them smaller).
uint64_t largest_transaction_bytes(const FragmentLayout& layout, bool residual, bool outer_state);

class LogWriter {
 public:
  // Creates the transactional producer and initialises transactions, which fences any older
  // instance with the same transactional id. `on_failed_delivery` is told about a write Kafka
  // refused (the transaction cannot commit then; the merger rebuilds from the logs).
  // `fail_commit_at` > 0 makes that merge commit (see commit's `merge`) throw after its writes are
  // produced: fault injection for tests (MergerFaults); `on_injected_fault` is told just before.
  // `transaction_timeout_ms`: the broker aborts a transaction open longer (the produce, commit and
  // record acknowledgement waits are at least as long).
  LogWriter(const KafkaOptions& kafka, const std::string& transactional_id, const MergerTimeouts& timeouts,
            int transaction_timeout_ms, int fail_commit_at, std::function<void()> on_failed_delivery,
            std::function<void()> on_injected_fault = {});

  int transaction_timeout_ms() const { return transaction_timeout_ms_; }
  // The records each write of the last commit went out in (parallel to its `writes`).
  const std::vector<uint64_t>& records_written() const { return records_written_; }

  // One transaction: `writes` in order, then `offsets` of `consumer`'s group. Returns the log
  // position of writes[0] once Kafka acknowledged it (within record_ack_ms), else nullopt.
  // `merge`: a merge commit, the kind fault injection counts. Throws Error (the transaction is
  // left open: call abort()) or Fenced.
  std::optional<LogPosition> commit(std::span<const LogWrite> writes, const std::vector<TopicPartitionOffset>& offsets,
                                    Consumer& consumer, bool merge = false);

  // Aborts an open transaction after a failed commit. Nothing open, or a broker away, is not an
  // error (recovery waits for the broker); Fenced is rethrown.
  void abort();

 private:
  MergerTimeouts t_;
  const int transaction_timeout_ms_;
  const int fail_commit_at_;
  int merge_commits_ = 0;
  std::function<void()> on_failed_delivery_;
  std::function<void()> on_injected_fault_;
  std::map<uint64_t, DeliveryReport> delivered_;  // token -> report, for the open transaction
  uint64_t next_token_ = 1;
  std::unique_ptr<Producer> producer_;
  std::vector<uint64_t> records_written_;
};

}  // namespace diloco
