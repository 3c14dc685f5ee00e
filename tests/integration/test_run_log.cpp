// The newest state of every fragment, as a learner reads it at start-up (core/kafka/run_log.h),
// against the real broker: with the layout known, only a window at the end of each partition of
// `state` is read, widened until it holds every fragment of the partition, and the result is the
// one a read of the whole history gives; an invalid record is counted and skipped.
#include <catch2/catch.hpp>

#include "core/codec/messages.h"
#include "core/fragments/partition.h"
#include "core/kafka/log_reader.h"
#include "core/kafka/producer.h"
#include "core/kafka/run_log.h"
#include "tests/integration/run_fixture.h"

using namespace diloco;

namespace {

// Three fragments of one small tensor each (equal sizes go by name: a, b, c): with 2 partitions,
// fragments 0 and 2 share partition 0.
const auto kLayout = std::make_shared<const FragmentLayout>(
    partition_tensors(std::vector<TensorSpec>{{"a", {8}}, {"b", {8}}, {"c", {8}}}, 3));

FragmentState state_of(const std::string& run, uint32_t fragment, uint64_t version) {
  DenseTensor t{.index = 0, .shape = {8}};
  t.values.assign(8, static_cast<float>(version) + 0.25f * static_cast<float>(fragment));
  FragmentState state{.run_id = run, .fingerprint = kLayout->fingerprint, .fragment = fragment, .version = version,
                      .params = {t}, .momentum = {t}};
  state.layout = kLayout;
  return state;
}

}  // namespace

TEST_CASE("a learner's start reads the newest state of each fragment from the end of the log", "[kafka][state]") {
  KafkaOptions kafka = testing::require_broker();
  const std::string run = testing::unique_run_id("statetail");
  RunTopics topics = testing::create_run(kafka, run, {"r0"}, 2);
  Producer producer({.kafka = kafka}, nullptr);
  uint64_t written = 0;
  auto write = [&](uint32_t fragment, uint64_t version) {
    const auto bytes = encode_fragment_state(state_of(run, fragment, version));
    producer.produce({.topic = topics.state(), .partition = static_cast<int32_t>(fragment % 2),
                      .key = std::to_string(fragment), .value = bytes},
                     0, 10000);
    ++written;
  };
  // Fragment 0 stops at version 3; then 60 versions of fragment 2 follow it in partition 0, and a
  // record that is not a state among them. Fragment 1 (partition 1) has 50 versions.
  for (uint64_t v = 0; v <= 3; ++v) write(0, v);
  for (uint64_t v = 0; v < 60; ++v) {
    write(2, v);
    if (v == 30) {
      const std::vector<uint8_t> junk(64, 0xab);
      producer.produce({.topic = topics.state(), .partition = 0, .key = "2", .value = junk}, 0, 10000);
      ++written;
    }
  }
  for (uint64_t v = 0; v < 50; ++v) write(1, v);
  REQUIRE(producer.flush(20000) == 0);

  const DecodeLimits limits{.run_id = run, .fingerprint = kLayout->fingerprint, .layout = kLayout.get()};
  StateScan tail = read_states(kafka, topics, limits, 3);
  REQUIRE(tail.latest.size() == 3);
  CHECK(tail.latest.at(0).version == 3);
  CHECK(tail.latest.at(1).version == 49);
  CHECK(tail.latest.at(2).version == 59);
  CHECK(tail.latest.at(2).params[0].values[0] == 59.5f);
  // Partition 1: one window of 4 + 8 records holds fragment 1. Partition 0: fragment 0 is 61
  // records from the end, found by the third window (16, 64); the windows overlap.
  CHECK(tail.records <= 12 + 16 + 64);
  CHECK(tail.records < written);
  CHECK(tail.rejected == 1);  // the junk record, inside the last window of partition 0

  // What a read of the whole history finds: the same states at the same positions.
  std::map<uint32_t, std::pair<uint64_t, LogPosition>> newest;
  uint64_t read = 0;
  read_to_end(kafka, {topics.state()}, [&](const ConsumedMessage& m) {
    ++read;
    try {
      FragmentState s = decode_fragment_state(m.value, limits);
      auto& slot = newest[s.fragment];
      if (s.version >= slot.first) slot = {s.version, LogPosition{m.topic, m.partition, m.offset}};
    } catch (const Rejection&) {
    }
  }, 30000, &limits);
  CHECK(read == written);
  REQUIRE(newest.size() == 3);
  for (uint32_t p = 0; p < 3; ++p) {
    CHECK(newest.at(p).first == tail.latest.at(p).version);
    CHECK(newest.at(p).second == tail.positions.at(p));
  }
}

TEST_CASE("a reader without the model reads the newest states with the layout they carry", "[kafka][state]") {
  KafkaOptions kafka = testing::require_broker();
  const std::string run = testing::unique_run_id("stateself");
  RunTopics topics = testing::create_run(kafka, run, {"r0"}, 2);
  Producer producer({.kafka = kafka}, nullptr);
  for (uint32_t fragment = 0; fragment < 3; ++fragment)
    for (uint64_t v = 0; v <= fragment + 1; ++v)
      producer.produce({.topic = topics.state(), .partition = static_cast<int32_t>(fragment % 2),
                        .key = std::to_string(fragment), .value = encode_fragment_state(state_of(run, fragment, v))},
                       0, 10000);
  REQUIRE(producer.flush(20000) == 0);
  // As a merger after a restart, replay, or a learner of another model reads them: no layout.
  const StateScan scan = read_states(kafka, topics, DecodeLimits{.run_id = run}, 3);
  REQUIRE(scan.latest.size() == 3);
  for (uint32_t p = 0; p < 3; ++p) {
    INFO("fragment " << p);
    CHECK(scan.latest.at(p).version == p + 1);
    REQUIRE(scan.latest.at(p).layout != nullptr);
    CHECK(scan.latest.at(p).layout->fingerprint == kLayout->fingerprint);
    CHECK(scan.latest.at(p).layout->tensors == kLayout->tensors);
  }
  CHECK(scan.rejected == 0);
}
