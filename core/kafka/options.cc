#include "core/kafka/options.h"

#include <librdkafka/rdkafkacpp.h>

#include <chrono>
#include <iostream>
#include <memory>
#include <thread>

#include "core/errors.h"
#include "core/kafka/client_config.h"

namespace diloco {

namespace {

// What the client said last of its connections (a refused certificate, a broker's certificate that
// does not verify): the reason a broker that is up still does not answer. Also logs them as
// librdkafka would (an EventCb takes its logging over).
struct ConnectionErrors : RdKafka::EventCb {
  std::string last;  // written and read on the probing thread (events are served by poll())
  void event_cb(RdKafka::Event& event) override {
    if (event.type() == RdKafka::Event::EVENT_ERROR) last = event.str();
    if (event.type() == RdKafka::Event::EVENT_LOG && event.severity() <= RdKafka::Event::EVENT_SEVERITY_ERROR)
      std::cerr << "%" << event.severity() << "|" << event.fac() << "| " << event.str() << "\n";
  }
};

}  // namespace

void wait_for_broker(const KafkaOptions& options) {
  auto conf = kafka_detail::base_config(options, kafka_detail::ClientKind::Producer);
  ConnectionErrors errors;
  std::string error;
  if (conf->set("event_cb", static_cast<RdKafka::EventCb*>(&errors), error) != RdKafka::Conf::CONF_OK)
    throw InternalError("event callback: " + error);
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
    probe->poll(0);  // serves the error callback
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  if (!errors.last.empty()) last_error += "; last connection error: " + errors.last;
  probe.reset();  // before `errors`, which its callbacks write
  const KafkaSecurity& security = options.security;
  if (security.protocol != "plaintext") {
    const std::string as = !security.certificate_file.empty() ? " as the principal of " + security.certificate_file
                           : !security.username.empty()       ? " as '" + security.username + "'"
                                                              : std::string(" without a client certificate");
    throw Unavailable("no Kafka broker answered at " + options.bootstrap_servers + " over " + security.protocol + as +
                      " within " + std::to_string(options.connect_timeout_ms / 1000) + " s (" + last_error +
                      "). Check [security] kafka_ca and kafka_certificate (scripts/secure init writes them) and that "
                      "the broker was started with scripts/broker start --secure.");
  }
  throw Unavailable("no Kafka broker answered at " + options.bootstrap_servers + " within " +
                    std::to_string(options.connect_timeout_ms / 1000) + " s (" + last_error +
                    "). Start one with `scripts/broker start`, or point --bootstrap / "
                    "DILOCO_BOOTSTRAP at a running cluster.");
}

}  // namespace diloco
