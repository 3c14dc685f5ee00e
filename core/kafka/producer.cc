#include "core/kafka/producer.h"

#include <librdkafka/rdkafkacpp.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "core/kafka/client_config.h"

namespace diloco {

using kafka_detail::set;

struct Producer::Callbacks : RdKafka::DeliveryReportCb {
  DeliveryCallback on_delivery;
  int in_flight = 0;

  void dr_cb(RdKafka::Message& message) override {
    --in_flight;
    DeliveryReport report;
    report.topic = message.topic_name();
    report.partition = message.partition();
    report.offset = message.offset();
    report.token = reinterpret_cast<uintptr_t>(message.msg_opaque());
    report.ok = message.err() == RdKafka::ERR_NO_ERROR;
    if (!report.ok) report.error = message.errstr();
    if (on_delivery) on_delivery(report);
  }
};

namespace {

// Translates a librdkafka transaction error into the project's exception kinds.
[[noreturn]] void throw_txn(const char* what, RdKafka::Error* raw) {
  std::unique_ptr<RdKafka::Error> error(raw);
  std::string message = std::string(what) + ": " + error->str();
  if (error->code() == RdKafka::ERR__FENCED || error->code() == RdKafka::ERR_PRODUCER_FENCED ||
      error->code() == RdKafka::ERR_INVALID_PRODUCER_EPOCH || error->is_fatal())
    throw Fenced(message);
  if (error->is_retriable()) throw Unavailable(message);
  throw Error(message + (error->txn_requires_abort() ? " (transaction must be aborted)" : ""));
}

}  // namespace

Producer::Producer(ProducerOptions options, DeliveryCallback on_delivery)
    : options_(std::move(options)), callbacks_(std::make_unique<Callbacks>()) {
  callbacks_->on_delivery = std::move(on_delivery);
  auto conf = kafka_detail::base_config(options_.kafka, kafka_detail::ClientKind::Producer);
  set(*conf, "enable.idempotence", "true");
  set(*conf, "acks", "all");
  // Payloads are already zstd-compressed as whole messages; compressing again wastes CPU.
  set(*conf, "compression.codec", "none");
  set(*conf, "queue.buffering.max.messages", std::to_string(options_.queue_max_messages));
  set(*conf, "queue.buffering.max.kbytes", std::to_string(options_.queue_max_kbytes));
  set(*conf, "linger.ms", std::to_string(options_.linger_ms));
  int delivery_timeout = options_.delivery_timeout_ms;
  if (!options_.transactional_id.empty()) {
    // librdkafka: a message may not outlive the transaction it belongs to.
    delivery_timeout = std::min(delivery_timeout, options_.transaction_timeout_ms);
    set(*conf, "transactional.id", options_.transactional_id);
    set(*conf, "transaction.timeout.ms", std::to_string(options_.transaction_timeout_ms));
  }
  set(*conf, "message.timeout.ms", std::to_string(delivery_timeout));
  std::string error;
  if (conf->set("dr_cb", static_cast<RdKafka::DeliveryReportCb*>(callbacks_.get()), error) !=
      RdKafka::Conf::CONF_OK)
    throw InternalError("delivery callback: " + error);
  producer_.reset(RdKafka::Producer::create(conf.get(), error));
  if (!producer_) throw InvalidInput("cannot create Kafka producer: " + error);
}

Producer::~Producer() {
  // Drop what was never acknowledged (close paths flush first, bounded); destroying with queued
  // messages would otherwise wait for them.
  if (producer_) {
    producer_->purge(RdKafka::Producer::PURGE_QUEUE | RdKafka::Producer::PURGE_INFLIGHT);
    producer_->poll(0);
  }
}

Producer::Enqueue Producer::try_produce(const Record& record, uint64_t token) {
  if (record.value.size() > options_.kafka.max_message_bytes)
    throw InvalidInput("message of " + std::to_string(record.value.size()) + " bytes for " + record.topic +
                       " exceeds max_message_bytes " + std::to_string(options_.kafka.max_message_bytes) +
                       " (raise MAX_MESSAGE_BYTES in broker_config/limits.env and the clients' limit)");
  RdKafka::Headers* headers = kafka_detail::to_rdkafka(record.headers);
  RdKafka::ErrorCode err = producer_->produce(
      record.topic, record.partition, RdKafka::Producer::RK_MSG_COPY,
      const_cast<uint8_t*>(record.value.data()), record.value.size(), record.key.data(), record.key.size(),
      0, headers, reinterpret_cast<void*>(static_cast<uintptr_t>(token)));
  if (err == RdKafka::ERR_NO_ERROR) {
    ++callbacks_->in_flight;
    return Enqueue::Ok;
  }
  delete headers;  // not taken over on failure
  if (err == RdKafka::ERR__QUEUE_FULL) return Enqueue::QueueFull;
  throw Error("produce to " + record.topic + "[" + std::to_string(record.partition) +
              "]: " + RdKafka::err2str(err));
}

void Producer::produce(const Record& record, uint64_t token, int timeout_ms) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (try_produce(record, token) == Enqueue::QueueFull) {
    if (std::chrono::steady_clock::now() >= deadline)
      throw Unavailable("producer queue stayed full for " + std::to_string(timeout_ms) +
                        " ms (is the broker at " + options_.kafka.bootstrap_servers + " reachable?)");
    producer_->poll(50);
  }
}

int Producer::poll(int timeout_ms) { return producer_->poll(timeout_ms); }

int Producer::flush(int timeout_ms) {
  producer_->flush(timeout_ms);
  return producer_->outq_len();
}

int Producer::in_flight() const { return callbacks_->in_flight; }

void Producer::init_transactions(int timeout_ms) {
  if (auto* e = producer_->init_transactions(timeout_ms)) throw_txn("init_transactions", e);
}

void Producer::begin_transaction() {
  if (auto* e = producer_->begin_transaction()) throw_txn("begin_transaction", e);
}

void Producer::send_offsets_to_transaction(const std::vector<TopicPartitionOffset>& offsets,
                                           RdKafka::KafkaConsumer& consumer, int timeout_ms) {
  std::vector<RdKafka::TopicPartition*> list;
  for (const auto& o : offsets) list.push_back(RdKafka::TopicPartition::create(o.topic, o.partition, o.offset));
  std::unique_ptr<RdKafka::ConsumerGroupMetadata> metadata(consumer.groupMetadata());
  RdKafka::Error* e = producer_->send_offsets_to_transaction(list, metadata.get(), timeout_ms);
  RdKafka::TopicPartition::destroy(list);
  if (e) throw_txn("send_offsets_to_transaction", e);
}

void Producer::commit_transaction(int timeout_ms) {
  if (auto* e = producer_->commit_transaction(timeout_ms)) throw_txn("commit_transaction", e);
}

void Producer::abort_transaction(int timeout_ms) {
  if (auto* e = producer_->abort_transaction(timeout_ms)) throw_txn("abort_transaction", e);
}

}  // namespace diloco
