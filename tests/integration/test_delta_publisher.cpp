// The learner's publisher thread on the real broker: a delta the producer refuses for good
// (larger than the broker takes, not chunked) is dropped and counted, and the thread goes on
// delivering the others; before, the exception left the thread and terminated the learner.
#include <catch2/catch.hpp>

#include "learner/delta_publisher.h"
#include "tests/integration/broker_fixture.h"
#include "tests/integration/child_process.h"

using namespace diloco;
using namespace std::chrono_literals;

TEST_CASE("a delta the producer refuses is dropped and counted, and the publisher goes on with the others",
          "[learner][publisher]") {
  KafkaOptions kafka = testing::require_broker();
  const std::string run = testing::unique_run_id("publisher");
  RunTopics topics = testing::create_run(kafka, run, {"r0"}, 2);
  kafka.max_message_bytes = 4096;  // what this producer takes
  Metrics metrics("test_");
  DeltaPublisher publisher({.producer = {.kafka = kafka}, .topics = topics, .partitions = 2, .chunk_bytes = 0},
                           metrics);
  auto delta = [&](uint32_t fragment, size_t bytes) {
    return OutgoingDelta{.header = {.run_id = run, .learner_id = "L0", .region = "r0", .fragment = fragment, .seq = 1},
                         .bytes = std::vector<uint8_t>(bytes, 7)};
  };
  publisher.submit(delta(0, 8192));  // too large for this producer, and not chunked
  publisher.submit(delta(1, 1000));
  REQUIRE(testing::eventually([&] { return publisher.stats().delivered == 1; }, 30s));
  CHECK(testing::eventually([&] { return publisher.stats().failed == 1; }, 10s));
  CHECK(metrics.value("deltas_failed_total") == 1);
  CHECK(publisher.stats().in_flight == 0);
  // And it still works: a later delta of the refused fragment goes out.
  publisher.submit(delta(0, 1000));
  CHECK(testing::eventually([&] { return publisher.stats().delivered == 2; }, 30s));
  CHECK(publisher.close(10s).empty());
}
