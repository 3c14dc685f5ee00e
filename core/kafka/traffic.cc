#include "core/kafka/traffic.h"

#include <librdkafka/rdkafka.h>

#include <charconv>
#include <map>
#include <mutex>
#include <string>

#include "core/kafka/client_config.h"

namespace diloco {

namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, KafkaTraffic> by_client;  // latest cumulative counters of each client
};

Registry& registry() {
  static Registry r;
  return r;
}

// The number after "key": at the document's top level (librdkafka writes top-level fields before
// the per-broker objects, whose counters are named without the underscore).
bool top_level_number(std::string_view json, std::string_view key, uint64_t& out) {
  const auto at = json.find(key);
  if (at == std::string_view::npos) return false;
  const char* p = json.data() + at + key.size();
  const char* end = json.data() + json.size();
  while (p < end && (*p == ' ' || *p == ':')) ++p;
  return std::from_chars(p, end, out).ec == std::errc();
}

int on_statistics(rd_kafka_t*, char* json, size_t length, void*) {
  kafka_detail::record_statistics(std::string_view(json, length));
  return 0;  // librdkafka frees the document
}

}  // namespace

KafkaTraffic kafka_traffic() {
  auto& r = registry();
  std::lock_guard lock(r.mutex);
  KafkaTraffic total;
  for (const auto& [name, t] : r.by_client) {
    total.sent += t.sent;
    total.received += t.received;
  }
  return total;
}

std::map<std::string, KafkaTraffic> kafka_traffic_by_client() {
  auto& r = registry();
  std::lock_guard lock(r.mutex);
  return r.by_client;
}

namespace kafka_detail {

bool record_statistics(std::string_view json) {
  // The client's name is the document's first field ("name": "learner-0#producer-3"); brokers
  // have names too, further on.
  const auto key = json.find("\"name\"");
  if (key == std::string_view::npos) return false;
  auto start = key + 6;
  while (start < json.size() && (json[start] == ' ' || json[start] == ':')) ++start;
  if (start >= json.size() || json[start] != '"') return false;
  ++start;
  const auto stop = json.find('"', start);
  if (stop == std::string_view::npos) return false;
  KafkaTraffic t;
  if (!top_level_number(json, "\"tx_bytes\"", t.sent) || !top_level_number(json, "\"rx_bytes\"", t.received))
    return false;
  auto& r = registry();
  std::lock_guard lock(r.mutex);
  r.by_client[std::string(json.substr(start, stop - start))] = t;
  return true;
}

void count_traffic(RdKafka::Conf& conf) {
  set(conf, "statistics.interval.ms", "1000");
  // Straight on the C configuration: the C++ wrapper installs its own statistics callback only
  // with an EventCb, which would also take over librdkafka's logging.
  rd_kafka_conf_set_stats_cb(conf.c_ptr_global(), on_statistics);
}

}  // namespace kafka_detail

}  // namespace diloco
