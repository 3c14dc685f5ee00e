// Options shared by every Kafka client of the project. Defaults match broker_config/limits.env
// and scripts/broker (tests check that they agree).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace diloco {

using Headers = std::vector<std::pair<std::string, std::string>>;

// TLS and SASL of a client (core/kafka/security.h fills it from [security]); the default is the
// plaintext listener of an unsecured local broker.
struct KafkaSecurity {
  std::string protocol = "plaintext";  // librdkafka's security.protocol: plaintext, ssl or sasl_ssl
  std::string ca_file;                 // PEM of the CA that signed the brokers' certificates (empty: the system's)
  std::string certificate_file;        // the client's key and certificate in one PEM file (mutual TLS)
  std::string mechanism = "SCRAM-SHA-512";
  std::string username;  // SASL principal (sasl_ssl)
  std::string password;
};

struct KafkaOptions {
  std::string bootstrap_servers = "127.0.0.1:19092";
  uint64_t max_message_bytes = 64ull << 20;  // MAX_MESSAGE_BYTES in broker_config/limits.env
  int connect_timeout_ms = 30000;            // how long to wait for a broker before failing
  std::string client_id = "diloco";
  // Extra librdkafka properties, passed through as they are (e.g. {"debug", "broker"}).
  std::vector<std::pair<std::string, std::string>> extra;
  KafkaSecurity security;
};

struct TopicPartitionOffset {
  std::string topic;
  int32_t partition = -1;
  int64_t offset = -1;  // the next offset to read (Kafka's committed-offset convention)
  bool operator==(const TopicPartitionOffset&) const = default;
};

// Throws Unavailable with a clear message and a way out when no broker answers a metadata
// request within options.connect_timeout_ms.
void wait_for_broker(const KafkaOptions& options);

}  // namespace diloco
