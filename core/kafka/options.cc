#include "core/kafka/options.h"

#include <librdkafka/rdkafkacpp.h>

#include <chrono>
#include <memory>
#include <thread>

#include "core/errors.h"
#include "core/kafka/client_config.h"

namespace diloco {

void wait_for_broker(const KafkaOptions& options) {
  auto conf = kafka_detail::base_config(options, kafka_detail::ClientKind::Producer);
  std::string error;
  std::unique_ptr<RdKafka::Producer> probe(RdKafka::Producer::create(conf.get(), error));
  if (!probe) throw InvalidInput("cannot create Kafka client: " + error);
  auto start = std::chrono::steady_clock::now();
  auto deadline = start + std::chrono::milliseconds(options.connect_timeout_ms);
  std::string last_error;
  while (std::chrono::steady_clock::now() < deadline) {
    RdKafka::Metadata* raw = nullptr;
    RdKafka::ErrorCode err = probe->metadata(true, nullptr, &raw, 2000);
    std::unique_ptr<RdKafka::Metadata> metadata(raw);
    if (err == RdKafka::ERR_NO_ERROR && metadata && !metadata->brokers()->empty()) return;
    last_error = RdKafka::err2str(err);
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  throw Unavailable("no Kafka broker answered at " + options.bootstrap_servers + " within " +
                    std::to_string(options.connect_timeout_ms / 1000) + " s (" + last_error +
                    "). Start one with `scripts/broker start`, or point --bootstrap / "
                    "DILOCO_BOOTSTRAP at a running cluster.");
}

}  // namespace diloco
