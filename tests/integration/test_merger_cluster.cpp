// Real broker, real merger and learner processes, real signals: the loop closes (versions
// advance, learners adopt, loss falls), a merger killed with SIGKILL is replaced without losing or
// double-merging a delta, and two mergers split the fragments and fail over to each other.
#include <catch2/catch.hpp>

#include <map>
#include <memory>

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

struct Cluster {
  KafkaOptions kafka = testing::require_broker();
  std::string run = testing::unique_run_id("cluster");
  std::vector<std::string> regions = {"r0", "r1"};
  RunTopics topics = testing::create_run(kafka, run, regions, 2);
  std::string dir = testing::temp_dir("cluster");
  std::vector<std::string> sets = {"--set", "run.id=\"" + run + "\"", "--set", "train.eval_every=50", "--set",
                                   "merger.checkpoint_every=3"};
  RunConfig config = testing::tiny_config(run, {"train.eval_every=50", "merger.checkpoint_every=3"});

  // The mergers' group session: a killed merger's fragments move once it has expired.
  static constexpr int kSessionTimeoutMs = 6000;

  std::unique_ptr<testing::ChildProcess> merger(const std::string& id) {
    std::vector<std::string> args = {testing::merger_binary(), "-c", testing::tiny_config_path(), "--id", id,
                                     "--bootstrap", kafka.bootstrap_servers, "--run-dir", dir + "/" + id,
                                     "--session-timeout-ms", std::to_string(kSessionTimeoutMs)};
    args.insert(args.end(), sets.begin(), sets.end());
    return std::make_unique<testing::ChildProcess>(args, dir + "/" + id + ".log");
  }
  std::unique_ptr<testing::ChildProcess> learner(int index, int count, int steps) {
    std::string id = "L" + std::to_string(index);
    std::vector<std::string> args = {testing::learner_binary(), "-c", testing::tiny_config_path(), "--id", id,
                                     "--index", std::to_string(index), "--learners", std::to_string(count),
                                     "--region", regions[static_cast<size_t>(index) % regions.size()], "--regions", "r0,r1",
                                     "--bootstrap", kafka.bootstrap_servers, "--steps", std::to_string(steps),
                                     "--run-dir", dir + "/" + id, "--log-every", "10"};
    args.insert(args.end(), sets.begin(), sets.end());
    return std::make_unique<testing::ChildProcess>(args, dir + "/" + id + ".log");
  }
  std::string metrics(const std::string& id) const { return dir + "/" + id + "/metrics.jsonl"; }
  size_t count(const std::string& id, const std::string& event) const {
    size_t n = 0;
    for (const auto& j : testing::read_json_lines(metrics(id)))
      if (j.value("event", "") == event) ++n;
    return n;
  }
  // Latest announcement of each merger in `members`.
  std::map<std::string, Member> mergers() const {
    DecodeLimits limits{.run_id = run};  // announcements do not depend on the model
    std::map<std::string, Member> out;
    read_to_end(kafka, {topics.members()}, [&](const ConsumedMessage& m) {
      if (m.tombstone) return;
      Member member = decode_member(m.value, limits);
      if (member.role == Role::Merger) out[member.instance_id] = member;
    }, 30000);
    return out;
  }
};

void require_clean_exit(testing::ChildProcess& p, std::chrono::seconds limit) {
  auto code = p.wait_exit(limit);
  INFO(p.log());
  REQUIRE(code.has_value());
  CHECK(*code == 0);
}

}  // namespace

TEST_CASE("3 learners and 1 merger: versions advance, learners adopt them, held-out loss falls", "[merger][cluster]") {
  Cluster c;
  auto merger = c.merger("M0");
  std::vector<std::unique_ptr<testing::ChildProcess>> learners;
  for (int i = 0; i < 3; ++i) learners.push_back(c.learner(i, 3, 200));
  for (auto& l : learners) require_clean_exit(*l, 180s);
  merger->signal(SIGTERM);
  require_clean_exit(*merger, 60s);

  INFO(merger->log());
  CHECK(c.count("M0", "merge") >= 12);
  for (int i = 0; i < 3; ++i) {
    std::string id = "L" + std::to_string(i);
    CHECK(c.count(id, "adopt") >= 4);
    std::vector<double> evals;
    for (const auto& j : testing::read_json_lines(c.metrics(id)))
      if (j.value("event", "") == "eval") evals.push_back(j["eval_loss"]);
    // The first eval is the untrained model at step 0 (about ln 96 = 4.56). Later evals of one
    // learner need not fall monotonically: adopting a merged fragment can cost a little loss.
    REQUIRE(evals.size() >= 3);
    CHECK(evals.front() > 4.0);
    CHECK(evals.back() < 2.6);
  }
  auto audit = testing::audit_run(c.kafka, c.config, c.regions);
  INFO(audit.report());
  CHECK(audit.ok());
  for (uint32_t p = 0; p < 4; ++p) CHECK(audit.versions[p].size() >= 3);
}

TEST_CASE("a merger killed with SIGKILL is replaced: it rebuilds and every delta is merged once or dropped", "[merger][cluster][recovery]") {
  Cluster c;
  auto first = c.merger("M0");
  std::vector<std::unique_ptr<testing::ChildProcess>> learners;
  for (int i = 0; i < 3; ++i) learners.push_back(c.learner(i, 3, 600));
  REQUIRE(testing::eventually([&] { return c.count("M0", "merge") >= 10; }, 120s));
  first->signal(SIGKILL);
  REQUIRE(first->wait_exit(10s).has_value());
  size_t merges_before = c.count("M0", "merge");

  auto second = c.merger("M0");  // same instance id: the restarted process fences any leftover
  REQUIRE(testing::eventually([&] { return c.count("M0", "merge") > merges_before + 5; }, 120s));
  auto recovered = testing::last_event(c.metrics("M0"), "recovered");
  REQUIRE(recovered.has_value());
  for (auto& l : learners) require_clean_exit(*l, 240s);
  second->signal(SIGTERM);
  require_clean_exit(*second, 60s);

  auto audit = testing::audit_run(c.kafka, c.config, c.regions);
  INFO(audit.report());
  CHECK(audit.ok());
  CHECK(audit.merges >= 15);
}

TEST_CASE("a learner killed with SIGKILL and restarted and a learner paused with SIGSTOP lose no delta and merge no progress twice",
          "[merger][cluster][recovery]") {
  Cluster c;
  auto merger = c.merger("M0");
  std::vector<std::unique_ptr<testing::ChildProcess>> learners;
  for (int i = 0; i < 3; ++i) learners.push_back(c.learner(i, 3, 400));
  REQUIRE(testing::eventually([&] { return c.count("M0", "merge") >= 5; }, 120s));
  // L1 is killed while it trains: on a loaded machine the others' merges can come before it has
  // started, and a learner killed before its first announcement is rightly new to the run again.
  REQUIRE(testing::eventually([&] { return c.count("L1", "delta") >= 2; }, 120s));
  learners[1]->signal(SIGKILL);
  REQUIRE(learners[1]->wait_exit(10s).has_value());
  learners[2]->signal(SIGSTOP);  // an island cut off for a while
  std::this_thread::sleep_for(3s);
  learners[2]->signal(SIGCONT);
  const size_t merges_before = c.count("M0", "merge");
  learners[1] = c.learner(1, 3, 200);  // the same learner id, a new process
  for (auto& l : learners) require_clean_exit(*l, 240s);
  CHECK(c.count("M0", "merge") > merges_before);
  // The restarted process got the current versions on connecting (no periodic republish): its
  // first adoption comes within seconds of its resume. (Its start is earlier by the id claim's
  // wait: the killed process announced the id moments before.)
  int64_t resume_us = 0, first_adopt_us = 0;
  int starts = 0;
  for (const auto& j : testing::read_json_lines(c.metrics("L1"))) {
    const auto event = j.value("event", "");
    if (event == "start") ++starts;
    if (event == "resume" && starts == 2) resume_us = j.value("time_us", int64_t{0});
    if (event == "adopt" && resume_us && !first_adopt_us) first_adopt_us = j.value("time_us", int64_t{0});
  }
  INFO(learners[1]->log());
  REQUIRE(starts == 2);
  REQUIRE(resume_us > 0);
  REQUIRE(first_adopt_us > 0);
  CHECK(first_adopt_us - resume_us < 6'000'000);
  merger->signal(SIGTERM);
  require_clean_exit(*merger, 60s);

  auto audit = testing::audit_run(c.kafka, c.config, c.regions);
  INFO(audit.report());
  CHECK(audit.ok());
}

TEST_CASE("two mergers own disjoint fragments, and when one is killed the other owns all with no version going back", "[merger][cluster][failover]") {
  Cluster c;
  auto a = c.merger("MA");
  auto b = c.merger("MB");
  std::vector<std::unique_ptr<testing::ChildProcess>> learners;
  for (int i = 0; i < 2; ++i) learners.push_back(c.learner(i, 2, 1000));

  auto owners = [&] {
    std::map<uint32_t, std::string> owner;
    std::vector<std::string> problems;
    for (const auto& [id, m] : c.mergers())
      for (uint32_t p : m.owned_fragments)
        if (!owner.emplace(p, id).second) problems.push_back("fragment " + std::to_string(p) + " owned twice");
    return std::make_pair(owner, problems);
  };
  bool split = testing::eventually([&] {
    auto [owner, problems] = owners();
    std::set<std::string> instances;
    for (const auto& [p, id] : owner) instances.insert(id);
    return problems.empty() && owner.size() == 4 && instances.size() == 2;
  }, 90s);
  INFO(a->log() << "\n" << b->log());
  REQUIRE(split);
  REQUIRE(testing::eventually([&] { return c.count("MA", "merge") + c.count("MB", "merge") >= 8; }, 90s));

  a->signal(SIGKILL);
  REQUIRE(a->wait_exit(10s).has_value());
  auto killed_at = std::chrono::steady_clock::now();
  bool took_over = testing::eventually([&] {
    auto members = c.mergers();
    return members.count("MB") && members["MB"].owned_fragments.size() == 4;
  }, 60s);
  REQUIRE(took_over);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  // The session's expiry, then a rebalance and MB's recovery of MA's fragments (about 0.5 s on a
  // quiet machine): 6 s of slack for a loaded one.
  INFO("failover: MB owned every fragment " << seconds << " s after MA was killed");
  CHECK(seconds < Cluster::kSessionTimeoutMs / 1000.0 + 6);
  size_t merges_b = c.count("MB", "merge");
  CHECK(testing::eventually([&] { return c.count("MB", "merge") > merges_b + 4; }, 60s));

  for (auto& l : learners) l->signal(SIGTERM);
  for (auto& l : learners) require_clean_exit(*l, 60s);
  b->signal(SIGTERM);
  require_clean_exit(*b, 60s);
  auto audit = testing::audit_run(c.kafka, c.config, c.regions);
  INFO(audit.report());
  CHECK(audit.ok());
}

TEST_CASE("a new owner does not rebuild around an open transaction, it waits and then says why", "[merger][recovery]") {
  KafkaOptions kafka = testing::require_broker();
  const std::string run = testing::unique_run_id("open-txn");
  RunTopics topics = testing::create_run(kafka, run, {"r0"}, 2);
  RunConfig config = testing::tiny_config(run);
  const auto layout = std::make_shared<const FragmentLayout>(builtin_layout(config));
  // A predecessor killed mid-transaction: its record is in the log, neither committed nor aborted.
  Producer predecessor(ProducerOptions{.kafka = kafka, .transactional_id = run + "-killed-owner"}, nullptr);
  predecessor.init_transactions(30000);
  predecessor.begin_transaction();
  const std::vector<uint8_t> value = {1, 2, 3};
  predecessor.produce({.topic = topics.merges(), .partition = 0, .key = "0", .value = value}, 1, 10000);
  REQUIRE(predecessor.flush(20000) == 0);

  LogContext ctx{.kafka = kafka, .topics = topics, .config = &config, .layout = layout,
                 .limits = run_decode_limits(config, *layout), .stable_wait_ms = 1000};
  const std::vector<uint32_t> fragments{0};  // fragment 0 lives in partition 0 of 2
  CHECK_THROWS_WITH(recover_partition(ctx, 0, fragments),
                    Catch::Contains(topics.merges() + "[0] still has a transaction open") &&
                        Catch::Contains("killed merger's transaction"));
  CHECK_THROWS_AS(recover_partition(ctx, 0, fragments), Unavailable);  // the merger retries these

  predecessor.abort_transaction(30000);
  ctx.stable_wait_ms = 30000;
  auto recovered = recover_partition(ctx, 0, fragments);
  REQUIRE(recovered.count(0));
  // Nothing committed: the fragment waits for a learner's proposal of version 0.
  CHECK(recovered.at(0).awaiting_genesis);
  CHECK(recovered.at(0).replayed.empty());
}

TEST_CASE("hostile deltas are rejected with a reason, written to `rejected`, and change no state", "[merger][hostile]") {
  Cluster c;
  auto merger = c.merger("M0");
  const testing::HostModel model = testing::propose_genesis(c.kafka, c.config);
  REQUIRE(c.count("M0", "genesis") == 4);
  const FragmentLayout layout = builtin_layout(c.config);

  std::vector<std::vector<uint8_t>> payloads;
  payloads.push_back({'n', 'o', 't', ' ', 'z', 's', 't', 'd'});
  DeltaHeader h{.run_id = c.run, .fingerprint = layout.fingerprint ^ 7, .learner_id = "evil", .region = "r0",
                .fragment = 0, .seq = 1, .base_version = 0, .inner_steps = 1, .tokens = 1024, .learner_step = 1};
  auto tensors = model.fragment(layout, 0);
  payloads.push_back(encode_delta(h, std::span<const DenseTensor>(tensors), CodecOptions{}));  // wrong fingerprint
  h.fingerprint = layout.fingerprint;
  h.run_id = "another-run";
  payloads.push_back(encode_delta(h, std::span<const DenseTensor>(tensors), CodecOptions{}));  // wrong run
  h.run_id = c.run;
  for (auto& t : tensors) t.values[0] = std::numeric_limits<float>::quiet_NaN();
  CodecOptions fp32{.dtype = DType::F32};
  payloads.push_back(encode_delta(h, std::span<const DenseTensor>(tensors), fp32));  // NaN
  {
    Producer producer({.kafka = c.kafka}, nullptr);
    for (const auto& p : payloads)
      producer.produce({.topic = c.topics.deltas("r0"), .partition = 0, .key = "0", .value = p}, 0, 10000);
    REQUIRE(producer.flush(20000) == 0);
  }
  std::vector<RejectedInput> rejected;
  const DecodeLimits limits = run_decode_limits(c.config, layout);
  bool all = testing::eventually([&] {
    rejected.clear();
    read_to_end(c.kafka, {c.topics.rejected()}, [&](const ConsumedMessage& m) { rejected.push_back(decode_rejected(m.value, limits)); }, 30000);
    return rejected.size() == payloads.size();
  }, 60s);
  INFO(merger->log());
  REQUIRE(all);
  std::multiset<std::string> reasons;
  for (const auto& r : rejected) reasons.insert(r.reason);
  CHECK(reasons.count("not_zstd") == 1);
  CHECK(reasons.count("wrong_fingerprint") == 1);
  CHECK(reasons.count("wrong_run_id") == 1);
  CHECK(reasons.count("non_finite") == 1);
  // A refusal names the sender its header gives, so that learner can read why; a payload that
  // is not even zstd names nobody.
  for (const auto& r : rejected) {
    INFO(r.reason);
    CHECK(r.sender == (r.reason == "non_finite" ? "evil" : ""));
  }
  CHECK(merger->running());
  CHECK(c.count("M0", "merge") == 0);  // nothing merged from them
  merger->signal(SIGTERM);
  require_clean_exit(*merger, 60s);
}

TEST_CASE("a run whose deltas and checkpoints travel in chunks survives a merger kill: every delta once, every version verifies",
          "[merger][cluster][chunks]") {
  Cluster c;
  // 4 KiB chunks: a tiny int4 delta is about 5 pieces, a checkpoint about 90.
  c.sets.insert(c.sets.end(), {"--set", "codec.chunk_bytes=4096"});
  c.config = testing::tiny_config(c.run, {"train.eval_every=50", "merger.checkpoint_every=3", "codec.chunk_bytes=4096"});
  auto first = c.merger("M0");
  std::vector<std::unique_ptr<testing::ChildProcess>> learners;
  // A budget no run reaches: the learners train until the replacement has merged, whatever the
  // machine's speed (on a fast one 400 steps ended before the new instance owned a fragment).
  for (int i = 0; i < 2; ++i) learners.push_back(c.learner(i, 2, 100'000));
  REQUIRE(testing::eventually([&] { return c.count("M0", "merge") >= 8; }, 120s));
  first->signal(SIGKILL);
  REQUIRE(first->wait_exit(10s).has_value());
  const size_t merges_before = c.count("M0", "merge");
  auto second = c.merger("M0");
  REQUIRE(testing::eventually([&] { return c.count("M0", "merge") > merges_before + 4; }, 120s));
  for (auto& l : learners) l->signal(SIGTERM);
  for (auto& l : learners) require_clean_exit(*l, 60s);
  second->signal(SIGTERM);
  require_clean_exit(*second, 60s);

  // The pieces are really there: deltas and checkpoints in the logs are chunks.
  size_t delta_pieces = 0, delta_records = 0, state_pieces = 0;
  read_to_end(c.kafka, {c.topics.deltas("r0"), c.topics.deltas("r1")}, [&](const ConsumedMessage& m) {
    ++delta_records;
    delta_pieces += is_chunk(m.value);
  }, 30000);
  read_to_end(c.kafka, {c.topics.state()}, [&](const ConsumedMessage& m) { state_pieces += is_chunk(m.value); }, 30000);
  CHECK(delta_pieces > 0);
  CHECK(delta_pieces == delta_records);
  CHECK(state_pieces > 0);
  for (int i = 0; i < 2; ++i) CHECK(c.count("L" + std::to_string(i), "adopt") >= 3);
  // The restarted merger rebuilt from chunked checkpoints and deltas; the audit reads them whole.
  REQUIRE(testing::last_event(c.metrics("M0"), "recovered").has_value());
  auto audit = testing::audit_run(c.kafka, c.config, c.regions);
  INFO(audit.report());
  CHECK(audit.ok());
  CHECK(audit.merges >= 12);
  // Every version rebuilds from the logs, from version 0 on.
  testing::require_verify_pass(c.kafka, c.dir, c.sets);
  // A new owner rebuilds each fragment from its chunked checkpoint and the records after it.
  const auto layout = std::make_shared<const FragmentLayout>(builtin_layout(c.config));
  const DecodeLimits limits = run_decode_limits(c.config, *layout);
  for (int32_t partition = 0; partition < 2; ++partition) {
    LogContext ctx{.kafka = c.kafka, .topics = c.topics, .config = &c.config, .layout = layout, .limits = limits};
    auto recovered = recover_partition(ctx, partition, std::vector<uint32_t>{static_cast<uint32_t>(partition),
                                                                              static_cast<uint32_t>(partition + 2)});
    for (const auto& [p, f] : recovered) {
      CHECK_FALSE(f.awaiting_genesis);
      CHECK(f.state.version == audit.versions[p].back().version);
      CHECK(f.state.layout == layout);  // the run's, for the checkpoints it writes
    }
  }
  // A run the logs know nothing of: no version 0 is made up, every fragment awaits a proposal.
  RunConfig other = c.config;
  other.run.id = c.run + "-empty";
  const RunTopics other_topics = testing::create_run(c.kafka, other.run.id, c.regions, 2);
  LogContext empty{.kafka = c.kafka, .topics = other_topics, .config = &other, .layout = layout,
                   .limits = run_decode_limits(other, *layout), .timeout_ms = 10000};
  const auto fresh = recover_partition(empty, 0, std::vector<uint32_t>{0, 2});
  REQUIRE(fresh.size() == 2);
  for (const auto& [p, f] : fresh) CHECK(f.awaiting_genesis);
}

TEST_CASE("a scheduled outer momentum: each merge records its version's momentum, and every version verifies",
          "[merger][cluster][momentum]") {
  Cluster c;
  // Outer momentum 0.9 (set here, whatever the default): warm-up over 2 merges, then from version
  // 3 down to 0.3 at version 5.
  const std::vector<std::string> schedule = {"merger.outer_momentum=0.9", "merger.momentum_warmup=2",
                                             "merger.momentum_decay_from=3", "merger.momentum_decay_to=5",
                                             "merger.momentum_final=0.3"};
  for (const auto& s : schedule) c.sets.insert(c.sets.end(), {"--set", s});
  std::vector<std::string> overrides = {"train.eval_every=50", "merger.checkpoint_every=3"};
  overrides.insert(overrides.end(), schedule.begin(), schedule.end());
  c.config = testing::tiny_config(c.run, overrides);
  auto merger = c.merger("M0");
  std::vector<std::unique_ptr<testing::ChildProcess>> learners;
  for (int i = 0; i < 2; ++i) learners.push_back(c.learner(i, 2, 280));
  for (auto& l : learners) require_clean_exit(*l, 180s);
  merger->signal(SIGTERM);
  require_clean_exit(*merger, 60s);

  const auto layout = builtin_layout(c.config);
  const DecodeLimits limits = run_decode_limits(c.config, layout);
  // Worked by hand: version 1 is the first merge of 2 in the warm-up, 0.9 / 2; version 4 is half
  // way from 3 to 5, 0.9 + (0.3 - 0.9) / 2.
  const std::map<uint64_t, float> expected = {{1, 0.45f}, {2, 0.9f}, {3, 0.9f}, {4, 0.6f}, {5, 0.3f}, {6, 0.3f}};
  std::map<uint64_t, size_t> seen;
  read_to_end(c.kafka, {c.topics.merges()}, [&](const ConsumedMessage& m) {
    const MergeRecord r = decode_merge_record(m.value, limits);
    if (r.genesis) return;
    INFO("fragment " << r.fragment << " version " << r.version);
    CHECK(r.hyper.momentum == Approx(expected.count(r.version) ? expected.at(r.version) : 0.3f));
    ++seen[std::min<uint64_t>(r.version, 6)];
  }, 30000);
  // Every fragment went through the warm-up, the decay and past it (two learners, 7 rounds each).
  for (uint64_t v = 1; v <= 6; ++v) CHECK(seen[v] >= 4);
  // verify rebuilds every version with the momentum its record names: no schedule needed.
  testing::require_verify_pass(c.kafka, c.dir, c.sets);
}
