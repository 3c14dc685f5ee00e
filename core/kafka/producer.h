// Kafka producer adapter: idempotent, acks=all, explicit partition, plain-text headers, a bounded
// local queue and asynchronous delivery reports. With a transactional id it also runs Kafka
// transactions (exactly-once merge commits, ARCHITECTURE.md section 6).
//
// Threading: one thread drives a Producer (produce, poll, flush, transactions); delivery
// callbacks run on that thread inside poll()/flush().
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/kafka/options.h"

namespace RdKafka {
class Producer;
class KafkaConsumer;
}  // namespace RdKafka

namespace diloco {

struct ProducerOptions {
  KafkaOptions kafka;
  // Local queue bound (librdkafka queue.buffering.max.*): produce() reports QueueFull past it.
  int queue_max_messages = 1000;
  int queue_max_kbytes = 512 * 1024;
  int linger_ms = 5;
  // How long librdkafka keeps retrying one message before reporting it failed (0 = forever).
  int delivery_timeout_ms = 300000;
  // Non-empty: transactional producer (fenced by this id; init_transactions() before use).
  std::string transactional_id;
  int transaction_timeout_ms = 60000;
};

struct Record {
  std::string topic;
  int32_t partition = 0;
  std::string key;
  std::span<const uint8_t> value;  // copied by produce()
  Headers headers;
};

struct DeliveryReport {
  std::string topic;
  int32_t partition = -1;
  int64_t offset = -1;
  uint64_t token = 0;  // what the caller passed to produce()
  bool ok = false;
  std::string error;   // empty when ok
};

class Producer {
 public:
  using DeliveryCallback = std::function<void(const DeliveryReport&)>;

  Producer(ProducerOptions options, DeliveryCallback on_delivery);
  ~Producer();
  Producer(const Producer&) = delete;
  Producer& operator=(const Producer&) = delete;

  enum class Enqueue { Ok, QueueFull };
  // Never blocks. Throws InvalidInput when the value exceeds max_message_bytes.
  Enqueue try_produce(const Record& record, uint64_t token);
  // Blocks (serving delivery reports) while the local queue is full, up to timeout_ms; throws
  // Unavailable when it stays full.
  void produce(const Record& record, uint64_t token, int timeout_ms);

  // Serves delivery reports; returns how many were served.
  int poll(int timeout_ms);
  // Waits for every queued message (bounded); returns how many are still undelivered.
  int flush(int timeout_ms);
  // Messages handed to librdkafka whose delivery report has not come back yet.
  int in_flight() const;

  // Transactions (transactional_id set). Errors throw: Unavailable (retriable), Error (the
  // transaction must be aborted), or Fenced (fatal: another instance took over this id).
  void init_transactions(int timeout_ms);
  void begin_transaction();
  void send_offsets_to_transaction(const std::vector<TopicPartitionOffset>& offsets,
                                   RdKafka::KafkaConsumer& consumer, int timeout_ms);
  void commit_transaction(int timeout_ms);
  void abort_transaction(int timeout_ms);

  const ProducerOptions& options() const { return options_; }

 private:
  struct Callbacks;
  ProducerOptions options_;
  std::unique_ptr<Callbacks> callbacks_;
  std::unique_ptr<RdKafka::Producer> producer_;
};

// A transactional producer was fenced by a newer instance with the same transactional id (or by
// a group rebalance): this instance must stop committing.
struct Fenced : Error {
  using Error::Error;
};

}  // namespace diloco
