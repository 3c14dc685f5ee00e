// The learner's parameter inbox against a test publisher posing as a merger (announced in the real
// broker's `members` topic): snapshots are taken as they are, updates are applied to the held
// version bit for bit, an update the inbox cannot apply (a version it missed) or whose result does
// not match its checksum makes it ask for a snapshot, and so do a version announced in `members`
// that never arrives and a held version whose checksum is not the one the merger announces.
#include <catch2/catch.hpp>

#include <optional>
#include <random>
#include <thread>

#include <zmq.hpp>

#include "core/codec/messages.h"
#include "core/kafka/producer.h"
#include "core/zmq/params_channel.h"
#include "learner/param_inbox.h"
#include "tests/integration/child_process.h"
#include "tests/integration/run_fixture.h"

using namespace diloco;
using namespace std::chrono_literals;

namespace {

const FragmentLayout kLayout{.fragments = {{{"w", {16, 24}}, {"b", {24}}}}, .fingerprint = 0x5eed};

std::vector<DenseTensor> random_tensors(std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<DenseTensor> out;
  for (uint32_t t = 0; t < kLayout.fragments[0].size(); ++t) {
    DenseTensor d{.index = t, .shape = kLayout.fragments[0][t].shape};
    d.values.resize(static_cast<size_t>(kLayout.fragments[0][t].numel()));
    for (auto& v : d.values) v = dist(rng);
    out.push_back(std::move(d));
  }
  return out;
}

// What a merger does for a new version: quantize a change, apply it to the previous version.
struct Version {
  FragmentParams full;                 // the version's parameters
  std::vector<QuantizedTensor> change;  // from the previous version
};

Version next_version(const FragmentParams& previous, std::mt19937& rng) {
  Version v{.full = previous};
  v.full.version = previous.version + 1;
  const auto step = random_tensors(rng, 0.01f);
  for (size_t t = 0; t < step.size(); ++t) {
    QuantizedTensor q = quantize(static_cast<uint32_t>(t), step[t].shape, step[t].values, DType::INT4, 32);
    std::vector<float> sent(step[t].values.size());
    dequantize(q, sent);
    apply_update(previous.tensors[t].values, sent, v.full.tensors[t].values);
    v.change.push_back(std::move(q));
  }
  v.full.checksum = checksum_fp32(v.full.tensors);
  return v;
}

std::vector<uint8_t> update_message(const Version& v) {
  FragmentParams header = v.full;
  header.update = true;
  header.base_version = v.full.version - 1;
  header.tensors.clear();
  return encode_fragment_update(header, v.change, {.dtype = DType::INT4, .block_size = 32});
}

// A test merger's announcement of fragment 0 at `version`.
Member merger_member(const std::string& run, const std::string& endpoint, uint64_t version) {
  return Member{.run_id = run, .instance_id = "test-merger", .role = Role::Merger, .endpoint = endpoint,
                .owned_fragments = {0}, .fragment_versions = {version}};
}

// Writes `m` to the run's `members` topic and waits until it is there.
void produce_member(Producer& producer, const RunTopics& topics, const Member& m) {
  producer.produce({.topic = topics.members(), .partition = 0, .key = m.instance_id, .value = encode_member(m)}, 0,
                   10000);
  REQUIRE(producer.flush(20000) == 0);
}

// A run's topics on the real broker and a test publisher posing as its merger.
struct InboxRun {
  KafkaOptions kafka = testing::require_broker();
  std::string run;
  RunTopics topics;
  zmq::context_t context;
  ParamsPublisher publisher{context, "tcp://127.0.0.1:*"};
  Producer producer{{.kafka = kafka}, nullptr};
  explicit InboxRun(const std::string& name)
      : run(testing::unique_run_id(name)), topics(testing::create_run(kafka, run, {"r0"}, 1)) {}
};

}  // namespace

TEST_CASE("the inbox applies updates bit for bit and asks for a snapshot when it cannot", "[learner][inbox]") {
  InboxRun r("inbox");
  auto& [kafka, run, topics, context, publisher, producer] = r;
  auto announce = [&](uint64_t version, std::optional<uint64_t> checksum = std::nullopt) {
    Member m = merger_member(run, publisher.bound_endpoint(), version);
    if (checksum) m.fragment_checksums = {*checksum};
    produce_member(producer, topics, m);
  };
  announce(1);

  Metrics metrics("test_");
  ParamInbox inbox({.kafka = kafka, .topics = topics,
                    .limits = {.run_id = run, .fingerprint = kLayout.fingerprint, .layout = &kLayout},
                    .request_delay_s = 0.3, .request_interval_s = 0.5},
                   metrics);
  // The inbox's subscription (it found the endpoint in `members`) is the connect.
  REQUIRE(testing::eventually([&] { return !publisher.take_requests().joined.empty(); }, 30s));

  std::mt19937 rng(7);
  FragmentParams v1{.run_id = run, .fingerprint = kLayout.fingerprint, .fragment = 0, .version = 1,
                    .merger_instance = "test-merger", .epoch = 1, .tensors = random_tensors(rng, 1.0f)};
  v1.checksum = checksum_fp32(v1.tensors);
  auto take_version = [&](uint64_t want) -> std::optional<FragmentParams> {
    std::optional<FragmentParams> got;
    testing::eventually(
        [&] {
          for (auto& p : inbox.take({0}))
            if (p->version == want) got = *p;
          return got.has_value();
        },
        10s);
    return got;
  };
  auto requested = [&](std::chrono::seconds within) {
    return testing::eventually(
        [&] {
          for (const auto& [id, fragments] : publisher.take_requests().fragments)
            if (fragments.count(0)) return true;
          return false;
        },
        within);
  };

  // A snapshot, then an update on it: the reconstruction has the merger's bits.
  const auto snapshot = encode_fragment_params(v1);
  auto got = testing::eventually(
      [&] {
        publisher.publish(0, snapshot);
        return inbox.received() > 0;
      },
      10s);
  REQUIRE(got);
  REQUIRE(take_version(1));
  const Version v2 = next_version(v1, rng);
  announce(2);
  const auto update2 = update_message(v2);
  publisher.publish(0, update2);
  auto taken = take_version(2);
  REQUIRE(taken);
  CHECK(taken->checksum == v2.full.checksum);
  CHECK(checksum_fp32(taken->tensors) == v2.full.checksum);
  for (size_t t = 0; t < v2.full.tensors.size(); ++t) CHECK(taken->tensors[t].values == v2.full.tensors[t].values);
  CHECK(metrics.value("params_received_total", {{"kind", "update"}}) == 1);
  // What was applied, by kind, in message bytes (the snapshot's repeats were already held).
  CHECK(inbox.snapshots() == 1);
  CHECK(inbox.snapshot_bytes() == snapshot.size());
  CHECK(inbox.updates() == 1);
  CHECK(inbox.update_bytes() == update2.size());

  // Version 3 is lost on the way: the update to 4 cannot be applied; the inbox asks at once.
  const Version v3 = next_version(v2.full, rng);
  const Version v4 = next_version(v3.full, rng);
  publisher.take_requests();
  publisher.publish(0, update_message(v4));
  CHECK(requested(5s));
  CHECK(inbox.take({0}).empty());
  CHECK(metrics.value("params_updates_unusable_total") >= 1);
  publisher.publish(0, encode_fragment_params(v4.full));
  taken = take_version(4);
  REQUIRE(taken);
  CHECK(checksum_fp32(taken->tensors) == v4.full.checksum);

  // An update whose result does not match its checksum is rejected, never taken, and the inbox
  // asks for a snapshot.
  Version v5 = next_version(v4.full, rng);
  v5.full.checksum ^= 1;
  publisher.take_requests();
  const uint64_t rejected_before = inbox.rejected();
  publisher.publish(0, update_message(v5));
  CHECK(testing::eventually([&] { return inbox.rejected() > rejected_before; }, 5s));
  CHECK(requested(5s));
  CHECK(inbox.take({0}).empty());
  CHECK(metrics.value("params_rejected_total", {{"reason", "corrupt_frame"}}) == 1);

  // A heartbeat naming the held version with other bits: the inbox asks for a snapshot.
  publisher.take_requests();
  announce(4, v4.full.checksum);
  std::this_thread::sleep_for(1s);
  CHECK(metrics.value("params_checksum_mismatch_total") == 0);
  announce(4, v4.full.checksum ^ 1);
  CHECK(requested(10s));
  CHECK(metrics.value("params_checksum_mismatch_total") == 1);

  // A version announced in `members` that never arrives is asked for after request_delay_s.
  publisher.take_requests();
  announce(9);
  CHECK(requested(10s));

  // A snapshot in segments, as a merger sends one above codec.segment_bytes (408 values: 5
  // segments of at most 100): with a segment lost on the way it is rejected and asked for again;
  // sent whole, it is decoded into place and taken with the merger's bits.
  FragmentParams v10{.run_id = run, .fingerprint = kLayout.fingerprint, .fragment = 0, .version = 10,
                     .merger_instance = "test-merger", .epoch = 1, .tensors = random_tensors(rng, 1.0f)};
  v10.checksum = checksum_fp32(v10.tensors);
  std::vector<std::vector<uint8_t>> segments;
  for_each_fragment_params_segment(v10, v10.tensors, 400, 1, [&](uint32_t, uint32_t, std::span<const uint8_t> b) {
    segments.emplace_back(b.begin(), b.end());
  });
  REQUIRE(segments.size() == 5);
  announce(10);
  const uint64_t rejected_before_segments = inbox.rejected();
  for (size_t i = 0; i < segments.size(); ++i)
    if (i != 1) publisher.publish(0, segments[i]);
  CHECK(testing::eventually([&] { return inbox.rejected() > rejected_before_segments; }, 5s));
  CHECK(metrics.value("params_rejected_total", {{"reason", "chunk_mismatch"}}) >= 1);
  CHECK(inbox.take({9}).empty());
  CHECK(requested(10s));
  std::optional<FragmentParams> whole;
  testing::eventually(
      [&] {
        for (const auto& segment : segments) publisher.publish(0, segment);
        for (auto& p : inbox.take({9}))
          if (p->version == 10) whole = *p;
        return whole.has_value();
      },
      10s);
  REQUIRE(whole);
  CHECK(checksum_fp32(whole->tensors) == v10.checksum);
  for (size_t t = 0; t < v10.tensors.size(); ++t) CHECK(whole->tensors[t].values == v10.tensors[t].values);
  CHECK(metrics.value("params_segments_received_total") >= 4);

  // A snapshot whose segments take longer to arrive than the asks' back-off (one every 0.8 s,
  // 4 s in all, against asks 0.5, 1 and 2 s apart): the gap is asked for once, and not again
  // while its segments keep coming (a merger serving the ask would send the fragment twice).
  FragmentParams v11 = v10;
  v11.version = 11;
  v11.tensors = random_tensors(rng, 1.0f);
  v11.checksum = checksum_fp32(v11.tensors);
  std::vector<std::vector<uint8_t>> slow;
  for_each_fragment_params_segment(v11, v11.tensors, 400, 1, [&](uint32_t, uint32_t, std::span<const uint8_t> b) {
    slow.emplace_back(b.begin(), b.end());
  });
  publisher.take_requests();
  announce(11);
  REQUIRE(requested(10s));
  int asked_again = 0;
  for (const auto& segment : slow) {
    publisher.publish(0, segment);
    std::this_thread::sleep_for(800ms);
    for (const auto& [id, fragments] : publisher.take_requests().fragments) asked_again += fragments.count(0);
  }
  CHECK(asked_again == 0);
  std::optional<FragmentParams> v11_taken;
  testing::eventually(
      [&] {
        for (auto& p : inbox.take({10}))
          if (p->version == 11) v11_taken = *p;
        return v11_taken.has_value();
      },
      5s);
  REQUIRE(v11_taken);
  CHECK(checksum_fp32(v11_taken->tensors) == v11.checksum);
}

TEST_CASE("an inbox that starts from the versions the learner read asks for nothing and applies the next update",
          "[learner][inbox]") {
  KafkaOptions kafka = testing::require_broker();
  const std::string run = testing::unique_run_id("inbox-held");
  RunTopics topics = testing::create_run(kafka, run, {"r0"}, 1);
  zmq::context_t context;
  ParamsPublisher publisher(context, "tcp://127.0.0.1:*");

  std::mt19937 rng(11);
  FragmentParams v3{.run_id = run, .fingerprint = kLayout.fingerprint, .fragment = 0, .version = 3,
                    .merger_instance = "test-merger", .epoch = 1, .tensors = random_tensors(rng, 1.0f)};
  v3.checksum = checksum_fp32(v3.tensors);
  Member m = merger_member(run, publisher.bound_endpoint(), 3);
  m.fragment_checksums = {v3.checksum};
  Producer producer({.kafka = kafka}, nullptr);
  produce_member(producer, topics, m);

  Metrics metrics("test_");
  ParamInbox inbox({.kafka = kafka, .topics = topics,
                    .limits = {.run_id = run, .fingerprint = kLayout.fingerprint, .layout = &kLayout},
                    .request_delay_s = 0.2, .request_interval_s = 0.5, .held = {std::make_shared<const FragmentParams>(v3)}},
                   metrics);
  REQUIRE(testing::eventually([&] { return !publisher.take_requests().joined.empty(); }, 30s));
  // The heartbeat names the held version: nothing to ask for.
  std::this_thread::sleep_for(1500ms);
  const auto requests = publisher.take_requests();
  CHECK(requests.fragments.empty());
  CHECK(metrics.value("params_requested_total") == 0);

  // The next version arrives as an update on the held one and is taken without a snapshot.
  const Version v4 = next_version(v3, rng);
  std::optional<FragmentParams> got;
  testing::eventually(
      [&] {
        publisher.publish(0, update_message(v4));
        for (auto& p : inbox.take({3})) got = *p;
        return got.has_value();
      },
      10s);
  REQUIRE(got);
  CHECK(got->version == 4);
  CHECK(checksum_fp32(got->tensors) == v4.full.checksum);
  CHECK(metrics.value("params_requested_total") == 0);
}

TEST_CASE("a version announced before the inbox started is asked for at once, later gaps after the delay",
          "[learner][inbox]") {
  InboxRun r("inbox-catch-up");
  auto& [kafka, run, topics, context, publisher, producer] = r;
  auto announce = [&](uint64_t version) { produce_member(producer, topics, merger_member(run, publisher.bound_endpoint(), version)); };
  // A restarted learner: the run is at version 5, published before this inbox subscribed.
  announce(5);
  Metrics metrics("test_");
  // The delay is far longer than the test waits: only the catch-up rule can ask in time.
  ParamInbox inbox({.kafka = kafka, .topics = topics,
                    .limits = {.run_id = run, .fingerprint = kLayout.fingerprint, .layout = &kLayout},
                    .request_delay_s = 60, .request_interval_s = 0.5},
                   metrics);
  auto asked_for_fragment = [&](std::chrono::milliseconds within) {
    return testing::eventually(
        [&] {
          for (const auto& [id, fragments] : publisher.take_requests().fragments)
            if (fragments.count(0)) return true;
          return false;
        },
        within);
  };
  CHECK(asked_for_fragment(20s));

  // After the catch-up, a version announced and not yet arrived may be on its way: no ask before
  // request_delay_s. Answer the first ask so that nothing is wanted any more.
  std::mt19937 rng(3);
  FragmentParams v5{.run_id = run, .fingerprint = kLayout.fingerprint, .fragment = 0, .version = 5,
                    .merger_instance = "test-merger", .epoch = 1, .tensors = random_tensors(rng, 1.0f)};
  v5.checksum = checksum_fp32(v5.tensors);
  REQUIRE(testing::eventually(
      [&] {
        publisher.publish(0, encode_fragment_params(v5));
        return inbox.received() > 0;
      },
      10s));
  std::this_thread::sleep_for(1500ms);  // asks sent before the snapshot arrived
  publisher.take_requests();
  announce(6);
  CHECK_FALSE(asked_for_fragment(3000ms));
}

TEST_CASE("a fragment whose merger stopped announcing is reported silent, and not once it announces again",
          "[learner][inbox]") {
  KafkaOptions kafka = testing::require_broker();
  const std::string run = testing::unique_run_id("inbox-silent");
  RunTopics topics = testing::create_run(kafka, run, {"r0"}, 1);
  Producer producer({.kafka = kafka}, nullptr);
  auto produce = [&](const Member& m) { produce_member(producer, topics, m); };
  Member merger = merger_member(run, "tcp://127.0.0.1:9", 4);
  merger.announce_interval_s = 0.25f;
  const Member learner{.run_id = run, .instance_id = "test-learner", .role = Role::Learner};
  produce(merger);
  Metrics metrics("test_");
  ParamInbox inbox({.kafka = kafka, .topics = topics,
                    .limits = {.run_id = run, .fingerprint = kLayout.fingerprint, .layout = &kLayout}},
                   metrics);
  // Another process's record 1.5 s after the merger's last announcement: 6 intervals of silence.
  std::this_thread::sleep_for(1500ms);
  produce(learner);
  CHECK(testing::eventually([&] { return inbox.owner_silent(0, 2); }, 20s));
  CHECK_FALSE(inbox.owner_silent(0, 20));  // about 6 intervals are not 20
  produce(merger);
  CHECK(testing::eventually([&] { return !inbox.owner_silent(0, 2); }, 20s));
}

// Whatever fails in a turn of the inbox's thread (an exception leaving it would end the learner)
// is counted and said, and the inbox goes on receiving.
TEST_CASE("an unforeseen failure in the inbox's thread is counted and the inbox goes on", "[learner][inbox]") {
  InboxRun r("inbox-throw");
  auto& [kafka, run, topics, context, publisher, producer] = r;
  produce_member(producer, topics, merger_member(run, publisher.bound_endpoint(), 1));

  Metrics metrics("test_");
  setenv("DILOCO_FAULT_INBOX_THROW", "3", 1);
  ParamInbox inbox({.kafka = kafka, .topics = topics,
                    .limits = {.run_id = run, .fingerprint = kLayout.fingerprint, .layout = &kLayout}},
                   metrics);
  unsetenv("DILOCO_FAULT_INBOX_THROW");
  REQUIRE(testing::eventually([&] { return metrics.value("inbox_errors_total") == 1; }, 10s));
  std::mt19937 rng(9);
  FragmentParams v1{.run_id = run, .fingerprint = kLayout.fingerprint, .fragment = 0, .version = 1,
                    .merger_instance = "test-merger", .epoch = 1, .tensors = random_tensors(rng, 1.0f)};
  v1.checksum = checksum_fp32(v1.tensors);
  const auto snapshot = encode_fragment_params(v1);
  REQUIRE(testing::eventually(
      [&] {
        publisher.publish(0, snapshot);
        for (auto& p : inbox.take({0}))
          if (p->version == 1) return true;
        return false;
      },
      30s));
  CHECK(metrics.value("inbox_errors_total") == 1);
}
