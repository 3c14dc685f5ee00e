// Group-less reading of a run's logs: partitions up to their end, offset ranges, or messages at
// given positions. Recovery, diloco-replay and start-up reads go through one LogReader per
// process (or per command), which re-assigns its one consumer for every read: a read costs its
// fetches, not a new client (its connections, metadata requests and threads), which is what
// recovering a fragment record by record used to pay per record.
//
// Between reads nothing stays assigned, so an idle reader fetches nothing and holds nothing.
// Threading: one thread uses a LogReader at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/kafka/consumer.h"

namespace diloco {

// Offsets [begin, end) of one partition.
struct OffsetRange {
  std::string topic;
  int32_t partition = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

// A partition with a transaction still open: read_committed readers see its end at `stable`
// (the last stable offset), short of the log's high watermark.
struct UnstablePartition {
  std::string topic;
  int32_t partition = 0;
  int64_t stable = 0;
  int64_t high = 0;
};

class LogReader {
 public:
  explicit LogReader(const KafkaOptions& options);
  LogReader(const LogReader&) = delete;
  LogReader& operator=(const LogReader&) = delete;

  // Every committed message of the partitions from their offsets (-2: beginning) up to their
  // end as of the call. With `chunks` (the run's limits), chunked messages are handed on whole at
  // their first piece and what does not reassemble goes to `on_problem`. Throws Unavailable when
  // no message arrives for timeout_ms (time spent in on_message not counted): a long log that
  // keeps arriving is read whatever it takes in all.
  void read_to_end(const std::vector<TopicPartitionOffset>& starts,
                   const std::function<void(const ConsumedMessage&)>& on_message, int timeout_ms,
                   const DecodeLimits* chunks = nullptr, const OnChunkProblem& on_problem = {});

  // The committed messages at exactly these positions (missing ones are absent). With `chunks`,
  // a position naming the first piece of a chunked message gives the whole message. Throws
  // Unavailable when no message arrives for timeout_ms.
  std::vector<ConsumedMessage> fetch(const std::vector<TopicPartitionOffset>& positions, int timeout_ms,
                                     const DecodeLimits* chunks = nullptr);

  // The committed messages of each range, in offset order per partition. Throws Unavailable when
  // no message arrives for timeout_ms while some range is unfinished.
  void read_ranges(const std::vector<OffsetRange>& ranges,
                   const std::function<void(const ConsumedMessage&)>& on_message, int timeout_ms);

  // (low, high) watermarks, asked of the partition leader.
  std::pair<int64_t, int64_t> watermarks(const std::string& topic, int32_t partition, int timeout_ms);
  // Every topic on the cluster with its partition count (one metadata request).
  std::vector<std::pair<std::string, int>> list_topics(int timeout_ms);
  // Partition count of a topic; throws InvalidInput if the topic is missing.
  int partition_count(const std::string& topic, int timeout_ms);
  // The first offset of the partition whose timestamp is at or after `ms` (broker timestamps),
  // or nullopt when there is none.
  std::optional<int64_t> offset_at_time(const std::string& topic, int32_t partition, int64_t ms, int timeout_ms);

  // Waits until no transaction is open on any of `partitions` (offsets ignored): the last stable
  // offset has reached the high watermark. A reader that must see a log's final committed state
  // calls this first: commit_transaction returns before the commit markers are written, and an
  // instance killed mid-transaction holds the last stable offset back until the broker aborts its
  // transaction. Returns the partitions still unstable at the deadline (empty: all stable). The
  // high watermarks come from a second, read_uncommitted consumer made at the first call.
  std::vector<UnstablePartition> wait_until_stable(const std::vector<TopicPartitionOffset>& partitions, int timeout_ms);

  // Reads served so far, all by the same consumer.
  uint64_t reads() const { return reads_; }

 private:
  class Assignment;
  Consumer consumer_;
  std::unique_ptr<Consumer> uncommitted_;  // wait_until_stable's view of the log's end
  uint64_t reads_ = 0;
};

// One-shot reads for a process that reads a log once (start-up reads of `members`, a test):
// each makes a LogReader of its own. A process that reads again and again keeps one LogReader.
void read_partitions_to_end(const KafkaOptions& options, const std::vector<TopicPartitionOffset>& starts,
                            const std::function<void(const ConsumedMessage&)>& on_message, int timeout_ms,
                            const DecodeLimits* chunks = nullptr, const OnChunkProblem& on_problem = {});
std::vector<ConsumedMessage> fetch_positions(const KafkaOptions& options,
                                             const std::vector<TopicPartitionOffset>& positions, int timeout_ms,
                                             const DecodeLimits* chunks = nullptr);
// Every partition of `topics` from the beginning to its end as of the call.
void read_to_end(const KafkaOptions& options, const std::vector<std::string>& topics,
                 const std::function<void(const ConsumedMessage&)>& on_message, int timeout_ms,
                 const DecodeLimits* chunks = nullptr, const OnChunkProblem& on_problem = {});
// The same through a reader that is kept.
void read_to_end(LogReader& reader, const std::vector<std::string>& topics,
                 const std::function<void(const ConsumedMessage&)>& on_message, int timeout_ms,
                 const DecodeLimits* chunks = nullptr, const OnChunkProblem& on_problem = {});

}  // namespace diloco
