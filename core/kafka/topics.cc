#include "core/kafka/topics.h"

#include <librdkafka/rdkafka.h>

#include <cctype>
#include <memory>
#include <sstream>

#include "core/errors.h"
#include "core/kafka/client_config.h"
#include "topics_def.h"  // generated from broker_config/topics.def

namespace diloco {

namespace {

bool is_name(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  return true;
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t pos = s.find(from); pos != std::string::npos; pos = s.find(from, pos + to.size()))
    s.replace(pos, from.size(), to);
  return s;
}

}  // namespace

std::string RunTopics::deltas_pattern() const { return "^diloco\\." + run_id + "\\.deltas\\..+"; }

std::string_view builtin_topic_definitions() { return kTopicDefinitions; }

std::vector<TopicSpec> run_topic_specs(std::string_view definitions, const std::string& run_id,
                                       const std::vector<std::string>& regions, int partitions,
                                       uint64_t max_message_bytes) {
  if (!is_name(run_id)) throw InvalidInput("run id '" + run_id + "' must be letters, digits, '_' or '-'");
  if (regions.empty()) throw InvalidInput("a run needs at least one region");
  for (const auto& r : regions)
    if (!is_name(r)) throw InvalidInput("region '" + r + "' must be letters, digits, '_' or '-'");
  if (partitions < 1) throw InvalidInput("partitions must be at least 1, got " + std::to_string(partitions));

  std::vector<TopicSpec> specs;
  std::istringstream lines{std::string(definitions)};
  std::string line;
  for (int number = 1; std::getline(lines, line); ++number) {
    line = line.substr(0, line.find('#'));
    std::istringstream fields(line);
    std::string name, parts;
    if (!(fields >> name)) continue;
    if (!(fields >> parts)) throw InvalidInput("topics.def line " + std::to_string(number) + ": missing partitions");
    parts = replace_all(parts, "{partitions}", std::to_string(partitions));
    TopicSpec spec;
    try {
      spec.partitions = std::stoi(parts);
    } catch (const std::exception&) {
      throw InvalidInput("topics.def line " + std::to_string(number) + ": bad partitions '" + parts + "'");
    }
    for (std::string kv; fields >> kv;) {
      auto eq = kv.find('=');
      if (eq == std::string::npos)
        throw InvalidInput("topics.def line " + std::to_string(number) + ": '" + kv + "' is not key=value");
      spec.config.emplace_back(kv.substr(0, eq),
                               replace_all(kv.substr(eq + 1), "{max_message_bytes}", std::to_string(max_message_bytes)));
    }
    name = replace_all(name, "{run}", run_id);
    if (name.find("{region}") != std::string::npos) {
      for (const auto& region : regions) {
        spec.name = replace_all(name, "{region}", region);
        specs.push_back(spec);
      }
    } else {
      spec.name = name;
      specs.push_back(spec);
    }
  }
  return specs;
}

void create_topics(const KafkaOptions& options, const std::vector<TopicSpec>& specs, int timeout_ms) {
  if (specs.empty()) return;
  wait_for_broker(options);
  // The admin API lives in librdkafka's C interface; build a C configuration from the same options.
  rd_kafka_conf_t* conf = rd_kafka_conf_new();
  char errstr[512];
  auto set = [&](const char* k, const std::string& v) {
    if (rd_kafka_conf_set(conf, k, v.c_str(), errstr, sizeof errstr) != RD_KAFKA_CONF_OK)
      throw InvalidInput(std::string("Kafka property ") + k + ": " + errstr);
  };
  set("bootstrap.servers", options.bootstrap_servers);
  set("client.id", options.client_id + "-admin");
  std::unique_ptr<rd_kafka_t, decltype(&rd_kafka_destroy)> rk(
      rd_kafka_new(RD_KAFKA_PRODUCER, conf, errstr, sizeof errstr), &rd_kafka_destroy);
  if (!rk) throw InvalidInput(std::string("cannot create Kafka admin client: ") + errstr);

  std::vector<rd_kafka_NewTopic_t*> topics;
  auto cleanup = [&] { rd_kafka_NewTopic_destroy_array(topics.data(), topics.size()); };
  for (const auto& spec : specs) {
    rd_kafka_NewTopic_t* t = rd_kafka_NewTopic_new(spec.name.c_str(), spec.partitions, -1, errstr, sizeof errstr);
    if (!t) {
      cleanup();
      throw InvalidInput("topic " + spec.name + ": " + errstr);
    }
    for (const auto& [k, v] : spec.config) rd_kafka_NewTopic_set_config(t, k.c_str(), v.c_str());
    topics.push_back(t);
  }
  rd_kafka_AdminOptions_t* admin_options = rd_kafka_AdminOptions_new(rk.get(), RD_KAFKA_ADMIN_OP_CREATETOPICS);
  rd_kafka_AdminOptions_set_operation_timeout(admin_options, timeout_ms, errstr, sizeof errstr);
  rd_kafka_AdminOptions_set_request_timeout(admin_options, timeout_ms, errstr, sizeof errstr);
  rd_kafka_queue_t* queue = rd_kafka_queue_new(rk.get());
  rd_kafka_CreateTopics(rk.get(), topics.data(), topics.size(), admin_options, queue);
  rd_kafka_event_t* event = rd_kafka_queue_poll(queue, timeout_ms + 5000);
  std::string failure;
  if (!event) {
    failure = "no answer to CreateTopics within " + std::to_string(timeout_ms) + " ms";
  } else if (rd_kafka_event_error(event)) {
    failure = rd_kafka_event_error_string(event);
  } else {
    const rd_kafka_CreateTopics_result_t* result = rd_kafka_event_CreateTopics_result(event);
    size_t n = 0;
    const rd_kafka_topic_result_t** results = rd_kafka_CreateTopics_result_topics(result, &n);
    for (size_t i = 0; i < n; ++i) {
      rd_kafka_resp_err_t err = rd_kafka_topic_result_error(results[i]);
      if (err == RD_KAFKA_RESP_ERR_NO_ERROR || err == RD_KAFKA_RESP_ERR_TOPIC_ALREADY_EXISTS) continue;
      const char* message = rd_kafka_topic_result_error_string(results[i]);
      failure += std::string(failure.empty() ? "" : "; ") + rd_kafka_topic_result_name(results[i]) + ": " +
                 (message ? message : rd_kafka_err2str(err));
    }
  }
  if (event) rd_kafka_event_destroy(event);
  rd_kafka_queue_destroy(queue);
  rd_kafka_AdminOptions_destroy(admin_options);
  cleanup();
  if (!failure.empty()) throw Error("creating topics: " + failure);
}

}  // namespace diloco
