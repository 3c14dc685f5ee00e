#include "core/kafka/consumer.h"

#include <librdkafka/rdkafkacpp.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <thread>

#include "core/errors.h"
#include "core/kafka/chunk_assembler.h"
#include "core/kafka/client_config.h"
#include "core/kafka/producer.h"

namespace diloco {

using kafka_detail::set;

namespace {

std::vector<TopicPartitionOffset> to_offsets(const std::vector<RdKafka::TopicPartition*>& list) {
  std::vector<TopicPartitionOffset> out;
  for (const auto* tp : list) out.push_back({tp->topic(), tp->partition(), tp->offset()});
  return out;
}

struct PartitionList {
  std::vector<RdKafka::TopicPartition*> items;
  explicit PartitionList(const std::vector<TopicPartitionOffset>& offsets) {
    for (const auto& o : offsets) items.push_back(RdKafka::TopicPartition::create(o.topic, o.partition, o.offset));
  }
  ~PartitionList() { RdKafka::TopicPartition::destroy(items); }
};

}  // namespace

struct Consumer::Callbacks : RdKafka::RebalanceCb {
  RebalanceListener* listener = nullptr;
  Consumer* owner = nullptr;

  // Eager (range) protocol: the whole assignment is replaced on every rebalance.
  void rebalance_cb(RdKafka::KafkaConsumer* consumer, RdKafka::ErrorCode err,
                    std::vector<RdKafka::TopicPartition*>& partitions) override {
    if (err == RdKafka::ERR__ASSIGN_PARTITIONS) {
      consumer->assign(partitions);
      owner->assigned_count_ = partitions.size();
      owner->ended_.clear();
      if (listener) listener->on_assigned(to_offsets(partitions));
    } else {
      if (listener) listener->on_revoked(to_offsets(partitions));
      consumer->unassign();
      owner->assigned_count_ = 0;
      owner->ended_.clear();
    }
  }
};

Consumer::Consumer(ConsumerOptions options, RebalanceListener* listener)
    : options_(std::move(options)), callbacks_(std::make_unique<Callbacks>()) {
  callbacks_->listener = listener;
  callbacks_->owner = this;
  auto conf = kafka_detail::base_config(options_.kafka, kafka_detail::ClientKind::Consumer);
  // librdkafka requires a group id even for assign()-only use; a unique one never joins.
  set(*conf, "group.id", options_.group_id.empty() ? options_.kafka.client_id + "-reader" : options_.group_id);
  if (!options_.group_instance_id.empty()) set(*conf, "group.instance.id", options_.group_instance_id);
  set(*conf, "enable.auto.commit", "false");
  set(*conf, "enable.auto.offset.store", "false");
  set(*conf, "enable.partition.eof", "true");
  set(*conf, "isolation.level", options_.read_committed ? "read_committed" : "read_uncommitted");
  set(*conf, "auto.offset.reset", options_.auto_offset_reset);
  set(*conf, "session.timeout.ms", std::to_string(options_.session_timeout_ms));
  set(*conf, "heartbeat.interval.ms", std::to_string(std::max(100, options_.session_timeout_ms / 5)));
  set(*conf, "max.poll.interval.ms", std::to_string(options_.max_poll_interval_ms));
  set(*conf, "partition.assignment.strategy", options_.assignor);
  set(*conf, "topic.metadata.refresh.interval.ms", std::to_string(options_.metadata_refresh_ms));
  std::string error;
  if (conf->set("rebalance_cb", static_cast<RdKafka::RebalanceCb*>(callbacks_.get()), error) !=
      RdKafka::Conf::CONF_OK)
    throw InternalError("rebalance callback: " + error);
  consumer_.reset(RdKafka::KafkaConsumer::create(conf.get(), error));
  if (!consumer_) throw InvalidInput("cannot create Kafka consumer: " + error);
  if (!options_.group_id.empty() && !options_.topics.empty()) {
    RdKafka::ErrorCode err = consumer_->subscribe(options_.topics);
    if (err) throw InvalidInput("subscribe: " + RdKafka::err2str(err));
  }
}

Consumer::~Consumer() {
  if (consumer_) consumer_->close();
}

std::optional<ConsumedMessage> Consumer::poll(int timeout_ms) {
  std::unique_ptr<RdKafka::Message> message(consumer_->consume(timeout_ms));
  switch (message->err()) {
    case RdKafka::ERR_NO_ERROR: {
      ConsumedMessage out;
      out.topic = message->topic_name();
      out.partition = message->partition();
      out.offset = message->offset();
      out.timestamp_ms = message->timestamp().timestamp;
      if (const std::string* key = message->key()) out.key = *key;
      out.tombstone = message->payload() == nullptr;
      const auto* bytes = static_cast<const uint8_t*>(message->payload());
      out.value.assign(bytes, bytes + message->len());
      out.headers = kafka_detail::from_rdkafka(message->headers());
      return out;
    }
    case RdKafka::ERR__TIMED_OUT:
      return std::nullopt;
    case RdKafka::ERR__PARTITION_EOF: {
      auto id = std::make_pair(message->topic_name(), message->partition());
      if (std::find(ended_.begin(), ended_.end(), id) == ended_.end()) ended_.push_back(id);
      return std::nullopt;
    }
    default:
      if (message->err() == RdKafka::ERR__TRANSPORT || message->err() == RdKafka::ERR__ALL_BROKERS_DOWN ||
          message->err() == RdKafka::ERR__RESOLVE)
        return std::nullopt;  // librdkafka reconnects by itself; keep polling
      {
        // Fenced as a static member: reported as itself, or as the fatal error behind ERR__FATAL.
        std::string reason;
        if (message->err() == RdKafka::ERR_FENCED_INSTANCE_ID ||
            (message->err() == RdKafka::ERR__FATAL && consumer_->fatal_error(reason) == RdKafka::ERR_FENCED_INSTANCE_ID))
          throw Fenced("consumer: another process joined the group as instance " + options_.group_instance_id +
                       " (" + (reason.empty() ? message->errstr() : reason) + ")");
      }
      if (message->err() == RdKafka::ERR_UNKNOWN_TOPIC_OR_PART ||
          message->err() == RdKafka::ERR_TOPIC_AUTHORIZATION_FAILED)
        throw InvalidInput("consumer: " + message->errstr() + " (create the run's topics: scripts/broker topics --run ID)");
      throw Error("consumer: " + message->errstr());
  }
}

void Consumer::commit(const std::vector<TopicPartitionOffset>& offsets) {
  PartitionList list(offsets);
  RdKafka::ErrorCode err = consumer_->commitSync(list.items);
  if (err) throw Error("offset commit: " + RdKafka::err2str(err));
}

std::vector<TopicPartitionOffset> Consumer::committed(const std::vector<TopicPartitionOffset>& partitions,
                                                      int timeout_ms) {
  PartitionList list(partitions);
  RdKafka::ErrorCode err = consumer_->committed(list.items, timeout_ms);
  if (err) throw Unavailable("committed offsets: " + RdKafka::err2str(err));
  return to_offsets(list.items);
}

void Consumer::rewind_to_committed(int timeout_ms) {
  const auto offsets = committed(assignment(), timeout_ms);
  const int64_t reset = options_.auto_offset_reset == "latest" ? RdKafka::Topic::OFFSET_END
                                                                : RdKafka::Topic::OFFSET_BEGINNING;
  for (const auto& tp : offsets) {
    std::unique_ptr<RdKafka::TopicPartition> partition(
        RdKafka::TopicPartition::create(tp.topic, tp.partition, tp.offset >= 0 ? tp.offset : reset));
    RdKafka::ErrorCode err = consumer_->seek(*partition, timeout_ms);
    if (err)
      throw Unavailable("rewinding " + tp.topic + "[" + std::to_string(tp.partition) + "] to offset " +
                        std::to_string(tp.offset) + ": " + RdKafka::err2str(err));
  }
  ended_.clear();
}

void Consumer::assign(const std::vector<TopicPartitionOffset>& partitions) {
  for (const auto& tp : partitions)
    if (!known_topics_.count(tp.topic)) {
      partition_count(tp.topic, options_.assign_metadata_ms);
      known_topics_.insert(tp.topic);
    }
  PartitionList list(partitions);
  RdKafka::ErrorCode err = consumer_->assign(list.items);
  if (err) throw Error("assign: " + RdKafka::err2str(err));
  assigned_count_ = partitions.size();
  ended_.clear();
}

void Consumer::unassign() {
  RdKafka::ErrorCode err = consumer_->unassign();
  if (err) throw Error("unassign: " + RdKafka::err2str(err));
  assigned_count_ = 0;
  ended_.clear();
}

std::vector<TopicPartitionOffset> Consumer::assignment() {
  std::vector<RdKafka::TopicPartition*> list;
  consumer_->assignment(list);
  auto out = to_offsets(list);
  RdKafka::TopicPartition::destroy(list);
  return out;
}

bool Consumer::at_end() const { return ended_.size() >= assigned_count_; }

namespace {

// Between two metadata requests for a topic not (yet) in the broker's metadata.
constexpr std::chrono::milliseconds kTopicRetry{200};

// A metadata request for one topic. Its answer also replaces librdkafka's cached leaders of the
// topic, which is what the watermark retry below wants of it.
RdKafka::ErrorCode topic_metadata(RdKafka::KafkaConsumer& consumer, const std::string& topic, int timeout_ms,
                                  std::unique_ptr<RdKafka::Metadata>& out) {
  std::string error;
  std::unique_ptr<RdKafka::Topic> handle(RdKafka::Topic::create(&consumer, topic, nullptr, error));
  if (!handle) return RdKafka::ERR__INVALID_ARG;
  RdKafka::Metadata* raw = nullptr;
  const RdKafka::ErrorCode err = consumer.metadata(false, handle.get(), &raw, timeout_ms);
  out.reset(raw);
  return err;
}

}  // namespace

int Consumer::partition_count(const std::string& topic, int timeout_ms) {
  // A topic being created (scripts/broker topics, a test's create_topics) is in the broker's
  // metadata only once its controller has applied the creation: seconds on a loaded broker. A
  // process started meanwhile asks again until timeout_ms has passed before calling it missing.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    const int left = static_cast<int>(std::max<int64_t>(
        1, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count()));
    std::unique_ptr<RdKafka::Metadata> metadata;
    RdKafka::ErrorCode err = topic_metadata(*consumer_, topic, left, metadata);
    if (err) throw Unavailable("metadata for " + topic + ": " + RdKafka::err2str(err));
    for (const auto* t : *metadata->topics())
      if (t->topic() == topic && t->err() == RdKafka::ERR_NO_ERROR && !t->partitions()->empty())
        return static_cast<int>(t->partitions()->size());
    if (std::chrono::steady_clock::now() + kTopicRetry >= deadline)
      throw InvalidInput(detail::concat("topic ", topic, " does not exist (not in the broker's metadata after ",
                                        timeout_ms / 1000.0, " s; create the run's topics: scripts/broker topics --run ID)"));
    std::this_thread::sleep_for(kTopicRetry);
  }
}

std::vector<std::pair<std::string, int>> Consumer::list_topics(int timeout_ms) {
  RdKafka::Metadata* raw = nullptr;
  RdKafka::ErrorCode err = consumer_->metadata(true, nullptr, &raw, timeout_ms);
  std::unique_ptr<RdKafka::Metadata> metadata(raw);
  if (err) throw Unavailable(std::string("cluster metadata: ") + RdKafka::err2str(err));
  std::vector<std::pair<std::string, int>> out;
  for (const auto* t : *metadata->topics())
    if (t->err() == RdKafka::ERR_NO_ERROR) out.emplace_back(t->topic(), static_cast<int>(t->partitions()->size()));
  std::sort(out.begin(), out.end());
  return out;
}

std::pair<int64_t, int64_t> Consumer::watermarks(const std::string& topic, int32_t partition, int timeout_ms) {
  int64_t low = -1, high = -1;
  // A topic created a moment ago may not have a leader yet, or the leader moved (a broker node
  // killed and restarted): librdkafka then keeps asking the broker its metadata names, whose
  // answer waits for that broker or says "not leader". Each attempt is short; after a failed one
  // a metadata request for the topic refreshes the leader before the next, until the deadline.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    const int attempt_ms = std::clamp<int>(static_cast<int>(left.count()), 1, kWatermarkAttemptMs);
    RdKafka::ErrorCode err = consumer_->query_watermark_offsets(topic, partition, &low, &high, attempt_ms);
    if (!err) break;
    const bool transient = err == RdKafka::ERR_NOT_LEADER_FOR_PARTITION || err == RdKafka::ERR_LEADER_NOT_AVAILABLE ||
                           err == RdKafka::ERR__TIMED_OUT || err == RdKafka::ERR__TRANSPORT ||
                           err == RdKafka::ERR_FENCED_LEADER_EPOCH || err == RdKafka::ERR_UNKNOWN_LEADER_EPOCH;
    if (!transient || std::chrono::steady_clock::now() + std::chrono::milliseconds(100) >= deadline)
      throw Unavailable("watermarks of " + topic + "[" + std::to_string(partition) + "]: " + RdKafka::err2str(err));
    std::unique_ptr<RdKafka::Metadata> refreshed;
    topic_metadata(*consumer_, topic, attempt_ms, refreshed);  // a failure is the next attempt's to report
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return {low, high};
}

std::optional<int64_t> Consumer::offset_at_time(const std::string& topic, int32_t partition, int64_t ms,
                                                int timeout_ms) {
  std::vector<RdKafka::TopicPartition*> list{RdKafka::TopicPartition::create(topic, partition, ms)};
  RdKafka::ErrorCode err = consumer_->offsetsForTimes(list, timeout_ms);
  const int64_t offset = list.front()->offset();
  RdKafka::TopicPartition::destroy(list);
  if (err) throw Unavailable("offsets for time " + std::to_string(ms) + " of " + topic + ": " + RdKafka::err2str(err));
  if (offset < 0) return std::nullopt;
  return offset;
}

std::optional<int64_t> Consumer::cached_high_watermark(const std::string& topic, int32_t partition) {
  int64_t low = -1, high = -1;
  if (consumer_->get_watermark_offsets(topic, partition, &low, &high) != RdKafka::ERR_NO_ERROR || high < 0)
    return std::nullopt;
  return high;
}


}  // namespace diloco
