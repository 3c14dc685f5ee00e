// Kafka consumer adapter: a consumer-group member (range assignor, so co-partitioned topics are
// assigned together; manual offset commits; read_committed), or a group-less reader that assigns
// partitions itself (replay, start-up reads of the state topic).
//
// Threading: one thread owns a Consumer; rebalance callbacks run on it inside poll().
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/kafka/options.h"

namespace RdKafka {
class KafkaConsumer;
}

namespace diloco {

struct DecodeLimits;
struct ChunkProblem;
using OnChunkProblem = std::function<void(const ChunkProblem&)>;

struct ConsumerOptions {
  KafkaOptions kafka;
  std::string group_id;  // empty: no group (use assign())
  // Static membership (KIP-345): a process that joins under the instance id of one that died
  // takes its partitions at once, without waiting for the session timeout or a rebalance of the
  // others. A static member does not leave the group when it closes: its partitions move to the
  // others when the session times out. Empty: a dynamic member.
  std::string group_instance_id;
  // Subscription: names, or regular expressions starting with '^' (librdkafka syntax).
  std::vector<std::string> topics;
  bool read_committed = true;
  std::string auto_offset_reset = "earliest";
  int session_timeout_ms = 10000;
  int max_poll_interval_ms = 300000;
  int metadata_refresh_ms = 10000;  // how soon a new matching topic is noticed
  // assign() fetches a topic's metadata before its first assignment (once per topic): assigned
  // without it, the first fetch waits for the next metadata refresh, about 1 s.
  int assign_metadata_ms = 5000;
  std::string assignor = "range";
};

struct ConsumedMessage {
  std::string topic;
  int32_t partition = -1;
  int64_t offset = -1;
  int64_t timestamp_ms = 0;
  std::string key;
  std::vector<uint8_t> value;
  Headers headers;
  bool tombstone = false;  // null value (compacted topics)
  // A chunked message (core/kafka/chunk_assembler.h) is handed on whole at the position of its
  // first piece, with `value` the reassembled message and `last_offset` its last piece's offset
  // (for a plain record: its own offset).
  int64_t last_offset = -1;
  uint32_t pieces = 1;  // how many pieces it came in
  int64_t end() const { return last_offset < offset ? offset : last_offset; }
};

// Called on the polling thread when the group moves partitions.
struct RebalanceListener {
  virtual ~RebalanceListener() = default;
  virtual void on_assigned(const std::vector<TopicPartitionOffset>& partitions) = 0;
  virtual void on_revoked(const std::vector<TopicPartitionOffset>& partitions) = 0;
};

class Consumer {
 public:
  explicit Consumer(ConsumerOptions options, RebalanceListener* listener = nullptr);
  ~Consumer();
  Consumer(const Consumer&) = delete;
  Consumer& operator=(const Consumer&) = delete;

  // One message, or nothing within timeout_ms. Partition-end events are swallowed (see
  // at_end()). Throws Unavailable / Error on fatal consumer errors.
  std::optional<ConsumedMessage> poll(int timeout_ms);

  // Synchronous commit of explicit offsets (next offset to read).
  void commit(const std::vector<TopicPartitionOffset>& offsets);
  std::vector<TopicPartitionOffset> committed(const std::vector<TopicPartitionOffset>& partitions,
                                              int timeout_ms);

  // Moves every assigned partition back to the group's committed offset (auto_offset_reset where
  // none is committed yet), dropping what was fetched beyond it: after in-memory state that
  // consumed messages is thrown away, they are read again. Throws Unavailable when the committed
  // offsets cannot be fetched or a seek fails.
  void rewind_to_committed(int timeout_ms);
  // Group-less reading: assign exactly these partitions at these offsets (-2 = beginning). The
  // first assignment of a topic asks for its metadata first: throws InvalidInput if the topic is
  // missing, Unavailable if no broker answers within assign_metadata_ms.
  void assign(const std::vector<TopicPartitionOffset>& partitions);
  // Group-less reading: nothing assigned, nothing fetched (what was fetched is dropped).
  void unassign();
  std::vector<TopicPartitionOffset> assignment();
  // True once every assigned partition reported its end (the last stable offset for
  // read_committed) since the last assign().
  bool at_end() const;

  // Partition count of a topic (metadata request); throws InvalidInput if the topic is missing.
  int partition_count(const std::string& topic, int timeout_ms);
  // Every topic on the cluster with its partition count (one metadata request).
  std::vector<std::pair<std::string, int>> list_topics(int timeout_ms);
  // (low, high) watermarks, asked of the partition leader (blocks up to timeout_ms).
  std::pair<int64_t, int64_t> watermarks(const std::string& topic, int32_t partition, int timeout_ms);
  // One attempt of watermarks(): a longer wait is spent on a broker that may no longer lead.
  static constexpr int kWatermarkAttemptMs = 1000;
  // The high watermark from the last fetch response of an assigned partition, without asking the
  // broker (never blocks); nullopt before the first fetch. What a process in a poll loop reads:
  // a broker round trip per partition in that loop stalls it.
  std::optional<int64_t> cached_high_watermark(const std::string& topic, int32_t partition);
  // The first offset of the partition whose timestamp is at or after `ms` (broker timestamps),
  // or nullopt when there is none. Throws Unavailable when the broker does not answer.
  std::optional<int64_t> offset_at_time(const std::string& topic, int32_t partition, int64_t ms, int timeout_ms);

  RdKafka::KafkaConsumer& raw() { return *consumer_; }
  const ConsumerOptions& options() const { return options_; }

 private:
  struct Callbacks;
  ConsumerOptions options_;
  std::unique_ptr<Callbacks> callbacks_;
  std::unique_ptr<RdKafka::KafkaConsumer> consumer_;
  size_t assigned_count_ = 0;
  std::set<std::string> known_topics_;  // topics whose metadata assign() has fetched
  std::vector<std::pair<std::string, int32_t>> ended_;
};


}  // namespace diloco
