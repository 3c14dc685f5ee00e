#include "core/kafka/client_config.h"

#include "core/errors.h"
#include "core/kafka/traffic.h"

namespace diloco::kafka_detail {

void set(RdKafka::Conf& conf, const std::string& key, const std::string& value) {
  std::string error;
  if (conf.set(key, value, error) != RdKafka::Conf::CONF_OK)
    throw InvalidInput("Kafka client property " + key + "=" + value + ": " + error);
}

std::unique_ptr<RdKafka::Conf> base_config(const KafkaOptions& options, ClientKind kind) {
  std::unique_ptr<RdKafka::Conf> conf(RdKafka::Conf::create(RdKafka::Conf::CONF_GLOBAL));
  set(*conf, "bootstrap.servers", options.bootstrap_servers);
  set(*conf, "client.id", options.client_id);
  // A message up to the limit plus librdkafka's per-message overhead.
  const uint64_t message_max = options.max_message_bytes + (64 << 10);
  set(*conf, "message.max.bytes", std::to_string(message_max));
  if (kind == ClientKind::Consumer) {
    // A fetch always returns at least one whole message; the receive buffer must hold the
    // largest fetch response (matches MAX_FETCH_BYTES in broker_config/limits.env).
    set(*conf, "fetch.max.bytes", std::to_string(message_max));
    set(*conf, "receive.message.max.bytes", std::to_string(2 * options.max_message_bytes + (2 << 20)));
  }
  set(*conf, "log.connection.close", "false");
  set(*conf, "socket.connection.setup.timeout.ms", "10000");
  set(*conf, "reconnect.backoff.max.ms", "2000");
  const KafkaSecurity& security = options.security;
  if (security.protocol != "plaintext") {
    set(*conf, "security.protocol", security.protocol);
    if (!security.ca_file.empty()) set(*conf, "ssl.ca.location", security.ca_file);
    if (!security.certificate_file.empty()) {  // librdkafka reads the key and the certificate blocks of one file
      set(*conf, "ssl.certificate.location", security.certificate_file);
      set(*conf, "ssl.key.location", security.certificate_file);
    }
    if (security.protocol == "sasl_ssl") {
      set(*conf, "sasl.mechanisms", security.mechanism);
      set(*conf, "sasl.username", security.username);
      std::string error;  // not through set(): its message would carry the password
      if (conf->set("sasl.password", security.password, error) != RdKafka::Conf::CONF_OK)
        throw InvalidInput("Kafka client property sasl.password: " + error);
    }
  }
  count_traffic(*conf);
  for (const auto& [key, value] : options.extra) set(*conf, key, value);
  return conf;
}

RdKafka::Headers* to_rdkafka(const Headers& headers) {
  RdKafka::Headers* out = RdKafka::Headers::create();
  for (const auto& [key, value] : headers) out->add(key, value);
  return out;
}

Headers from_rdkafka(const RdKafka::Headers* headers) {
  Headers out;
  if (!headers) return out;
  for (const auto& h : headers->get_all()) {
    out.emplace_back(h.key(), h.value() ? std::string(static_cast<const char*>(h.value()), h.value_size())
                                        : std::string());
  }
  return out;
}

}  // namespace diloco::kafka_detail
