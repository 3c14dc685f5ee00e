// Real broker: deltas produced through the project's producer come back through a consumer group
// byte for byte; transactions of librdkafka 2.0.2 work against the pinned Kafka 4.x broker
// (commit, abort, offsets in the transaction, zombie fencing); the message size limit holds.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include "core/codec/messages.h"
#include "core/kafka/consumer.h"
#include "core/kafka/log_reader.h"
#include "core/kafka/delta_headers.h"
#include "core/kafka/producer.h"
#include "core/kafka/traffic.h"
#include "tests/integration/broker_fixture.h"
#include "tests/integration/child_process.h"

using namespace diloco;
using namespace std::chrono_literals;

namespace {

FragmentLayout three_fragment_layout() {
  FragmentLayout layout;
  layout.fragments = {{{"embed", {64, 16}}, {"head.bias", {64}}},
                      {{"block0.attn", {16, 48}}},
                      {{"block0.mlp", {16, 64}}, {"block0.ln", {16}}, {"final.ln", {16}}}};
  layout.fingerprint = 0x5eed5eedULL;
  return layout;
}

std::vector<DenseTensor> random_tensors(const FragmentLayout& layout, uint32_t fragment, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 0.01f);
  std::vector<DenseTensor> out;
  uint32_t index = 0;
  for (const auto& spec : layout.fragments[fragment]) {
    DenseTensor t{index++, spec.shape, std::vector<float>(static_cast<size_t>(spec.numel()))};
    for (auto& v : t.values) v = normal(rng);
    out.push_back(std::move(t));
  }
  return out;
}

std::string header_value(const Headers& headers, const std::string& key) {
  for (const auto& [k, v] : headers)
    if (k == key) return v;
  return "<missing>";
}

// Consumes until `count` messages arrived or the deadline passed.
std::vector<ConsumedMessage> consume(Consumer& consumer, size_t count, std::chrono::seconds limit) {
  std::vector<ConsumedMessage> out;
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (out.size() < count && std::chrono::steady_clock::now() < deadline)
    if (auto m = consumer.poll(200)) out.push_back(std::move(*m));
  return out;
}

}  // namespace

TEST_CASE("100 deltas over 3 fragments round-trip through a consumer group byte for byte", "[kafka]") {
  KafkaOptions kafka = testing::require_broker();
  std::string run = testing::unique_run_id("roundtrip");
  RunTopics topics = testing::create_run(kafka, run, {"eu", "us"}, 3);
  FragmentLayout layout = three_fragment_layout();

  using Position = std::tuple<std::string, int32_t, int64_t>;
  std::map<Position, std::vector<uint8_t>> sent;  // (topic, partition, offset) -> bytes
  std::map<uint64_t, std::vector<uint8_t>> by_token;
  std::vector<DeliveryReport> reports;
  Producer producer({.kafka = kafka}, [&](const DeliveryReport& r) { reports.push_back(r); });

  std::mt19937 rng(7);
  const char* dtypes[] = {"fp32", "bf16", "int8", "int4"};
  for (uint64_t i = 0; i < 100; ++i) {
    DeltaHeader h;
    h.run_id = run;
    h.fingerprint = layout.fingerprint;
    h.learner_id = "learner-" + std::to_string(i % 4);
    h.region = i % 2 ? "us" : "eu";
    h.fragment = static_cast<uint32_t>(i % 3);
    h.seq = i / 3 + 1;
    h.base_version = i / 10;
    h.inner_steps = 8;
    h.tokens = 8 * 512;
    h.learner_step = i * 8;
    h.train_loss = 2.5f;
    h.send_time_us = 1;
    CodecOptions codec;
    codec.dtype = parse_dtype(dtypes[i % 4]);
    auto tensors = random_tensors(layout, h.fragment, rng);
    by_token[i] = encode_delta(h, std::span<const DenseTensor>(tensors), codec);
    producer.produce({.topic = topics.deltas(h.region),
                      .partition = static_cast<int32_t>(h.fragment % 3),
                      .key = std::to_string(h.fragment),
                      .value = by_token[i],
                      .headers = delta_headers(h)},
                     i, 10000);
  }
  REQUIRE(producer.flush(30000) == 0);
  REQUIRE(reports.size() == 100);
  for (const auto& r : reports) {
    INFO(r.error);
    REQUIRE(r.ok);
    sent[{r.topic, r.partition, r.offset}] = by_token.at(r.token);
  }

  ConsumerOptions options{.kafka = kafka, .group_id = run + "-group", .topics = {topics.deltas_pattern()}};
  Consumer consumer(options);
  auto received = consume(consumer, 100, 60s);
  REQUIRE(received.size() == 100);

  DecodeLimits limits{.run_id = run, .fingerprint = layout.fingerprint, .layout = &layout};
  std::set<Position> seen;
  std::vector<TopicPartitionOffset> commits;
  for (const auto& m : received) {
    Position key{m.topic, m.partition, m.offset};
    REQUIRE(sent.count(key) == 1);
    REQUIRE(seen.insert(key).second);  // no duplicates
    REQUIRE(m.value == sent[key]);     // byte-identical
    Delta d = decode_delta(m.value, limits);
    CHECK(header_value(m.headers, "learner") == d.header.learner_id);
    CHECK(header_value(m.headers, "region") == d.header.region);
    CHECK(header_value(m.headers, "fragment") == std::to_string(d.header.fragment));
    CHECK(header_value(m.headers, "base_version") == std::to_string(d.header.base_version));
    CHECK(m.partition == static_cast<int32_t>(d.header.fragment % 3));  // fragment p -> partition p mod NP
    CHECK(m.key == std::to_string(d.header.fragment));
    commits.push_back({m.topic, m.partition, m.offset + 1});
  }
  consumer.commit(commits);
  // Committed offsets read back from the group coordinator.
  auto committed = consumer.committed(commits, 10000);
  for (size_t i = 0; i < commits.size(); ++i) CHECK(committed[i].offset >= commits[i].offset);
}

TEST_CASE("range assignor gives one member partition i of every region topic", "[kafka]") {
  KafkaOptions kafka = testing::require_broker();
  std::string run = testing::unique_run_id("range");
  RunTopics topics = testing::create_run(kafka, run, {"a", "b", "c"}, 4);

  struct Recorder : RebalanceListener {
    std::vector<TopicPartitionOffset> assigned;
    void on_assigned(const std::vector<TopicPartitionOffset>& p) override { assigned = p; }
    void on_revoked(const std::vector<TopicPartitionOffset>&) override { assigned.clear(); }
  } first, second;
  ConsumerOptions options{.kafka = kafka, .group_id = run + "-mergers", .topics = {topics.deltas_pattern()}};
  Consumer c1(options, &first);
  Consumer c2(options, &second);
  auto deadline = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < deadline && (first.assigned.size() + second.assigned.size() != 12 ||
                                                         first.assigned.empty() || second.assigned.empty())) {
    c1.poll(100);
    c2.poll(100);
  }
  REQUIRE(first.assigned.size() + second.assigned.size() == 12);
  auto partitions_of = [](const std::vector<TopicPartitionOffset>& list, const std::string& topic) {
    std::set<int32_t> out;
    for (const auto& tp : list)
      if (tp.topic == topic) out.insert(tp.partition);
    return out;
  };
  for (auto* member : {&first, &second}) {
    auto a = partitions_of(member->assigned, topics.deltas("a"));
    CHECK(a.size() == 2);
    CHECK(partitions_of(member->assigned, topics.deltas("b")) == a);
    CHECK(partitions_of(member->assigned, topics.deltas("c")) == a);
  }
}

TEST_CASE("transactions: committed records and offsets are visible, aborted ones are not", "[kafka][transactions]") {
  KafkaOptions kafka = testing::require_broker();
  std::string run = testing::unique_run_id("txn");
  RunTopics topics = testing::create_run(kafka, run, {"r0"}, 2);

  // A delta for the group to consume, so there is a consumer group whose offsets go in the txn.
  std::vector<uint8_t> payload = {1, 2, 3, 4};
  {
    Producer plain({.kafka = kafka}, nullptr);
    plain.produce({.topic = topics.deltas("r0"), .partition = 0, .key = "0", .value = payload}, 0, 10000);
    REQUIRE(plain.flush(20000) == 0);
  }
  ConsumerOptions consumer_options{.kafka = kafka, .group_id = run + "-mergers", .topics = {topics.deltas_pattern()}};
  Consumer group_member(consumer_options);
  auto in = consume(group_member, 1, 60s);
  REQUIRE(in.size() == 1);

  int failures = 0;
  ProducerOptions txn_options{.kafka = kafka, .transactional_id = run + "-merger-0"};
  Producer txn(txn_options, [&](const DeliveryReport& r) { failures += r.ok ? 0 : 1; });
  txn.init_transactions(30000);

  std::vector<uint8_t> committed_value = {'c', 'o', 'm', 'm', 'i', 't'};
  std::vector<uint8_t> aborted_value = {'a', 'b', 'o', 'r', 't'};
  txn.begin_transaction();
  txn.produce({.topic = topics.merges(), .partition = 0, .key = "0", .value = aborted_value}, 1, 10000);
  txn.abort_transaction(30000);

  txn.begin_transaction();
  txn.produce({.topic = topics.merges(), .partition = 0, .key = "0", .value = committed_value}, 2, 10000);
  txn.produce({.topic = topics.state(), .partition = 0, .key = "0", .value = committed_value}, 3, 10000);
  REQUIRE(txn.flush(20000) == 0);
  // While the transaction is open, a read_committed reader's end stops short of the log's end.
  LogReader reader(kafka);
  auto open = reader.wait_until_stable({{topics.merges(), 0, 0}}, 300);
  REQUIRE(open.size() == 1);
  CHECK(open[0].stable < open[0].high);
  txn.send_offsets_to_transaction({{in[0].topic, in[0].partition, in[0].offset + 1}}, group_member.raw(), 30000);
  txn.commit_transaction(30000);

  // commit_transaction returns once the coordinator has decided; the commit markers reach the
  // partitions a moment later. Once the partitions are stable, one read sees the record.
  CHECK(reader.wait_until_stable({{topics.merges(), 0, 0}, {topics.state(), 0, 0}}, 30000).empty());
  std::vector<std::vector<uint8_t>> merges;
  read_to_end(kafka, {topics.merges()}, [&](const ConsumedMessage& m) { merges.push_back(m.value); }, 60000);
  REQUIRE(merges.size() == 1);
  CHECK(merges[0] == committed_value);

  auto committed = group_member.committed({{in[0].topic, in[0].partition, -1}}, 10000);
  CHECK(committed[0].offset == in[0].offset + 1);

  SECTION("a second instance with the same transactional id fences the first (zombie)") {
    Producer successor(txn_options, nullptr);
    successor.init_transactions(30000);
    bool fenced = false;
    try {
      txn.begin_transaction();
      txn.produce({.topic = topics.merges(), .partition = 0, .key = "0", .value = aborted_value}, 4, 10000);
      txn.commit_transaction(30000);
    } catch (const Fenced&) {
      fenced = true;
    } catch (const Error& e) {
      // Depending on timing the fence surfaces on produce's delivery or on commit.
      fenced = std::string(e.what()).find("fenced") != std::string::npos ||
               std::string(e.what()).find("Fenced") != std::string::npos;
      INFO(e.what());
    }
    CHECK(fenced);
    std::vector<std::vector<uint8_t>> after;
    read_to_end(kafka, {topics.merges()}, [&](const ConsumedMessage& m) { after.push_back(m.value); }, 60000);
    CHECK(after.size() == 1);  // the zombie's write never became visible
  }
}

TEST_CASE("message size limit: 48 MiB passes end to end, above the limit is refused clearly", "[kafka][limits]") {
  KafkaOptions kafka = testing::require_broker();
  std::string run = testing::unique_run_id("big");
  RunTopics topics = testing::create_run(kafka, run, {"r0"}, 1);

  std::vector<uint8_t> big(48u << 20);
  std::mt19937 rng(3);
  for (auto& b : big) b = static_cast<uint8_t>(rng());
  std::vector<DeliveryReport> reports;
  Producer producer({.kafka = kafka}, [&](const DeliveryReport& r) { reports.push_back(r); });
  producer.produce({.topic = topics.deltas("r0"), .partition = 0, .key = "0", .value = big}, 1, 10000);
  REQUIRE(producer.flush(60000) == 0);
  REQUIRE(reports.size() == 1);
  INFO(reports[0].error);
  REQUIRE(reports[0].ok);

  std::vector<uint8_t> too_big(kafka.max_message_bytes + 1);
  try {
    producer.try_produce({.topic = topics.deltas("r0"), .partition = 0, .key = "0", .value = too_big}, 2);
    FAIL("a message above max_message_bytes was accepted");
  } catch (const InvalidInput& e) {
    CHECK_THAT(e.what(), Catch::Contains("exceeds max_message_bytes"));
  }

  std::vector<ConsumedMessage> got;
  read_to_end(kafka, {topics.deltas("r0")}, [&](const ConsumedMessage& m) { got.push_back(m); }, 60000);
  REQUIRE(got.size() == 1);
  CHECK(got[0].value == big);
}

TEST_CASE("kafka_traffic counts the bytes of every client's broker sockets, both ways", "[kafka][traffic]") {
  KafkaOptions kafka = testing::require_broker();
  std::string run = testing::unique_run_id("traffic");
  RunTopics topics = testing::create_run(kafka, run, {"r0"}, 1);
  constexpr size_t kBytes = 4u << 20;
  std::vector<uint8_t> value(kBytes);
  std::mt19937 rng(5);
  for (auto& b : value) b = static_cast<uint8_t>(rng());  // incompressible

  const KafkaTraffic before = kafka_traffic();
  Producer producer({.kafka = kafka}, nullptr);
  producer.produce({.topic = topics.deltas("r0"), .partition = 0, .key = "0", .value = value}, 1, 10000);
  REQUIRE(producer.flush(30000) == 0);
  // Statistics arrive once a second, from the client's poll.
  CHECK(testing::eventually(
      [&] {
        producer.poll(100);
        return kafka_traffic().sent - before.sent >= kBytes;
      },
      10s));

  const KafkaTraffic produced = kafka_traffic();
  Consumer consumer(ConsumerOptions{.kafka = kafka});
  consumer.assign({{topics.deltas("r0"), 0, -2 /* beginning */}});
  bool got = false;
  CHECK(testing::eventually(
      [&] {
        if (auto m = consumer.poll(100)) got |= m->value.size() == kBytes;
        return got && kafka_traffic().received - produced.received >= kBytes;
      },
      20s));
  CHECK(got);
  // Requests are small: what the consumer sent is far below what it fetched.
  for (const auto& [name, t] : kafka_traffic_by_client()) UNSCOPED_INFO(name << ": sent " << t.sent << ", received " << t.received);
  CHECK(kafka_traffic().sent - produced.sent < kBytes / 16);

  // A statistics document is read for its client name and top-level counters only.
  CHECK(kafka_detail::record_statistics(R"({"name": "test#x-1", "tx_bytes": 10, "rx_bytes":20, "brokers":{}})"));
  CHECK(kafka_traffic_by_client().at("test#x-1").received == 20);
  CHECK_FALSE(kafka_detail::record_statistics(R"({"name":"test#x-2","tx":1})"));
}

TEST_CASE("one LogReader serves reads to the end, ranges and positions through one consumer, each exactly its own",
          "[kafka][logreader]") {
  KafkaOptions kafka = testing::require_broker();
  std::string run = testing::unique_run_id("reader");
  RunTopics topics = testing::create_run(kafka, run, {"r0"}, 2);
  const std::string topic = topics.deltas("r0");
  // Partition p holds values "p:0" .. "p:n-1" at offsets 0 .. n-1.
  const std::map<int32_t, int> counts{{0, 40}, {1, 25}};
  Producer producer({.kafka = kafka}, nullptr);
  uint64_t seq = 0;
  for (const auto& [p, n] : counts)
    for (int i = 0; i < n; ++i) {
      const std::string text = std::to_string(p) + ":" + std::to_string(i);
      const std::vector<uint8_t> bytes(text.begin(), text.end());
      producer.produce({.topic = topic, .partition = p, .key = "k", .value = bytes}, ++seq, 10000);
    }
  REQUIRE(producer.flush(30000) == 0);
  auto text_of = [](const ConsumedMessage& m) { return std::string(m.value.begin(), m.value.end()); };
  auto expected = [](int32_t p, int from, int to) {
    std::vector<std::string> out;
    for (int i = from; i < to; ++i) out.push_back(std::to_string(p) + ":" + std::to_string(i));
    return out;
  };

  LogReader reader(kafka);
  std::vector<std::string> got;
  auto collect = [&](const ConsumedMessage& m) { got.push_back(text_of(m)); };

  reader.read_to_end({{topic, 0, -2}}, collect, 60000);
  CHECK(got == expected(0, 0, 40));

  // A read of the other partition sees nothing of the first one's.
  got.clear();
  reader.read_to_end({{topic, 1, 10}}, collect, 60000);
  CHECK(got == expected(1, 10, 25));

  got.clear();
  reader.read_ranges({{topic, 0, 5, 9}, {topic, 1, 0, 2}}, collect, 60000);
  std::sort(got.begin(), got.end());
  CHECK(got == std::vector<std::string>{"0:5", "0:6", "0:7", "0:8", "1:0", "1:1"});

  const auto fetched = reader.fetch({{topic, 0, 3}, {topic, 0, 39}, {topic, 1, 24}, {topic, 1, 99}}, 60000);
  std::vector<std::string> texts;
  for (const auto& m : fetched) texts.push_back(text_of(m));
  std::sort(texts.begin(), texts.end());
  CHECK(texts == std::vector<std::string>{"0:3", "0:39", "1:24"});  // offset 99 does not exist

  // A read abandoned by an exception leaves nothing behind for the next one.
  int seen = 0;
  CHECK_THROWS_AS(reader.read_to_end({{topic, 0, -2}, {topic, 1, -2}},
                                     [&](const ConsumedMessage&) {
                                       if (++seen == 3) throw InvalidInput("stop here");
                                     },
                                     60000),
                  InvalidInput);
  got.clear();
  reader.read_to_end({{topic, 1, 20}}, collect, 60000);
  CHECK(got == expected(1, 20, 25));

  CHECK(reader.reads() == 6);
  CHECK(reader.partition_count(topic, 10000) == 2);

  // Offsets by broker timestamp: the first offset at or after a time, none after the last.
  std::vector<int64_t> stamps;
  reader.read_to_end({{topic, 0, -2}}, [&](const ConsumedMessage& m) { stamps.push_back(m.timestamp_ms); }, 60000);
  REQUIRE(stamps.size() == 40);
  const int64_t t = stamps[20];
  const auto first_at_t = std::find_if(stamps.begin(), stamps.end(), [&](int64_t s) { return s >= t; }) - stamps.begin();
  CHECK(reader.offset_at_time(topic, 0, t, 10000) == std::optional<int64_t>(first_at_t));
  CHECK(reader.offset_at_time(topic, 0, 0, 10000) == std::optional<int64_t>(0));
  CHECK_FALSE(reader.offset_at_time(topic, 0, *std::max_element(stamps.begin(), stamps.end()) + 1, 10000));
}

TEST_CASE("a read to the end that keeps receiving is never timed out, however long it takes in all",
          "[kafka][logreader]") {
  // A merger's recovery reads a checkpoint of several GB from `state`, decoding each segment as
  // it comes: the read takes longer in all than its timeout while every message arrives at once.
  // The timeout is for a log that stops answering, not for a long one.
  KafkaOptions kafka = testing::require_broker();
  std::string run = testing::unique_run_id("longread");
  RunTopics topics = testing::create_run(kafka, run, {"r0"}, 1);
  const std::string topic = topics.deltas("r0");
  Producer producer({.kafka = kafka}, nullptr);
  constexpr int kMessages = 12;
  for (int i = 0; i < kMessages; ++i) {
    const std::vector<uint8_t> bytes(1000, static_cast<uint8_t>(i));
    producer.produce({.topic = topic, .partition = 0, .key = "k", .value = bytes}, i + 1, 10000);
  }
  REQUIRE(producer.flush(30000) == 0);
  LogReader reader(kafka);
  constexpr int kTimeoutMs = 1000;
  int seen = 0;
  const auto t0 = std::chrono::steady_clock::now();
  // Each message takes 250 ms to handle: 3 s in all, three times the timeout.
  CHECK_NOTHROW(reader.read_to_end({{topic, 0, -2}},
                                   [&](const ConsumedMessage&) {
                                     ++seen;
                                     std::this_thread::sleep_for(250ms);
                                   },
                                   kTimeoutMs));
  CHECK(seen == kMessages);
  CHECK(std::chrono::steady_clock::now() - t0 > 2 * std::chrono::milliseconds(kTimeoutMs));
}

TEST_CASE("a topic that appears while a process looks for it is found, and one that never does is reported missing",
          "[kafka][metadata]") {
  const KafkaOptions kafka = testing::require_broker();
  const std::string late = testing::unique_run_id("late") + ".topic";
  // Created 1.5 s after the lookup begins, as when a process starts while scripts/broker topics
  // is still creating its run's topics (a loaded broker takes seconds to show a new topic).
  std::thread creator([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    create_topics(kafka, {TopicSpec{.name = late, .partitions = 3}}, 30000);
  });
  Consumer probe(ConsumerOptions{.kafka = kafka});
  int count = 0;
  CHECK_NOTHROW(count = probe.partition_count(late, 30000));
  creator.join();
  CHECK(count == 3);

  const std::string never = testing::unique_run_id("never") + ".topic";
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(probe.partition_count(never, 1500),
                    Catch::Contains("topic " + never + " does not exist") && Catch::Contains("scripts/broker topics"));
  // It looked for the whole time it was given, no longer than a little past it.
  const auto waited = std::chrono::steady_clock::now() - t0;
  CHECK(waited >= std::chrono::milliseconds(1400));
  CHECK(waited < std::chrono::seconds(10));
}
