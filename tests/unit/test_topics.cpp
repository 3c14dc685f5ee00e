// Topic definitions and client limits: pure parsing, no broker.
#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>

#include "core/errors.h"
#include "core/kafka/options.h"
#include "core/kafka/topics.h"

using namespace diloco;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

const TopicSpec& find(const std::vector<TopicSpec>& specs, const std::string& name) {
  for (const auto& s : specs)
    if (s.name == name) return s;
  FAIL("topic " << name << " not defined");
  throw;
}

std::string config_of(const TopicSpec& spec, const std::string& key) {
  for (const auto& [k, v] : spec.config)
    if (k == key) return v;
  return "<unset>";
}

}  // namespace

TEST_CASE("client message limit equals MAX_MESSAGE_BYTES in broker_config/limits.env", "[kafka][limits]") {
  std::istringstream env(read_file(DILOCO_SOURCE_DIR "/broker_config/limits.env"));
  uint64_t broker_limit = 0;
  for (std::string line; std::getline(env, line);)
    if (line.rfind("MAX_MESSAGE_BYTES=", 0) == 0) broker_limit = std::stoull(line.substr(18));
  CHECK(broker_limit == KafkaOptions{}.max_message_bytes);
}

TEST_CASE("the embedded topic definitions are broker_config/topics.def", "[kafka]") {
  CHECK(builtin_topic_definitions() == read_file(DILOCO_SOURCE_DIR "/broker_config/topics.def"));
}

TEST_CASE("topics.def expands to the topics of ARCHITECTURE.md section 3", "[kafka]") {
  auto specs = run_topic_specs(builtin_topic_definitions(), "R1", {"eu", "us"}, 6, 1000);
  REQUIRE(specs.size() == 7);
  for (const char* name : {"diloco.R1.deltas.eu", "diloco.R1.deltas.us", "diloco.R1.genesis", "diloco.R1.merges",
                           "diloco.R1.state"}) {
    CHECK(find(specs, name).partitions == 6);
    CHECK(config_of(find(specs, name), "max.message.bytes") == "1000");
  }
  CHECK(config_of(find(specs, "diloco.R1.state"), "cleanup.policy") == "compact");
  // Compaction cleans closed segments only: the compacted topics roll one every 10 minutes.
  CHECK(config_of(find(specs, "diloco.R1.state"), "segment.ms") == "600000");
  CHECK(config_of(find(specs, "diloco.R1.members"), "segment.ms") == "600000");
  CHECK(config_of(find(specs, "diloco.R1.deltas.eu"), "cleanup.policy") == "delete");
  // Proposals of version 0 stay as long as the deltas: verify and audit read them.
  CHECK(config_of(find(specs, "diloco.R1.genesis"), "cleanup.policy") == "delete");
  CHECK(config_of(find(specs, "diloco.R1.genesis"), "retention.ms") == "-1");
  CHECK(RunTopics{"R1"}.genesis() == "diloco.R1.genesis");
  CHECK(find(specs, "diloco.R1.members").partitions == 1);
  CHECK(config_of(find(specs, "diloco.R1.members"), "cleanup.policy") == "compact");
  // Liveness is judged on the broker's clock, not the learners'.
  CHECK(config_of(find(specs, "diloco.R1.members"), "message.timestamp.type") == "LogAppendTime");
  CHECK(find(specs, "diloco.R1.rejected").partitions == 1);
  CHECK(RunTopics{"R1"}.deltas("eu") == "diloco.R1.deltas.eu");
}

TEST_CASE("bad run ids, regions, partitions and definition lines are refused with the reason", "[kafka]") {
  auto defs = builtin_topic_definitions();
  CHECK_THROWS_WITH(run_topic_specs(defs, "a.b", {"eu"}, 1, 1), Catch::Contains("run id 'a.b'"));
  CHECK_THROWS_WITH(run_topic_specs(defs, "r", {"e u"}, 1, 1), Catch::Contains("region 'e u'"));
  CHECK_THROWS_WITH(run_topic_specs(defs, "r", {}, 1, 1), Catch::Contains("at least one region"));
  CHECK_THROWS_WITH(run_topic_specs(defs, "r", {"eu"}, 0, 1), Catch::Contains("partitions must be at least 1"));
  CHECK_THROWS_WITH(run_topic_specs("x.{run} many\n", "r", {"eu"}, 1, 1), Catch::Contains("line 1: bad partitions"));
  CHECK_THROWS_WITH(run_topic_specs("# c\nx.{run} 1 novalue\n", "r", {"eu"}, 1, 1),
                    Catch::Contains("line 2: 'novalue' is not key=value"));
}
