// A partition leader killed and restarted at once (what scripts/chaos does to a broker node):
// its partitions get new leaders, and a client that asked the old leader before keeps asking it
// and hears "not leader" until its metadata is refreshed. The merger's recovery asks for
// watermarks first (LogReader::wait_until_stable), so a stale answer stalled a new owner's
// fragments for the whole stable wait. The test runs its own 3-node broker (own folder and ports).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include <librdkafka/rdkafkacpp.h>

#include "core/kafka/consumer.h"
#include "core/kafka/log_reader.h"
#include "tests/integration/broker_fixture.h"

using namespace diloco;
using namespace std::chrono_literals;

namespace {

// The leader of topic[partition] by a fresh metadata request of `consumer`.
int32_t leader_of(Consumer& consumer, const std::string& topic, int32_t partition) {
  std::string error;
  std::unique_ptr<RdKafka::Topic> handle(RdKafka::Topic::create(&consumer.raw(), topic, nullptr, error));
  RdKafka::Metadata* raw = nullptr;
  REQUIRE(consumer.raw().metadata(false, handle.get(), &raw, 10000) == RdKafka::ERR_NO_ERROR);
  std::unique_ptr<RdKafka::Metadata> metadata(raw);
  for (const auto* t : *metadata->topics())
    if (t->topic() == topic)
      for (const auto* p : *t->partitions())
        if (p->id() == partition) return p->leader();
  FAIL("no metadata for " << topic << "[" << partition << "]");
  return -1;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

TEST_CASE("watermark queries follow a partition leader that was killed and restarted", "[kafka][faults][three-nodes]") {
  testing::require_broker();  // the shared broker must be up too: its absence is a setup error
  testing::PrivateBroker broker("leader-move", testing::test_port("DILOCO_TEST_LEADER_MOVE_PORT", 29392), 3);
  const std::string run = testing::unique_run_id("leadermove");
  REQUIRE(broker.start("--run " + run + " --regions r0 --partitions 1") == 0);
  KafkaOptions kafka = testing::broker_options();
  kafka.bootstrap_servers = broker.servers();
  const RunTopics topics{run};

  // Both clients ask once before the fault, so that each holds the leader in its metadata.
  Consumer consumer(ConsumerOptions{.kafka = kafka});
  LogReader reader(kafka);
  REQUIRE(consumer.watermarks(topics.state(), 0, 10000).second == 0);
  REQUIRE(reader.wait_until_stable({{topics.merges(), 0, 0}}, 10000).empty());
  const int32_t leader = leader_of(consumer, topics.state(), 0);
  REQUIRE(leader >= 1);
  REQUIRE(leader_of(consumer, topics.merges(), 0) >= 1);

  // Queries run on while the leader dies and comes back, as the merger's recovery does when a
  // broker node is killed under it: every answer must come within seconds, none may fail.
  std::atomic<bool> done{false};
  double longest_watermarks = 0, longest_stable = 0;
  std::string failure;
  int queries = 0;
  std::thread asker([&] {
    while (!done) {
      try {
        auto t = std::chrono::steady_clock::now();
        consumer.watermarks(topics.state(), 0, 30000);
        longest_watermarks = std::max(longest_watermarks, seconds_since(t));
        t = std::chrono::steady_clock::now();
        reader.wait_until_stable({{topics.state(), 0, 0}, {topics.merges(), 0, 0}}, 30000);
        longest_stable = std::max(longest_stable, seconds_since(t));
        ++queries;
      } catch (const Error& e) {
        failure = e.what();
        return;
      }
      std::this_thread::sleep_for(50ms);
    }
  });
  std::this_thread::sleep_for(500ms);
  const bool killed = broker.run("kill-node --node " + std::to_string(leader)) == 0;
  const bool restarted = killed && broker.run("start-node --node " + std::to_string(leader)) == 0;
  std::this_thread::sleep_for(5s);
  done = true;
  asker.join();
  REQUIRE(killed);
  REQUIRE(restarted);
  INFO("old leader node " << leader << ", now " << leader_of(consumer, topics.state(), 0) << "; " << queries
                          << " queries, longest watermark query " << longest_watermarks << " s, longest stable wait "
                          << longest_stable << " s");
  CHECK(failure.empty());
  CHECK(longest_watermarks < 10);
  CHECK(longest_stable < 10);
}
