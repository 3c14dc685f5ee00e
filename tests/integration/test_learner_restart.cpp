// A learner id is one process at a time, and a learner that comes back continues where it was
// (learner/runtime.h start(), load_state()): real broker, a real merger, diloco-learner processes
// stopped with real signals, and in-process learners (LearnerRuntime over host buffers).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <thread>

#include "core/codec/learner_state.h"
#include "core/fragments/message_budget.h"
#include "core/kafka/log_reader.h"
#include "core/kafka/run_log.h"
#include "tests/integration/run_audit.h"
#include "tests/integration/run_fixture.h"

using namespace diloco;
using namespace std::chrono_literals;
using Catch::Matchers::Contains;

namespace {

// A tiny run in region r0, its learners' processes and what they logged and announced.
struct RestartRun : testing::TinyRun {
  using TinyRun::TinyRun;

  // diloco-learner `id` training until stopped; its run folder dir/id (a restart appends to it)
  // unless `folder` names another, its output dir/log.log.
  std::unique_ptr<testing::ChildProcess> learner(const std::string& id, const std::string& log,
                                                 const std::string& folder = "") const {
    std::vector<std::string> args = {testing::learner_binary(), "-c", testing::tiny_config_path(), "--id", id,
                                     "--region", "r0", "--regions", "r0", "--bootstrap", kafka.bootstrap_servers,
                                     "--steps", "1000000", "--max-seconds", "240", "--log-every", "2", "--run-dir",
                                     dir + "/" + (folder.empty() ? id : folder)};
    args.insert(args.end(), sets.begin(), sets.end());
    return std::make_unique<testing::ChildProcess>(args, dir + "/" + log + ".log");
  }
  std::vector<nlohmann::json> events(const std::string& id, const std::string& event) const {
    std::vector<nlohmann::json> out;
    for (auto& j : testing::read_json_lines(dir + "/" + id + "/metrics.jsonl"))
      if (j.value("event", "") == event) out.push_back(std::move(j));
    return out;
  }
  // The step of the newest `step` line after the process's `starts`-th start.
  uint64_t step_after_start(const std::string& id, int starts) const {
    int seen = 0;
    uint64_t step = 0;
    for (const auto& j : testing::read_json_lines(dir + "/" + id + "/metrics.jsonl")) {
      const std::string e = j.value("event", "");
      seen += e == "start";
      if (e == "step" && seen == starts) step = j["step"];
    }
    return step;
  }
  // The newest announcement of `id` in `members`.
  Member announcement(const std::string& id) const {
    std::optional<Member> newest;
    read_to_end(kafka, {topics.members()}, [&](const ConsumedMessage& m) {
      if (m.key == id && !m.tombstone) newest = decode_member(m.value, DecodeLimits{.run_id = run});
    }, 30000);
    REQUIRE(newest.has_value());
    return *newest;
  }
  void stop(testing::ChildProcess& p, int expected = 0) const {
    p.signal(SIGTERM);
    const auto code = p.wait_exit(60s);
    INFO(p.log());
    REQUIRE(code == std::optional<int>(expected));
  }
};

const std::string kWatching = "by another process; watching it for";

}  // namespace

TEST_CASE("a second learner process under a live learner's id is refused, naming the id", "[learner][restart]") {
  RestartRun r("id-claim", {"train.eval_every=0"});
  auto merger = testing::start_merger(r.kafka, r.dir, "M0", r.sets);
  auto first = r.learner("L0", "L0");
  INFO(merger->log() << "\n" << first->log());
  REQUIRE(testing::eventually([&] { return r.step_after_start("L0", 1) >= 10; }, 120s));

  auto second = r.learner("L0", "L0-second", "L0-second");
  const auto code = second->wait_exit(90s);
  INFO(second->log());
  REQUIRE(code == std::optional<int>(1));
  CHECK_THAT(second->log(), Contains(kWatching) && Contains("learner id 'L0' is held by a live process"));
  // The first trains on, undisturbed.
  const uint64_t step = r.step_after_start("L0", 1);
  CHECK(testing::eventually([&] { return r.step_after_start("L0", 1) > step + 10; }, 30s));
  CHECK(first->running());
  r.stop(*first);
  r.stop(*merger);
}

TEST_CASE("a learner restarted after SIGTERM continues at its last step at once, and after SIGKILL it waits out the "
          "claim and continues at its last announced step",
          "[learner][restart]") {
  RestartRun r("restart", {"train.eval_every=0"});
  auto merger = testing::start_merger(r.kafka, r.dir, "M0", r.sets);
  INFO(merger->log());
  auto learner = r.learner("L0", "L0-1");
  REQUIRE(testing::eventually([&] { return r.step_after_start("L0", 1) >= 20; }, 120s));
  r.stop(*learner);
  const uint64_t stopped_at = r.events("L0", "stop").back()["step"];
  REQUIRE(stopped_at >= 20);
  CHECK(r.announcement("L0").leaving);  // its last word: where it stopped, and that it left
  CHECK(r.announcement("L0").step == stopped_at);

  // Stopped cleanly: the id is free at once, and it goes on from where it stopped.
  learner = r.learner("L0", "L0-2");
  REQUIRE(testing::eventually([&] { return r.step_after_start("L0", 2) >= stopped_at + 20; }, 120s));
  {
    INFO(learner->log());
    CHECK(learner->log().find(kWatching) == std::string::npos);
    REQUIRE(r.events("L0", "resume").size() == 1);
    CHECK(r.events("L0", "resume").back()["step"] == stopped_at);
  }

  // Killed: its last announcement is recent and not a leaving one, so the restart watches the id
  // for id_claim_wait_s; no newer announcement comes, and it continues at the announced step (a
  // heartbeat's, every few seconds: the steps since are lost with the process).
  REQUIRE(testing::eventually([&] { return r.announcement("L0").step > stopped_at; }, 60s));
  learner->signal(SIGKILL);
  REQUIRE(learner->wait_exit(10s).has_value());
  const Member last = r.announcement("L0");
  CHECK_FALSE(last.leaving);
  REQUIRE(last.step > stopped_at);
  const auto restarted = std::chrono::steady_clock::now();
  learner = r.learner("L0", "L0-3");
  REQUIRE(testing::eventually([&] { return r.events("L0", "resume").size() == 2; }, 120s));
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - restarted).count();
  INFO(learner->log());
  CHECK_THAT(learner->log(), Contains(kWatching));
  CHECK(r.events("L0", "resume").back()["step"] == last.step);
  CHECK(waited >= RuntimeOptions{}.id_claim_wait_s);
  CHECK(testing::eventually([&] { return r.step_after_start("L0", 3) > last.step; }, 60s));
  r.stop(*learner);
  r.stop(*merger);
  const auto audit = testing::audit_run(r.kafka, r.config, {"r0"});
  INFO(audit.report());
  CHECK(audit.ok());
}

TEST_CASE("a learner's saved state restored after the run moved on rebases its progress onto the new versions",
          "[learner][restart][learner_state]") {
  // Every version checkpointed: the newest versions can be read from `state`.
  RestartRun r("load-state", {"merger.checkpoint_every=1"});
  auto merger = testing::start_merger(r.kafka, r.dir, "M0", r.sets);
  INFO(merger->log());
  const FragmentLayout layout = builtin_layout(r.config);
  auto train = [](LearnerRuntime& learner, testing::HostModel& model, int steps, float rate) {
    for (int i = 0; i < steps; ++i) {
      for (auto& tensor : model.values)
        for (auto& v : tensor) v -= rate;
      learner.step({.tokens = 1024, .loss = 2.0f});
      std::this_thread::sleep_for(5ms);
    }
  };

  // Learner A proposes version 0, trains 11 steps (one fragment is cut at step 10, and its merge
  // cannot be back one step later) and saves its state with its model; 3 more steps are lost
  // when it stops.
  testing::HostModel a(r.config, 1);
  std::vector<uint8_t> saved;
  testing::HostModel checkpoint = a;
  {
    LearnerRuntime learner(testing::runtime_options(r.kafka, r.config, "A"), a.registered());
    REQUIRE(learner.start());
    train(learner, a, 11, 1e-4f);
    saved = learner.save_state();
    checkpoint = a;
    train(learner, a, 3, 1e-4f);
    learner.close();
  }
  const SavedLearner state = decode_learner_state(saved, run_decode_limits(r.config, layout));
  REQUIRE(state.step == 11);
  REQUIRE(std::count_if(state.fragments.begin(), state.fragments.end(), [](const SavedFragment& f) { return f.sent_on_base; }) == 1);

  // Learner B moves every fragment past the version A saved.
  {
    testing::HostModel b(r.config, 2);
    LearnerRuntime learner(testing::runtime_options(r.kafka, r.config, "B"), b.registered());
    REQUIRE(learner.start());
    auto moved = [&] {
      const auto states = read_states(r.kafka, r.topics, run_decode_limits(r.config, layout), 4).latest;
      for (const auto& f : state.fragments)
        if (!states.count(f.fragment) || states.at(f.fragment).version <= f.version) return false;
      return true;
    };
    for (int round = 0; round < 10 && !moved(); ++round) train(learner, b, 40, 2e-4f);
    REQUIRE(testing::eventually(moved, 30s));
    learner.close();
  }
  // The run stands still from here (its merger merges what B sent last, and stops): the versions
  // A comes back to are the newest in `state`.
  r.stop(*merger);
  const auto newest = read_states(r.kafka, r.topics, run_decode_limits(r.config, layout), 4).latest;

  // A comes back: start() writes the run's newest versions into its buffers; the client restores
  // its model from its checkpoint; load_state() takes the saved progress back.
  testing::HostModel restored(r.config, 3);
  LearnerRuntime learner(testing::runtime_options(r.kafka, r.config, "A"), restored.registered());
  REQUIRE(learner.start());
  CHECK(learner.step_count() == 14);  // the step A announced when it stopped
  for (uint32_t p = 0; p < 4; ++p) {
    INFO("fragment " << p);
    CHECK(learner.versions()[p] == newest.at(p).version);
    CHECK(checksum_fp32(restored.fragment(layout, p)) == newest.at(p).checksum);
  }
  for (size_t t = 0; t < restored.values.size(); ++t)  // in place: the buffers stay registered
    std::copy(checkpoint.values[t].begin(), checkpoint.values[t].end(), restored.values[t].begin());
  learner.load_state(saved);
  CHECK(learner.step_count() == 11);
  for (const auto& f : state.fragments) {
    INFO("fragment " << f.fragment << ", saved on version " << f.version << (f.sent_on_base ? ", cut on it" : ""));
    // received + (local - from): from is the parameters at the last cut on the saved base, or its
    // anchor when nothing of it was cut.
    const auto& received = newest.at(f.fragment).params;
    const auto local = checkpoint.fragment(layout, f.fragment);
    const auto held = restored.fragment(layout, f.fragment);
    REQUIRE(held.size() == received.size());
    for (size_t t = 0; t < received.size(); ++t) {
      const std::vector<float>& from = f.sent_on_base ? f.cut_point[t] : f.anchor[t].values;
      std::vector<float> expected = received[t].values;
      for (size_t i = 0; i < expected.size(); ++i) expected[i] += local[t].values[i] - from[i];
      CHECK(std::memcmp(held[t].values.data(), expected.data(), expected.size() * sizeof(float)) == 0);
    }
  }
  learner.close();
  const auto audit = testing::audit_run(r.kafka, r.config, {"r0"});
  INFO(audit.report());
  CHECK(audit.ok());
}
