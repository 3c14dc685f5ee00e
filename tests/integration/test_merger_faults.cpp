// The merger's fault paths, each against the real broker with hand-made deltas and a real merger
// process: a merge whose commit fails, a recovery that fails, a restart at a checkpoint before a
// learner adopted it, a backlog of one learner's deltas after an outage, a forged delta carrying a
// real learner's id, a duplicate, and a delta in the wrong partition. Every case ends with the
// audit of the whole run (tests/integration/run_audit.h).
#include <catch2/catch.hpp>

#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/codec/chunk.h"
#include "core/fragments/message_budget.h"

#include "core/kafka/consumer.h"
#include "core/kafka/log_reader.h"
#include "core/kafka/producer.h"
#include "merger/recovery.h"
#include "tests/integration/child_process.h"
#include "tests/integration/run_audit.h"
#include "tests/integration/run_fixture.h"

using namespace diloco;
using namespace std::chrono_literals;

namespace {

constexpr int kPartitions = 2;  // tiny has 4 fragments: 0 and 2 in partition 0, 1 and 3 in 1

struct FaultRun {
  KafkaOptions kafka = testing::require_broker();
  std::string run;
  RunTopics topics;
  std::string dir;
  RunConfig config;
  std::shared_ptr<const FragmentLayout> layout;
  std::vector<std::string> sets;
  int session_timeout_ms = 6000;  // of the mergers started from here on

  FaultRun(const std::string& name, std::vector<std::string> extra)
      : run(testing::unique_run_id(name)), topics(testing::create_run(kafka, run, {"r0"}, kPartitions)),
        dir(testing::temp_dir(name)), config(testing::tiny_config(run, extra)),
        layout(std::make_shared<const FragmentLayout>(builtin_layout(config))) {
    sets = {"--set", "run.id=\"" + run + "\""};
    for (const auto& e : extra) sets.insert(sets.end(), {"--set", e});
  }

  // A merger process; `faults` are DILOCO_FAULT_* variables for this child only.
  // `folder` names its run folder (default: the id).
  std::unique_ptr<testing::ChildProcess> merger(const std::string& id,
                                                const std::vector<std::pair<std::string, std::string>>& faults = {},
                                                std::string folder = "") {
    if (folder.empty()) folder = id;
    std::vector<std::string> args = {testing::merger_binary(), "-c", testing::tiny_config_path(), "--id", id,
                                     "--bootstrap", kafka.bootstrap_servers, "--run-dir", dir + "/" + folder,
                                     "--session-timeout-ms", std::to_string(session_timeout_ms)};
    args.insert(args.end(), sets.begin(), sets.end());
    for (const auto& [k, v] : faults) setenv(k.c_str(), v.c_str(), 1);
    auto child = std::make_unique<testing::ChildProcess>(args, dir + "/" + folder + ".log");
    for (const auto& [k, v] : faults) unsetenv(k.c_str());
    return child;
  }

  // A well-formed fp32 delta of `fragment` from `learner` (every value `value`).
  std::vector<uint8_t> delta(const std::string& learner, uint32_t fragment, uint64_t seq, uint64_t base,
                             float value = 1e-3f) const {
    DeltaHeader h{.run_id = run, .fingerprint = layout->fingerprint, .learner_id = learner, .region = "r0",
                  .fragment = fragment, .seq = seq, .base_version = base, .inner_steps = 10,
                  .tokens = static_cast<uint64_t>(10 * config.train.batch * config.model.context), .learner_step = seq};
    std::vector<DenseTensor> tensors;
    for (const auto& spec : layout->fragments.at(fragment))
      tensors.push_back(DenseTensor{static_cast<uint32_t>(tensors.size()), spec.shape,
                                    std::vector<float>(static_cast<size_t>(spec.numel()), value)});
    return encode_delta(h, std::span<const DenseTensor>(tensors), CodecOptions{.dtype = DType::F32});
  }

  // Sends each payload to partition `partition` of the region topic, in order.
  void send(const std::vector<std::pair<int32_t, std::vector<uint8_t>>>& payloads) const {
    Producer producer({.kafka = kafka}, nullptr);
    for (const auto& [partition, value] : payloads)
      producer.produce({.topic = topics.deltas("r0"), .partition = partition, .key = "", .value = value}, 0, 10000);
    REQUIRE(producer.flush(20000) == 0);
  }

  DecodeLimits limits() const { return run_decode_limits(config, *layout); }
  LogContext context() const {
    return LogContext{.kafka = kafka, .topics = topics, .config = &config, .layout = layout, .limits = limits()};
  }

  std::vector<MergeRecord> records() const {
    const DecodeLimits limits = this->limits();
    std::vector<MergeRecord> out;
    read_to_end(kafka, {topics.merges()}, [&](const ConsumedMessage& m) { out.push_back(decode_merge_record(m.value, limits)); },
                30000);
    return out;
  }
  // Merge records of one fragment (neither its genesis nor accounting-only records).
  std::vector<MergeRecord> merges_of(uint32_t fragment) const {
    std::vector<MergeRecord> out;
    for (auto& r : records())
      if (r.fragment == fragment && is_merge(r)) out.push_back(std::move(r));
    return out;
  }
  // Every drop of one fragment's records, with its reason.
  std::vector<DroppedDelta> drops_of(uint32_t fragment) const {
    std::vector<DroppedDelta> out;
    for (auto& r : records())
      if (r.fragment == fragment)
        for (auto& d : r.dropped) out.push_back(std::move(d));
    return out;
  }
  size_t count(const std::string& id, const std::string& event) const {
    size_t n = 0;
    for (const auto& j : testing::read_json_lines(dir + "/" + id + "/metrics.jsonl"))
      if (j.value("event", "") == event) ++n;
    return n;
  }
  // Version 0 of every fragment, proposed as a learner does and committed by the running merger `id`.
  void genesis(const std::string& id) const {
    testing::propose_genesis(kafka, config);
    CHECK(count(id, "genesis") == layout->num_fragments());
  }
  // A counter in the `stop` line of merger run folder `folder`, summed over its label sets.
  double stop_metric(const std::string& folder, const std::string& name) const {
    const auto stop = testing::last_event(dir + "/" + folder + "/metrics.jsonl", "stop");
    REQUIRE(stop.has_value());
    double sum = 0;  // keys "<prefix><name>{labels}"
    for (const auto& [key, v] : stop->at("metrics").items()) {
      const auto at = key.find(name);
      const size_t end = at + name.size();
      if (at != std::string::npos && (end == key.size() || key[end] == '{') && v.is_number()) sum += v.get<double>();
    }
    return sum;
  }
  void stop_and_audit(testing::ChildProcess& merger) const {
    merger.signal(SIGTERM);
    auto code = merger.wait_exit(60s);
    INFO(merger.log());
    REQUIRE(code.has_value());
    CHECK(*code == 0);
    auto audit = testing::audit_run(kafka, config, {"r0"});
    INFO(audit.report());
    CHECK(audit.ok());
  }
};

}  // namespace

TEST_CASE("a merge whose commit fails and a recovery that fails lose no delta: the merger rebuilds and reads them again",
          "[merger][faults]") {
  FaultRun r("fail-commit", {"merger.quorum=1"});
  // The first recovery (at the assignment) and the first merge commit fail (commits 1 to 4 are the
  // fragments' version 0).
  auto merger = r.merger("M0", {{"DILOCO_FAULT_FAIL_RECOVERY", "1"}, {"DILOCO_FAULT_FAIL_COMMIT", "5"}});
  r.genesis("M0");
  CHECK(r.count("M0", "recovery_failed") == 1);
  r.send({{0, r.delta("a", 0, 1, 0)}, {0, r.delta("b", 2, 1, 0)}});
  INFO(merger->log());
  REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == 1 && r.merges_of(2).size() == 1; }, 60s));
  CHECK(r.count("M0", "merge_failed") == 1);
  CHECK(r.count("M0", "rewound") == 1);
  // The later deltas merge on top, and nothing is merged twice.
  r.send({{0, r.delta("a", 0, 2, 1)}, {0, r.delta("b", 2, 2, 1)}});
  REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == 2 && r.merges_of(2).size() == 2; }, 60s));
  CHECK(merger->running());
  r.stop_and_audit(*merger);
}

namespace {

// A merger stopped by the SIGTERM that its DILOCO_FAULT_STOP_AT sent inside a failure exits 0
// having written nothing past the committed version 0 (no record continues a version the log
// does not hold); a merger restarted under the same id then merges every delta the first held.
void check_stop_inside_failure(FaultRun& r, testing::ChildProcess& first, const std::vector<uint32_t>& fragments) {
  auto code = first.wait_exit(60s);
  INFO(first.log());
  REQUIRE(code.has_value());
  CHECK(*code == 0);
  CHECK(r.count("M0", "stop_unrecovered") == 1);
  CHECK(r.count("M0", "stop_record") == 0);
  for (const auto& record : r.records()) CHECK(record.version == 0);
  auto second = r.merger("M0", {}, "M0-restart");
  INFO(second->log());
  const bool merged = testing::eventually([&] {
    for (uint32_t p : fragments)
      if (r.merges_of(p).size() != 1) return false;
    return true;
  }, 60s);
  CHECK(merged);  // the held deltas were read again, not skipped past
  r.stop_and_audit(*second);
  for (uint32_t p : fragments) CHECK(r.merges_of(p).size() == 1);
}

}  // namespace

TEST_CASE("a stop at the instant a merge's commit fails writes nothing, and the restarted merger merges the delta once",
          "[merger][faults][stop]") {
  FaultRun r("stop-failed-commit", {"merger.quorum=1"});
  // Commit 5 is the first merge (1 to 4 are the fragments' version 0); the SIGTERM comes with it,
  // while the merged version 1 is held in memory and not in the log.
  auto merger = r.merger("M0", {{"DILOCO_FAULT_FAIL_COMMIT", "5"}, {"DILOCO_FAULT_STOP_AT", "1"}});
  r.genesis("M0");
  r.send({{0, r.delta("a", 0, 1, 0)}});
  check_stop_inside_failure(r, *merger, {0});
  CHECK(r.count("M0", "merge_failed") == 1);
}

TEST_CASE("a stop during a failed recovery writes no offsets past the deltas it held: the restart merges them",
          "[merger][faults][stop]") {
  FaultRun r("stop-failed-recovery", {"merger.quorum=1"});
  // The first merge's commit fails, then the recovery after it (the second: the first was at the
  // assignment) fails too, and the SIGTERM comes with that second fault.
  auto merger = r.merger("M0", {{"DILOCO_FAULT_FAIL_COMMIT", "5"}, {"DILOCO_FAULT_FAIL_RECOVERY", "2"},
                                {"DILOCO_FAULT_STOP_AT", "2"}});
  r.genesis("M0");
  r.send({{0, r.delta("a", 0, 1, 0)}, {0, r.delta("b", 2, 1, 0)}});
  check_stop_inside_failure(r, *merger, {0, 2});
  CHECK(r.count("M0", "merge_failed") == 1);
  CHECK(r.count("M0", "recovery_failed") == 1);
}

TEST_CASE("audit names an accounting record that continues a version the log never reached", "[merger][faults][audit]") {
  FaultRun r("audit-ahead", {"merger.quorum=1"});
  auto merger = r.merger("M0");
  r.genesis("M0");
  r.stop_and_audit(*merger);  // a clean run: the audit passes
  // What a merger stopped after a failed merge commit once wrote: an accounting-only record of
  // fragment 0 at version 1, while the log holds only version 0.
  MergeRecord ahead;
  for (const auto& record : r.records())
    if (record.genesis && record.fragment == 0) ahead = record;
  REQUIRE(ahead.genesis);
  ahead.genesis = false;
  ahead.inputs.clear();
  ahead.version = ahead.prev_version = 1;
  Producer producer({.kafka = r.kafka}, nullptr);
  producer.produce({.topic = r.topics.merges(), .partition = 0, .key = "0", .value = encode_merge_record(ahead)}, 0,
                   10000);
  REQUIRE(producer.flush(20000) == 0);
  auto audit = testing::audit_run(r.kafka, r.config, {"r0"});
  INFO(audit.report());
  CHECK_FALSE(audit.ok());
  REQUIRE(audit.problems.size() == 1);
  CHECK_THAT(audit.problems[0], Catch::Contains("fragment 0 (accounting only) continues version 1 but the log "
                                                "reached only version 0"));
}

TEST_CASE("a merger restarted at a checkpoint does not merge a learner's progress on that base again",
          "[merger][faults][recovery]") {
  FaultRun r("ckpt-base", {"merger.quorum=1", "merger.checkpoint_every=1"});
  auto merger = r.merger("M0");
  r.genesis("M0");
  r.send({{0, r.delta("a", 0, 1, 0)}});
  REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == 1; }, 60s));
  merger->signal(SIGKILL);
  merger->wait_exit(30s);
  // Learner a has not adopted version 1 yet: its next delta is still on base 0 and contains the
  // merged progress.
  r.send({{0, r.delta("a", 0, 2, 0)}});
  merger = r.merger("M0");
  INFO(merger->log());
  // The first process recovered nothing (no version 0 yet), the second every fragment.
  REQUIRE(testing::eventually([&] { return r.count("M0", "recovered") == r.layout->num_fragments(); }, 60s));
  std::this_thread::sleep_for(2s);  // time to read the delta and (wrongly) merge it
  r.stop_and_audit(*merger);  // the drop is in the clean stop's record
  CHECK(r.merges_of(0).size() == 1);
  std::map<uint64_t, DropReason> drops;
  for (const auto& d : r.drops_of(0)) drops[d.delta.seq] = d.reason;
  CHECK(drops.count(2));
  CHECK(drops[2] == DropReason::Superseded);

  // The checkpoint was encoded before its record's offset was known; recovery finds the record.
  const LogContext ctx = r.context();
  std::optional<LogPosition> produced_v1;
  for (const auto& m : read_merges(ctx, 0, -2))
    if (m.record.fragment == 0 && m.record.version == 1 && is_merge(m.record)) produced_v1 = m.position;
  const auto recovered = recover_partition(ctx, 0, std::vector<uint32_t>{0});
  CHECK(recovered.at(0).state.version == 1);
  for (const auto& record : recovered.at(0).replayed) CHECK_FALSE(is_merge(record));  // v1 is the checkpoint's
  REQUIRE(produced_v1);
  CHECK(recovered.at(0).state.last_merge == produced_v1);
}

TEST_CASE("a version 0 whose commit fails is committed from the proposal read again", "[merger][faults][genesis]") {
  FaultRun r("fail-genesis", {"merger.quorum=1"});
  auto merger = r.merger("M0", {{"DILOCO_FAULT_FAIL_COMMIT", "1"}});
  INFO(merger->log());
  r.genesis("M0");
  CHECK(r.count("M0", "genesis_failed") == 1);
  r.send({{0, r.delta("a", 0, 1, 0)}});
  REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == 1; }, 60s));
  r.stop_and_audit(*merger);
  size_t genesis_records = 0;
  for (const auto& record : r.records()) genesis_records += record.genesis;
  CHECK(genesis_records == r.layout->num_fragments());  // one each, none from the failed commit
}

TEST_CASE("after an outage a learner's newest delta on a base is merged, not its oldest", "[merger][faults]") {
  FaultRun r("backlog", {"merger.quorum=1"});
  {
    // Version 0 first: a delta of a fragment without one is rejected.
    auto first = r.merger("M0", {}, "M0-genesis");
    testing::propose_genesis(r.kafka, r.config);
    first->signal(SIGTERM);
    REQUIRE(first->wait_exit(60s) == std::optional<int>(0));
  }
  r.send({{0, r.delta("a", 0, 1, 0)}, {0, r.delta("a", 0, 2, 0)}, {0, r.delta("a", 0, 3, 0)}});
  std::this_thread::sleep_for(1500ms);  // older than the merger's catch-up age: a backlog
  auto merger = r.merger("M0");
  INFO(merger->log());
  REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == 1; }, 60s));
  const auto merges = r.merges_of(0);
  REQUIRE(merges.front().inputs.size() == 1);
  CHECK(merges.front().inputs.front().seq == 3);
  std::this_thread::sleep_for(1s);
  CHECK(r.merges_of(0).size() == 1);
  size_t replaced = 0;
  for (const auto& d : r.drops_of(0)) replaced += d.reason == DropReason::Superseded && d.delta.seq < 3;
  CHECK(replaced == 2);
  r.stop_and_audit(*merger);
}

TEST_CASE("a forged delta with a real learner's id, a duplicate and a delta in the wrong partition are recorded, "
          "and the learner's genuine deltas still merge",
          "[merger][faults][hostile]") {
  FaultRun r("forged", {"merger.quorum=1"});
  auto merger = r.merger("M0");
  r.genesis("M0");
  const auto genuine = r.delta("a", 0, 100, 0);
  // A base from the future and a seq far above the learner's: dropped as invalid.
  r.send({{0, r.delta("a", 0, uint64_t{1} << 47, 99)}, {0, genuine}});
  INFO(merger->log());
  REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == 1; }, 60s));
  // The same bytes again (a duplicate), the learner's next genuine delta, and fragment 1 in
  // partition 0 (fragment 1 lives in partition 1).
  r.send({{0, genuine}, {0, r.delta("a", 0, 101, 1)}, {0, r.delta("a", 1, 102, 0)}});
  REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == 2; }, 60s));
  // The learner restarts on a host whose clock is behind: lower seqs, on the version it adopted.
  r.send({{0, r.delta("a", 0, 7, 2)}});
  REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == 3; }, 60s));
  const auto merges = r.merges_of(0);
  CHECK(merges[0].inputs.front().seq == 100);
  CHECK(merges[1].inputs.front().seq == 101);
  CHECK(merges[2].inputs.front().seq == 7);
  std::map<uint64_t, DropReason> drops;
  for (const auto& d : r.drops_of(0)) drops[d.delta.seq] = d.reason;
  CHECK(drops[uint64_t{1} << 47] == DropReason::Invalid);
  CHECK(drops[100] == DropReason::Superseded);  // the duplicate: base already merged
  r.stop_and_audit(*merger);

  // diloco-replay list shows the merger's rejection, not "unaccounted".
  std::string out = r.dir + "/list.json";
  testing::ChildProcess list({DILOCO_BINARY_DIR "/bin/diloco-replay", "-c", testing::tiny_config_path(), "--run", r.run,
                              "--bootstrap", r.kafka.bootstrap_servers, "list", "--json"},
                             out);
  auto code = list.wait_exit(120s);
  INFO(list.log());
  REQUIRE(code == 0);
  size_t rows = 0, unaccounted = 0, wrong_partition = 0;
  for (const auto& row : testing::read_json_lines(out)) {
    if (!row.contains("offset")) continue;
    ++rows;
    unaccounted += row.value("fate", "") == "unaccounted";
    wrong_partition += row.value("fate", "") == "rejected" && row.value("reason", "") == "wrong_partition";
  }
  CHECK(rows == 6);
  CHECK(unaccounted == 0);
  CHECK(wrong_partition == 1);
}

TEST_CASE("a merge whose result is not finite changes nothing: its input is recorded as invalid and later deltas merge",
          "[merger][faults][hostile]") {
  FaultRun r("non-finite", {"merger.quorum=1"});
  auto merger = r.merger("M0");
  r.genesis("M0");
  // Finite on the wire (the decoder accepts it), but the outer step overflows to infinity.
  r.send({{0, r.delta("a", 0, 1, 0, 3e38f)}});
  INFO(merger->log());
  REQUIRE(testing::eventually([&] { return r.count("M0", "merge_abandoned") == 1; }, 60s));
  r.send({{0, r.delta("b", 0, 1, 0)}});
  REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == 1; }, 60s));
  const auto merges = r.merges_of(0);
  CHECK(merges[0].prev_version == 0);
  CHECK(merges[0].inputs.front().learner_id == "b");
  std::map<std::string, DropReason> drops;
  for (const auto& d : r.drops_of(0)) drops[d.delta.learner_id] = d.reason;
  CHECK(drops["a"] == DropReason::Invalid);
  CHECK(merger->running());
  r.stop_and_audit(*merger);
}

TEST_CASE("genesis and a clean stop commit the group's offsets in their transactions", "[merger][faults]") {
  FaultRun r("txn-offsets", {"merger.quorum=1"});
  auto merger = r.merger("M0");
  r.genesis("M0");
  const std::string group = "diloco." + r.run + ".mergers";
  auto committed = [&] {
    Consumer reader(ConsumerOptions{.kafka = r.kafka, .group_id = group});
    return reader.committed({{r.topics.deltas("r0"), 0, 0}, {r.topics.deltas("r0"), 1, 0}}, 10000);
  };
  // Each genesis transaction carried the consumed offset of its proposal: both partitions of the
  // genesis topic hold two proposals (fragments 0 and 2, 1 and 3), so a restart reads none again.
  Consumer reader(ConsumerOptions{.kafka = r.kafka, .group_id = group});
  const auto genesis = reader.committed({{r.topics.genesis(), 0, 0}, {r.topics.genesis(), 1, 0}}, 10000);
  REQUIRE(genesis.size() == 2);
  CHECK(genesis[0].offset == 2);
  CHECK(genesis[1].offset == 2);
  // A delta dropped after the last merge is accounted for by the stop record, whose transaction
  // moves the offset past it.
  r.send({{0, r.delta("a", 0, 1, 99)}});
  std::this_thread::sleep_for(2s);
  r.stop_and_audit(*merger);
  const auto offsets = committed();
  REQUIRE(offsets.size() == 2);
  CHECK(offsets[0].offset == 1);
  CHECK(offsets[1].offset < 0);  // nothing was read from partition 1: no offset is committed for it
}

TEST_CASE("chunked deltas: whole ones merge, a lost, a duplicated and a tampered piece are rejected with their reason",
          "[merger][faults][chunks]") {
  FaultRun r("chunks", {"merger.quorum=1", "codec.chunk_bytes=4096"});
  auto merger = r.merger("M0");
  r.genesis("M0");
  // fp32 deltas of random values: about 120 KB, 30 pieces of 4 KiB each.
  auto delta = [&](const std::string& learner, uint64_t seq) {
    DeltaHeader h{.run_id = r.run, .fingerprint = r.layout->fingerprint, .learner_id = learner, .region = "r0",
                  .fragment = 0, .seq = seq, .base_version = 0, .inner_steps = 10,
                  .tokens = static_cast<uint64_t>(10 * r.config.train.batch * r.config.model.context), .learner_step = seq};
    auto tensors = testing::HostModel(r.config, 1).fragment(*r.layout, 0);
    std::mt19937 rng(static_cast<uint32_t>(seq * 131 + learner.size()));
    std::normal_distribution<float> normal(0.0f, 1e-3f);
    for (auto& t : tensors)
      for (auto& v : t.values) v = normal(rng);
    auto bytes = encode_delta(h, std::span<const DenseTensor>(tensors), CodecOptions{.dtype = DType::F32});
    return split_message(std::move(bytes), ChunkId{r.run, learner, 0, seq}, r.config.codec.chunk_bytes);
  };
  auto a = delta("a", 1), b1 = delta("b", 1), b2 = delta("b", 2), c = delta("c", 1), d = delta("d", 1);
  REQUIRE(a.size() > 3);
  // d's piece 1 with one data byte flipped: a valid piece whose bytes are not the message's.
  std::vector<uint8_t> tampered = d[1];
  tampered[tampered.size() / 2] ^= 0xff;
  REQUIRE(is_chunk(tampered));

  std::vector<std::vector<uint8_t>> stream;
  auto append = [&](const std::vector<std::vector<uint8_t>>& pieces) { stream.insert(stream.end(), pieces.begin(), pieces.end()); };
  append(a);
  const size_t b1_head = stream.size();
  for (size_t i = 0; i < b1.size(); ++i)
    if (i != 1) stream.push_back(b1[i]);  // piece 1 lost
  const size_t b2_head = stream.size();
  append(b2);  // b's next message: b1 can never end
  const size_t c_head = stream.size();
  stream.push_back(c[0]);
  stream.push_back(c[1]);
  const size_t c_duplicate = stream.size();
  stream.push_back(c[1]);
  for (size_t i = 2; i < c.size(); ++i) stream.push_back(c[i]);
  const size_t d_head = stream.size();
  stream.push_back(d[0]);
  stream.push_back(tampered);
  for (size_t i = 2; i < d.size(); ++i) stream.push_back(d[i]);
  // Interleave another learner's pieces with all of that: e's whole message, piece by piece.
  auto e = delta("e", 1);
  std::vector<std::vector<uint8_t>> mixed;
  size_t next_e = 0;
  std::vector<int64_t> mixed_index(stream.size());
  for (size_t i = 0; i < stream.size(); ++i) {
    if (i % 4 == 3 && next_e < e.size()) mixed.push_back(e[next_e++]);
    mixed_index[i] = static_cast<int64_t>(mixed.size());
    mixed.push_back(stream[i]);
  }
  const int64_t e_head = mixed_index[3] - 1;
  while (next_e < e.size()) mixed.push_back(e[next_e++]);

  std::map<uint64_t, int64_t> offsets;  // index in `mixed` -> offset
  {
    Producer producer({.kafka = r.kafka}, [&](const DeliveryReport& report) {
      if (report.ok) offsets[report.token] = report.offset;
    });
    for (size_t i = 0; i < mixed.size(); ++i)
      producer.produce({.topic = r.topics.deltas("r0"), .partition = 0, .key = "0", .value = mixed[i]}, i, 10000);
    REQUIRE(producer.flush(20000) == 0);
  }
  REQUIRE(offsets.size() == mixed.size());
  auto offset_of = [&](size_t stream_index) { return offsets.at(static_cast<uint64_t>(mixed_index[stream_index])); };

  // The merger writes its rejections; wait for the three.
  const DecodeLimits limits = r.limits();
  std::map<std::string, std::vector<int64_t>> rejected;
  auto read_rejected = [&] {
    rejected.clear();
    read_to_end(r.kafka, {r.topics.rejected()}, [&](const ConsumedMessage& m) {
      const RejectedInput in = decode_rejected(m.value, limits);
      rejected[in.reason].push_back(in.source.offset);
    }, 30000);
    return rejected.size() >= 3;
  };
  REQUIRE(testing::eventually(read_rejected, 60s));
  std::this_thread::sleep_for(2s);  // the merges of what was whole
  r.stop_and_audit(*merger);
  read_rejected();
  CHECK(rejected["chunk_missing"] == std::vector<int64_t>{offset_of(b1_head)});
  CHECK(rejected["chunk_duplicate"] == std::vector<int64_t>{offset_of(c_duplicate)});
  CHECK(rejected["chunk_mismatch"] == std::vector<int64_t>{offset_of(d_head)});
  CHECK(rejected.size() == 3);

  // The whole messages were offered at their first piece: merged, or dropped with a reason.
  std::map<int64_t, std::string> fate;
  for (const auto& rec : r.records()) {
    for (const auto& in : rec.inputs) fate[in.position.offset] = "merged";
    for (const auto& dd : rec.dropped) fate[dd.delta.position.offset] = drop_reason_name(dd.reason);
  }
  INFO("offsets: a " << offsets.at(static_cast<uint64_t>(mixed_index[0])) << " b2 " << offset_of(b2_head) << " c "
                     << offset_of(c_head) << " e " << offsets.at(static_cast<uint64_t>(e_head)));
  CHECK(fate.count(offsets.at(static_cast<uint64_t>(mixed_index[0]))) == 1);  // a
  CHECK(fate.count(offset_of(b2_head)) == 1);
  CHECK(fate.count(offset_of(c_head)) == 1);
  CHECK(fate.count(offsets.at(static_cast<uint64_t>(e_head))) == 1);
  CHECK(fate.count(offset_of(b1_head)) == 0);  // never merged partially
  CHECK(fate.count(offset_of(d_head)) == 0);
  size_t merged = 0;
  for (const auto& [offset, f] : fate) merged += f == "merged";
  CHECK(merged >= 1);

  // diloco-replay list shows each broken piece as a rejected row with its reason.
  std::vector<std::string> args = {DILOCO_BINARY_DIR "/bin/diloco-replay", "-c", testing::tiny_config_path(),
                                   "--bootstrap", r.kafka.bootstrap_servers};
  args.insert(args.end(), r.sets.begin(), r.sets.end());
  args.insert(args.end(), {"list", "--json"});
  testing::ChildProcess list(args, r.dir + "/list.log");
  auto code = list.wait_exit(120s);
  INFO(list.log());
  REQUIRE(code == std::optional<int>(0));
  std::map<int64_t, std::string> listed;  // offset -> reason of rejected rows
  std::istringstream lines(list.log());
  for (std::string line; std::getline(lines, line);)
    if (!line.empty() && line[0] == '{') {
      const auto row = nlohmann::json::parse(line);
      if (row.value("fate", "") == "rejected") listed[row["offset"].get<int64_t>()] = row.value("reason", "");
    }
  CHECK(listed[offset_of(b1_head)] == "chunk_missing");
  CHECK(listed[offset_of(c_duplicate)] == "chunk_duplicate");
  CHECK(listed[offset_of(d_head)] == "chunk_mismatch");
}

TEST_CASE("recovery replays a long merge log through one reader, fetching the deltas a window at a time",
          "[merger][recovery][logreader]") {
  // No checkpoint after version 0: a new owner replays every record.
  FaultRun r("windowed", {"merger.quorum=1", "merger.checkpoint_every=100000"});
  auto merger = r.merger("M0");
  r.genesis("M0");
  INFO(merger->log());
  constexpr uint64_t kMerges = 24;
  for (uint64_t v = 1; v <= kMerges; ++v) {
    r.send({{0, r.delta("a", 0, v, v - 1)}});
    REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == v; }, 60s));
  }
  merger->signal(SIGKILL);
  merger->wait_exit(30s);

  auto reader = std::make_shared<LogReader>(r.kafka);
  LogContext ctx = r.context();
  ctx.reader = reader;
  const auto recovered = recover_partition(ctx, 0, std::vector<uint32_t>{0, 2});
  const auto& f = recovered.at(0);
  size_t replayed = 0;
  for (const auto& record : f.replayed) replayed += is_merge(record);
  CHECK(replayed == kMerges);
  CHECK(f.state.version == kMerges);
  CHECK(f.state.checksum == r.merges_of(0).back().checksum);
  // `state`, `merges`, then the 24 deltas in two windows (the first window holds 16), all through
  // the one consumer: not one read per record.
  CHECK(reader->reads() == 4);
}

TEST_CASE("a rewind that fails after a failed merge is retried: no delta lost, none merged twice", "[merger][faults]") {
  FaultRun r("fail-rewind", {"merger.quorum=1"});
  // The first merge commit (after the four of version 0) fails, and so does the rewind that
  // follows it (after its seeks).
  auto merger = r.merger("M0", {{"DILOCO_FAULT_FAIL_COMMIT", "5"}, {"DILOCO_FAULT_FAIL_REWIND", "1"}});
  r.genesis("M0");
  INFO(merger->log());
  r.send({{0, r.delta("a", 0, 1, 0)}, {1, r.delta("b", 1, 1, 0)}});
  REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == 1 && r.merges_of(1).size() == 1; }, 60s));
  CHECK(r.count("M0", "merge_failed") == 1);
  CHECK(r.count("M0", "recovery_failed") == 1);
  CHECK(r.count("M0", "rewound") == 1);
  r.send({{0, r.delta("a", 0, 2, 1)}, {1, r.delta("b", 1, 2, 1)}});
  REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == 2 && r.merges_of(1).size() == 2; }, 60s));
  CHECK(merger->running());
  r.stop_and_audit(*merger);
}

TEST_CASE("a merger killed and restarted under the same id owns its fragments again before the session timeout",
          "[merger][faults][static]") {
  FaultRun r("static-member", {"merger.quorum=1"});
  // A dynamic member restarted here would wait for the dead process's 45 s session to time out.
  r.session_timeout_ms = 45000;
  auto first = r.merger("M0");
  r.genesis("M0");
  r.send({{0, r.delta("a", 0, 1, 0)}});
  REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == 1; }, 60s));
  first->signal(SIGKILL);
  REQUIRE(first->wait_exit(10s).has_value());

  auto second = r.merger("M0");
  INFO(second->log());
  // Static membership: the restarted instance is given the dead one's partitions as it joins.
  CHECK(testing::eventually([&] { return r.count("M0", "assigned") == 2; }, 25s));
  r.send({{0, r.delta("a", 0, 2, 1)}});
  REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == 2; }, 30s));
  r.stop_and_audit(*second);
}

TEST_CASE("a second live merger under the same id fences the first: the first stops as fenced, the second merges on",
          "[merger][faults][static]") {
  FaultRun r("fenced-instance", {"merger.quorum=1"});
  auto first = r.merger("M0");
  r.genesis("M0");
  r.send({{0, r.delta("a", 0, 1, 0)}});
  REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == 1; }, 60s));

  // Same id, so the same group instance id and transactional id: the group hands the newcomer the
  // first one's partitions and fences the first, which is idle and learns it from its consumer.
  auto second = r.merger("M0", {}, "M0-second");
  INFO(second->log());
  const auto code = first->wait_exit(60s);
  INFO(first->log());
  REQUIRE(code.has_value());
  CHECK(*code == 4);
  std::string detail;
  for (const auto& j : testing::read_json_lines(r.dir + "/M0/metrics.jsonl"))
    if (j.value("event", "") == "fenced") detail = j.value("detail", "");
  CHECK(detail.find("joined the group as instance M0") != std::string::npos);

  r.send({{0, r.delta("a", 0, 2, 1)}});
  REQUIRE(testing::eventually([&] { return r.merges_of(0).size() == 2; }, 60s));
  r.stop_and_audit(*second);
}

namespace {

// A producer quota on the broker for one client id (scripts/broker throttle), lifted when the
// test ends, whatever happens.
struct Throttle {
  std::string client;
  Throttle(std::string client_, int bytes_per_s) : client(std::move(client_)) {
    REQUIRE(set(bytes_per_s) == 0);
  }
  ~Throttle() { set(0); }
  int set(int bytes_per_s) const {
    const std::string cmd = std::string(DILOCO_SOURCE_DIR "/scripts/broker throttle --client ") + client +
                            " --bytes-per-s " + std::to_string(bytes_per_s) + " >/dev/null 2>&1";
    return std::system(cmd.c_str());
  }
};

// Merges with a checkpoint each (checkpoint_every 1) by merger `id` whose writes the broker holds
// to `bytes_per_s`, after version 0 was committed at full speed. The broker applies a new quota a
// moment after it is set, and counts the bytes of a window of seconds, so one delta may still
// commit at full speed: up to `attempts` deltas (of new learners, each merged alone) are sent,
// one after the previous one's merge or failure, until `done` holds. Returns whether it did.
bool throttled_merges(FaultRun& r, testing::ChildProcess& merger, const std::string& id, int bytes_per_s,
                      const std::function<bool()>& done, int attempts) {
  testing::propose_genesis(r.kafka, r.config);
  REQUIRE(r.count(id, "genesis") == r.layout->num_fragments());
  Throttle throttle(id, bytes_per_s);
  INFO(merger.log());
  for (int i = 1; i <= attempts && !done(); ++i) {
    const size_t seen = r.count(id, "merge") + r.count(id, "merge_failed");
    r.send({{0, r.delta("a" + std::to_string(i), 0, 1, 0)}});
    testing::eventually([&] { return done() || r.count(id, "merge") + r.count(id, "merge_failed") > seen; }, 120s);
  }
  return done();
}

// The commit times of a merger's merges with a checkpoint, in seconds.
std::vector<double> checkpoint_commits(const FaultRun& r, const std::string& id) {
  std::vector<double> out;
  for (const auto& j : testing::read_json_lines(r.dir + "/" + id + "/metrics.jsonl"))
    if (j.value("event", "") == "merge" && j.value("checkpoint", false)) out.push_back(j["seconds"]["commit"].get<double>());
  return out;
}

}  // namespace

// A checkpoint that takes longer than 10 s to reach a slow broker: the transaction timeout grows
// with the bytes (merger.transaction_seconds + the largest transaction at merger.min_write_mb_per_s),
// so the merge commits. With the timeout of a fast link (what a fixed 10 s was) the broker aborts
// such a transaction.
TEST_CASE("a checkpoint that takes longer than 10 s to write on a throttled broker commits", "[merger][faults][throttle]") {
  // Fragment 0's checkpoint (29k parameters: parameters, momentum and int4 downlink residual in
  // fp32, about 0.35 MB) at 5 kB/s takes over a minute once the quota holds (the broker throttles
  // by the rate over its last seconds, so the first throttled commits are held less).
  const int kBytesPerSecond = 5000;
  SECTION("with the timeout scaled to a slow link") {
    FaultRun r("throttled", {"merger.checkpoint_every=1", "merger.min_write_mb_per_s=0.002"});
    const std::string id = "slow-" + r.run;
    auto merger = r.merger(id);
    auto slow_commit = [&] {
      for (double seconds : checkpoint_commits(r, id))
        if (seconds > 10) return true;  // the throttle held it that long, and it committed
      return false;
    };
    CHECK(throttled_merges(r, *merger, id, kBytesPerSecond, slow_commit, 5));
    CHECK(r.count(id, "merge_failed") == 0);
    auto timeout = testing::last_event(r.dir + "/" + id + "/metrics.jsonl", "transaction_timeout");
    REQUIRE(timeout.has_value());
    CHECK(timeout->at("ms").get<int>() > 600000);  // 10 s + 3 x 4 B x 116k parameters at 2 kB/s: 709 s
    r.stop_and_audit(*merger);
  }
  SECTION("with the timeout of a fast link") {
    FaultRun r("throttled-fast", {"merger.checkpoint_every=1", "merger.min_write_mb_per_s=1000"});
    const std::string id = "fast-" + r.run;
    auto merger = r.merger(id);
    CHECK(throttled_merges(r, *merger, id, kBytesPerSecond, [&] { return r.count(id, "merge_failed") >= 1; }, 5));
    merger->signal(SIGKILL);
  }
}

TEST_CASE("audit names a version announced in members that the merge log does not hold", "[merger][faults][audit]") {
  FaultRun r("audit-announced", {"merger.quorum=1"});
  auto merger = r.merger("M0");
  r.genesis("M0");
  r.stop_and_audit(*merger);  // a clean run: every announced version 0 is in the log
  // What a merger whose merge commit failed once announced: version 1 of fragment 0, held in
  // memory only; and a version 0 with bits other than the log's.
  Member m{.run_id = r.run, .instance_id = "M9", .role = Role::Merger, .endpoint = "tcp://127.0.0.1:1",
           .owned_fragments = {0, 2}, .fragment_versions = {1, 0}, .fragment_checksums = {11, 22}};
  Producer producer({.kafka = r.kafka}, nullptr);
  producer.produce({.topic = r.topics.members(), .partition = 0, .key = "M9", .value = encode_member(m)}, 0, 10000);
  REQUIRE(producer.flush(20000) == 0);
  auto audit = testing::audit_run(r.kafka, r.config, {"r0"});
  INFO(audit.report());
  REQUIRE(audit.problems.size() == 2);
  CHECK_THAT(audit.problems[0], Catch::StartsWith("merger M9 announced version 1 of fragment 0") &&
                                    Catch::EndsWith("which the merge log does not hold"));
  CHECK_THAT(audit.problems[1], Catch::StartsWith("merger M9 announced version 0 of fragment 2") &&
                                    Catch::Contains("with checksum 22; the log's version has checksum"));
}

// A merger reads deltas again that a committed record already accounts for: its offsets are held
// back by a delta still pending (a later owner must read that one), so a restart reads the merged
// ones behind it too. Those are known by their position alone, before any decoding: a backlog
// read again must not cost its decompression.
TEST_CASE("deltas read again after a restart are known by their position and never decoded", "[merger][reread]") {
  FaultRun r("reread", {"merger.quorum=2", "train.eval_every=0"});
  auto merger = r.merger("M0", {}, "A");
  r.genesis("A");
  // Fragment 2 waits for a second learner: its delta holds partition 0's offset back, while
  // fragment 0 (the same partition) merges the two deltas behind it.
  r.send({{0, r.delta("a", 2, 1, 0)}, {0, r.delta("a", 0, 2, 0)}, {0, r.delta("b", 0, 1, 0)}});
  REQUIRE(testing::eventually([&] { return r.count("A", "merge") == 1; }, 60s));
  merger->signal(SIGTERM);
  REQUIRE(merger->wait_exit(60s) == std::optional<int>(0));

  // The next instance reads from the pending delta on: it, and the two merged ones again.
  merger = r.merger("M0", {}, "B");
  REQUIRE(testing::eventually([&] { return r.count("B", "recovered") == 4; }, 60s));
  std::this_thread::sleep_for(3s);  // the three deltas are read
  merger->signal(SIGTERM);
  REQUIRE(merger->wait_exit(60s) == std::optional<int>(0));
  INFO(merger->log());
  CHECK(r.stop_metric("B", "deltas_reread_total") == 2);
  CHECK(r.stop_metric("B", "deltas_decoded_total") == 1);  // the pending delta only
  CHECK(r.stop_metric("B", "deltas_received_total") == 1);
  CHECK(r.count("B", "merge") == 0);  // nothing merged twice
}

// Records outside transactions (`rejected`, `members`) are sent without blocking the merger's
// loop; one its producer cannot take is counted and said, never dropped in silence.
TEST_CASE("a refusal the producer's full queue cannot take is counted and said", "[merger][lost]") {
  FaultRun r("lost", {"train.eval_every=0"});
  // A local queue of one record, held a second: a burst of refusals overflows it.
  auto merger = r.merger("M0", {{"DILOCO_FAULT_PLAIN_QUEUE", "1"}});
  r.genesis("M0");
  std::vector<std::pair<int32_t, std::vector<uint8_t>>> junk;
  for (int i = 0; i < 20; ++i) junk.push_back({0, std::vector<uint8_t>(64, static_cast<uint8_t>(i))});
  r.send(junk);
  REQUIRE(testing::eventually([&] { return r.count("M0", "rejected") == 20; }, 60s));
  REQUIRE(testing::eventually([&] { return r.count("M0", "record_lost") >= 1; }, 30s));
  merger->signal(SIGTERM);
  REQUIRE(merger->wait_exit(60s) == std::optional<int>(0));
  INFO(merger->log());
  const double lost = r.stop_metric("M0", "records_lost_total");
  CHECK(lost >= 1);
  CHECK(lost < 20 + 10);
  CHECK_THAT(merger->log(), Catch::Contains("a record of " + r.topics.rejected() + " was lost (the producer's local "
                                            "queue is full)"));
  // What did reach `rejected` plus what was lost is every refusal (and the heartbeats' losses).
  size_t reached = 0;
  read_to_end(r.kafka, {r.topics.rejected()}, [&](const ConsumedMessage&) { ++reached; }, 30000);
  CHECK(reached < 20);
}
