// Every byte this process's Kafka clients exchanged with the brokers, protocol included: each
// client reports librdkafka's statistics (tx_bytes, rx_bytes) every second, and the totals add up
// every client the process has had, closed ones too. Counted at the client, so the last second of
// a client closed since is missing.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include <librdkafka/rdkafkacpp.h>

namespace diloco {

struct KafkaTraffic {
  uint64_t sent = 0;      // bytes written to broker sockets
  uint64_t received = 0;  // bytes read from broker sockets
};

KafkaTraffic kafka_traffic();
// The same per client (librdkafka's client name, e.g. "learner-0#producer-3").
std::map<std::string, KafkaTraffic> kafka_traffic_by_client();

namespace kafka_detail {
// Has every client made from `conf` report its statistics once a second (done by base_config).
void count_traffic(RdKafka::Conf& conf);
// Reads one statistics document (exposed for tests); false when it has no client name or counters.
bool record_statistics(std::string_view json);
}  // namespace kafka_detail

}  // namespace diloco
