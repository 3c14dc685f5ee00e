// Version 0 from the learners (ARCHITECTURE.md sections 5 and 6), against the real broker and a
// real merger process, with in-process learners (LearnerRuntime over host buffers of the built-in
// model's tensors, no libtorch): the first proposal of each fragment becomes its version 0, once;
// every learner starts from it; a learner of another model is refused, by its own start or by the
// merger's rejection of its proposal, and changes nothing; a restarted merger learns the model
// from its checkpoints; and the audit accounts for every proposal.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>
#include <exception>
#include <fstream>
#include <iterator>
#include <optional>
#include <set>
#include <thread>

#include "core/codec/learner_state.h"
#include "core/fragments/message_budget.h"
#include "core/kafka/log_reader.h"
#include "core/kafka/producer.h"
#include "core/kafka/run_log.h"
#include "core/process.h"
#include "tests/integration/run_audit.h"
#include "tests/integration/run_fixture.h"

using namespace diloco;
using namespace std::chrono_literals;
using Catch::Matchers::Contains;

namespace {

// A tiny run in region r0 and what the tests read of its logs.
struct GenesisRun : testing::TinyRun {
  std::shared_ptr<const FragmentLayout> layout;

  explicit GenesisRun(const std::string& name, const std::vector<std::string>& extra = {})
      : TinyRun(name, extra), layout(std::make_shared<const FragmentLayout>(builtin_layout(config))) {}

  std::unique_ptr<testing::ChildProcess> merger(const std::string& id, const std::string& folder = "") const {
    return testing::start_merger(kafka, dir, id, sets, folder);
  }
  size_t count(const std::string& folder, const std::string& event) const {
    size_t n = 0;
    for (const auto& j : testing::read_json_lines(dir + "/" + folder + "/metrics.jsonl")) n += j.value("event", "") == event;
    return n;
  }
  void stop(testing::ChildProcess& merger) const {
    merger.signal(SIGTERM);
    const auto code = merger.wait_exit(60s);
    INFO(merger.log());
    REQUIRE(code == std::optional<int>(0));
  }
  // The newest checkpoint of every fragment that has one, read as a process without the model.
  std::map<uint32_t, FragmentState> states() const {
    return read_states(kafka, topics, DecodeLimits{.run_id = run}, layout->num_fragments()).latest;
  }
  std::vector<MergeRecord> records() const {
    const DecodeLimits limits = run_decode_limits(config, *layout);
    std::vector<MergeRecord> out;
    read_to_end(kafka, {topics.merges()}, [&](const ConsumedMessage& m) { out.push_back(decode_merge_record(m.value, limits)); },
                30000);
    return out;
  }
  std::vector<RejectedInput> rejected() const {
    std::vector<RejectedInput> out;
    read_to_end(kafka, {topics.rejected()}, [&](const ConsumedMessage& m) {
      out.push_back(decode_rejected(m.value, DecodeLimits{.run_id = run}));
    }, 30000);
    return out;
  }
  size_t proposals() const {
    size_t n = 0;
    read_to_end(kafka, {topics.genesis()}, [&](const ConsumedMessage&) { ++n; }, 30000);
    return n;
  }
  // A proposal of fragment p written as a learner writes one, without a learner.
  void propose(const std::string& learner, const testing::HostModel& model, std::shared_ptr<const FragmentLayout> of,
               uint32_t p) const {
    GenesisProposal proposal{.run_id = run, .fingerprint = of->fingerprint, .learner_id = learner, .region = "r0",
                             .fragment = p, .seq = 1, .send_time_us = unix_us(), .layout = of,
                             .tensors = model.fragment(*of, p)};
    Producer producer({.kafka = kafka}, nullptr);
    producer.produce({.topic = topics.genesis(), .partition = static_cast<int32_t>(p % 2), .key = std::to_string(p),
                      .value = encode_genesis_proposal(proposal)},
                     0, 10000);
    REQUIRE(producer.flush(20000) == 0);
  }
};

// The built-in model's tensors with one of them another shape: another model.
std::vector<TensorSpec> with_shape(std::vector<TensorSpec> specs, const std::string& name, std::vector<int64_t> shape) {
  for (auto& t : specs)
    if (t.name == name) t.shape = std::move(shape);
  return specs;
}

// start() on a thread of its own; its outcome (true, false, or what it threw) once joined.
struct Starting {
  std::exception_ptr error;
  bool started = false;
  std::thread thread;
  explicit Starting(LearnerRuntime& learner) : thread([this, &learner] {
    try {
      started = learner.start();
    } catch (...) {
      error = std::current_exception();
    }
  }) {}
  std::string join() {
    thread.join();
    if (!error) return started ? "started" : "stopped";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      return e.what();
    }
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A few inner steps of a learner whose "optimizer" moves every value by -rate.
void train(LearnerRuntime& learner, testing::HostModel& model, int steps, float rate) {
  for (int i = 0; i < steps; ++i) {
    for (auto& tensor : model.values)
      for (auto& v : tensor) v -= rate;
    learner.step({.tokens = 1024, .loss = 2.0f});
    std::this_thread::sleep_for(5ms);
  }
}

}  // namespace

TEST_CASE("two learners that propose together get one version 0 per fragment and start from the same values",
          "[genesis]") {
  GenesisRun r("genesis-two", {"diloco.H=8"});
  // Two processes of one model, initialised differently (another seed, as two clients may).
  testing::HostModel a(r.config, 1), b(r.config, 2);
  const testing::HostModel a0 = a, b0 = b;
  auto options = [&](const std::string& id, uint32_t index) {
    RuntimeOptions o = testing::runtime_options(r.kafka, r.config, id);
    o.index = index;
    o.learners = 2;
    return o;
  };
  LearnerRuntime la(options("A", 0), a.registered()), lb(options("B", 1), b.registered());
  // Both find no version 0 and propose theirs before any merger runs.
  Starting sa(la), sb(lb);
  REQUIRE(testing::eventually([&] { return r.proposals() == 8; }, 30s));
  auto merger = r.merger("M0");
  INFO(merger->log());
  REQUIRE(sa.join() == "started");
  REQUIRE(sb.join() == "started");

  for (size_t t = 0; t < a.values.size(); ++t) {
    INFO(a.specs[t].name);
    CHECK(same_bits(a.values[t], b.values[t]));
  }
  const auto states = r.states();
  REQUIRE(states.size() == 4);
  for (uint32_t p = 0; p < 4; ++p) {
    INFO("fragment " << p);
    const auto held = a.fragment(*r.layout, p);
    // One learner's initial values, whole: the proposal the merger committed.
    const auto from_a = a0.fragment(*r.layout, p), from_b = b0.fragment(*r.layout, p);
    CHECK((checksum_fp32(held) == checksum_fp32(from_a) || checksum_fp32(held) == checksum_fp32(from_b)));
    CHECK(states.at(p).version == 0);
    CHECK(states.at(p).checksum == checksum_fp32(held));
  }
  CHECK(la.versions() == std::vector<uint64_t>{0, 0, 0, 0});
  std::map<uint32_t, int> genesis_records;
  for (const auto& record : r.records()) genesis_records[record.fragment] += record.genesis;
  CHECK(genesis_records == std::map<uint32_t, int>{{0, 1}, {1, 1}, {2, 1}, {3, 1}});
  // The other learner's proposal of each fragment (rejections are written as they are decided).
  auto exists = [&] {
    size_t n = 0;
    for (const auto& rejection : r.rejected()) n += rejection.reason == "genesis_exists";
    return n;
  };
  CHECK(testing::eventually([&] { return exists() == 4; }, 30s));

  // They train and merge from there; the logs account for every proposal and delta.
  std::thread other([&] { train(lb, b, 24, 2e-4f); });
  train(la, a, 24, 1e-4f);
  other.join();
  REQUIRE(testing::eventually([&] { return r.count("M0", "merge") >= 4; }, 30s));
  la.close();
  lb.close();
  r.stop(*merger);
  const auto audit = testing::audit_run(r.kafka, r.config, {"r0"});
  INFO(audit.report());
  CHECK(audit.ok());
  CHECK(audit.genesis == 4);
  CHECK(audit.proposals.size() == 8);
  testing::require_verify_pass(r.kafka, r.dir, r.sets);
}

TEST_CASE("a learner whose tensors differ from the run's is refused at start, naming the tensor and both shapes",
          "[genesis]") {
  GenesisRun r("genesis-other-shape");
  auto merger = r.merger("M0");
  INFO(merger->log());
  testing::propose_genesis(r.kafka, r.config);
  const auto before = r.states();
  const size_t proposals = r.proposals();

  testing::HostModel other(with_shape(builtin_tensor_specs(model_options(r.config.model)), "blocks.1.mlp.up.bias", {255}), 3);
  const testing::HostModel untouched = other;
  LearnerRuntime learner(testing::runtime_options(r.kafka, r.config, "other"), other.registered());
  CHECK_THROWS_WITH(learner.start(), Contains("tensor 'blocks.1.mlp.up.bias' is [256] in the run, [255] here"));
  // Nothing of the run changed, and nothing of the learner's model.
  const auto after = r.states();
  REQUIRE(after.size() == before.size());
  for (const auto& [p, state] : before) {
    CHECK(after.at(p).version == state.version);
    CHECK(after.at(p).checksum == state.checksum);
  }
  CHECK(r.proposals() == proposals);
  CHECK(r.rejected().empty());
  for (size_t t = 0; t < other.values.size(); ++t) CHECK(same_bits(other.values[t], untouched.values[t]));
  CHECK(merger->running());
  r.stop(*merger);
}

TEST_CASE("a proposal of another model is rejected as wrong_fingerprint while its fragment awaits version 0, and "
          "its learner fails with that reason",
          "[genesis]") {
  GenesisRun r("genesis-wrong-model");
  // The run's model proposes fragments 0 and 1 (one in each partition) before anything else.
  const testing::HostModel run_model(r.config, 1);
  r.propose("first", run_model, r.layout, 0);
  r.propose("first", run_model, r.layout, 1);
  // A learner of another model finds no version 0 and proposes all four fragments after them.
  testing::HostModel other(with_shape(builtin_tensor_specs(model_options(r.config.model)), "position_embedding", {32, 64}), 2);
  std::atomic<bool> held{false};
  RuntimeOptions options = testing::runtime_options(r.kafka, r.config, "other");
  // The test holds the learner between two polls of its wait, as SIGSTOP would hold a process, so
  // that it looks again only once the merger has decided on every proposal.
  options.should_stop = [&] {
    while (held) std::this_thread::sleep_for(1ms);
    return false;
  };
  LearnerRuntime learner(options, other.registered());
  held = true;
  Starting starting(learner);
  REQUIRE(testing::eventually([&] { return r.proposals() == 6; }, 30s));

  auto merger = r.merger("M0");
  INFO(merger->log());
  // Fragments 0 and 1 get the run's model; its layout known, 2 and 3 await a proposal of it.
  std::vector<RejectedInput> rejected;
  REQUIRE(testing::eventually([&] { return (rejected = r.rejected()).size() == 4; }, 60s));
  for (const auto& rejection : rejected) {
    INFO(describe(rejection.source) << ": " << rejection.detail);
    CHECK(rejection.reason == "wrong_fingerprint");
    CHECK_THAT(rejection.detail, Contains("learner other") && Contains("tensor 'position_embedding' is [64,64] in the run, [32,64] here"));
  }
  const auto states = r.states();
  CHECK(states.size() == 2);  // 0 and 1; the other model's proposals of 2 and 3 were not taken
  CHECK(states.count(0));
  CHECK(states.count(1));
  CHECK(r.count("M0", "genesis") == 2);
  held = false;
  const std::string outcome = starting.join();
  CHECK_THAT(outcome, Contains("rejected this learner's proposal of version 0") && Contains("wrong_fingerprint") &&
                          Contains("tensor 'position_embedding' is [64,64] in the run, [32,64] here"));
  CHECK(merger->running());
  r.stop(*merger);
}

TEST_CASE("a merger restarted after genesis learns the model from its checkpoints and merges on", "[genesis][recovery]") {
  GenesisRun r("genesis-restart", {"diloco.H=8", "merger.quorum=1"});
  auto first = r.merger("M0");
  INFO(first->log());
  testing::propose_genesis(r.kafka, r.config);
  r.stop(*first);

  auto second = r.merger("M0", "M0-restarted");
  INFO(second->log());
  testing::HostModel model(r.config, 5);
  LearnerRuntime learner(testing::runtime_options(r.kafka, r.config, "A"), model.registered());
  REQUIRE(learner.start());
  train(learner, model, 16, 1e-4f);  // two deltas of every fragment
  REQUIRE(testing::eventually([&] { return r.count("M0-restarted", "merge") >= 4; }, 60s));
  // It knew the model before any proposal reached it: from the checkpoints of version 0.
  CHECK(r.count("M0-restarted", "layout") == 1);
  CHECK(r.count("M0-restarted", "genesis") == 0);
  CHECK(r.count("M0-restarted", "recovered") == 4);
  learner.close();
  r.stop(*second);
  const auto audit = testing::audit_run(r.kafka, r.config, {"r0"});
  INFO(audit.report());
  CHECK(audit.ok());
}

TEST_CASE("the audit flags a proposal no merger has decided on, and passes once one has rejected it",
          "[genesis][audit]") {
  GenesisRun r("genesis-audit");
  auto merger = r.merger("M0");
  INFO(merger->log());
  testing::propose_genesis(r.kafka, r.config);
  r.stop(*merger);
  {
    const auto audit = testing::audit_run(r.kafka, r.config, {"r0"});
    INFO(audit.report());
    REQUIRE(audit.ok());
  }
  // A late learner's proposal of fragment 2, written while no merger runs: nobody has read it.
  r.propose("late", testing::HostModel(r.config, 9), r.layout, 2);
  {
    const auto audit = testing::audit_run(r.kafka, r.config, {"r0"});
    INFO(audit.report());
    CHECK_FALSE(audit.ok());
    REQUIRE(audit.problems.size() == 1);
    CHECK_THAT(audit.problems[0], Contains("proposal " + r.topics.genesis() + "[0]@2") &&
                                      Contains("neither version 0 of its fragment nor rejected"));
  }
  // A merger reads it and rejects it: version 0 of fragment 2 exists.
  merger = r.merger("M0", "M0-again");
  INFO(merger->log());
  REQUIRE(testing::eventually([&] { return r.rejected().size() == 1; }, 60s));
  CHECK(r.rejected().front().reason == "genesis_exists");
  r.stop(*merger);
  const auto audit = testing::audit_run(r.kafka, r.config, {"r0"});
  INFO(audit.report());
  CHECK(audit.ok());
  CHECK(audit.rejected.size() == 1);
}

TEST_CASE("a learner of some fragments proposes, trains and adopts those alone, without buffers for the others",
          "[genesis][learner]") {
  GenesisRun r("genesis-some", {"diloco.H=8", "merger.quorum=1"});
  const FragmentLayout& layout = *r.layout;
  REQUIRE(layout.num_fragments() == 4);
  testing::HostModel model(r.config, 9);
  // Fragment 2's tensors only: the others get no buffer.
  auto registered = model.registered();
  std::set<uint32_t> mine;
  for (const auto& piece : layout.pieces[2]) mine.insert(piece.tensor);
  for (uint32_t t = 0; t < registered.size(); ++t)
    if (!mine.count(t)) registered[t].host = nullptr;
  RuntimeOptions options = testing::runtime_options(r.kafka, r.config, "A");

  SECTION("a fragment not in the layout, twice, or without its buffer is refused before any I/O") {
    options.fragments = {4};
    CHECK_THROWS_WITH(LearnerRuntime(options, registered), Contains("fragment 4 is not in the layout"));
    options.fragments = {2, 2};
    CHECK_THROWS_WITH(LearnerRuntime(options, registered), Contains("fragment 2 is listed twice"));
    options.fragments = {1, 2};
    CHECK_THROWS_WITH(LearnerRuntime(options, registered), Contains("has no host buffer"));
    options.fragments = {};
    CHECK_THROWS_WITH(LearnerRuntime(options, registered), Contains("has no host buffer"));
    // Its saved state (no I/O: standalone) loads into a learner of the same fragments only.
    options.mode = LearnerMode::Standalone;
    options.fragments = {2};
    LearnerRuntime some(options, registered);
    REQUIRE(some.start());
    const auto bytes = some.save_state();
    LearnerRuntime same(options, registered);
    REQUIRE(same.start());
    CHECK_NOTHROW(same.load_state(bytes));
    options.fragments = {};
    LearnerRuntime all(options, model.registered());
    REQUIRE(all.start());
    CHECK_THROWS_WITH(all.load_state(bytes), Contains("the saved state holds fragments 2, this learner takes part in 0,1,2,3"));
    CHECK_THROWS_WITH(some.load_state(all.save_state()), Contains("holds fragments 0,1,2,3, this learner takes part in 2"));
  }
  SECTION("through a real merger") {
    auto merger = r.merger("M0");
    INFO(merger->log());
    options.fragments = {2};
    LearnerRuntime learner(options, registered);
    REQUIRE(learner.start());
    // Version 0 of fragment 2 alone, from this learner's values.
    auto states = r.states();
    REQUIRE(states.size() == 1);
    REQUIRE(states.count(2) == 1);
    CHECK(states.at(2).checksum == checksum_fp32(model.fragment(layout, 2)));
    train(learner, model, 16, 1e-4f);  // two cuts of fragment 2 (the second may be on version 0 still)
    REQUIRE(testing::eventually([&] { learner.poll(); return learner.versions()[2] >= 1; }, 60s));
    CHECK(learner.versions()[0] == 0);
    CHECK(learner.versions()[1] == 0);
    CHECK(learner.versions()[3] == 0);
    // It tracks the merge log's version of fragment 2 (its saved state: the anchor it cuts from),
    // and its deltas and the records are of fragment 2 alone.
    const auto records = r.records();
    std::optional<uint64_t> checksum;
    for (const auto& rec : records) {
      CHECK(rec.fragment == 2);
      if (rec.version == learner.versions()[2]) checksum = rec.checksum;
    }
    REQUIRE(checksum.has_value());
    const SavedLearner saved = decode_learner_state(learner.save_state(), run_decode_limits(r.config, layout));
    REQUIRE(saved.fragments.size() == 1);
    CHECK(saved.fragments[0].fragment == 2);
    CHECK(saved.fragments[0].version == learner.versions()[2]);
    CHECK(checksum_fp32(saved.fragments[0].anchor) == *checksum);
    learner.close();
    r.stop(*merger);
    // verify rebuilds fragment 2 and names the others as without a version 0.
    testing::require_verify_pass(r.kafka, r.dir, r.sets);
    std::ifstream log(r.dir + "/verify.log");
    const std::string verify((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    CHECK_THAT(verify, Contains("verify: fragment 2: ok from"));
    for (uint32_t p : {0u, 1u, 3u})
      CHECK_THAT(verify, Contains("verify: fragment " + std::to_string(p) + ": no version 0 yet, nothing to verify"));
    CHECK_THAT(verify, Contains("verified 1 fragments"));
  }
}
