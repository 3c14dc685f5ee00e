// Authenticated parameters end to end: a merger and learner processes with CURVE keys from
// diloco-keys ([security] set with --set). The allowed learner trains and adopts the merged
// versions; a learner whose key the merger does not list receives no parameters (it adopts
// nothing) and the merger counts and says the refusal; the run verifies.
#include <catch2/catch.hpp>

#include <csignal>
#include <filesystem>

#include "tests/integration/child_process.h"
#include "tests/integration/run_fixture.h"

using namespace diloco;
using namespace std::chrono_literals;

TEST_CASE("with CURVE only the learners whose keys the merger allows receive parameters", "[curve][security]") {
  testing::TinyRun r("curve", {"train.eval_every=0", "diloco.H=4"});
  const std::string keys = r.dir + "/keys";
  const std::string tool = DILOCO_BINARY_DIR "/bin/diloco-keys";
  for (const auto& args : std::vector<std::vector<std::string>>{{tool, "--dir", keys, "merger"},
                                                                 {tool, "--dir", keys + "/allowed", "good"},
                                                                 {tool, "--dir", keys + "/other", "stranger"}}) {
    testing::ChildProcess make(args, r.dir + "/keys.log");
    REQUIRE(make.wait_exit(30s) == std::optional<int>(0));
  }
  // The merger holds the learners' public keys only; each learner its own secret one.
  std::filesystem::rename(keys + "/allowed/good.key_secret", keys + "/good.key_secret");
  std::filesystem::rename(keys + "/other/stranger.key_secret", keys + "/stranger.key_secret");
  auto sets = r.sets;
  sets.insert(sets.end(), {"--set", "security.merger_public_key=\"" + keys + "/merger.key\"", "--set",
                           "security.merger_secret_key=\"" + keys + "/merger.key_secret\"", "--set",
                           "security.allowed_learners=\"" + keys + "/allowed\""});
  auto merger = testing::start_merger(r.kafka, r.dir, "M0", sets);
  auto learner = [&](const std::string& id, int index, const std::string& key) {
    std::vector<std::string> args = {testing::learner_binary(), "-c", testing::tiny_config_path(), "--id", id,
                                     "--index", std::to_string(index), "--learners", "2", "--region", "r0",
                                     "--regions", "r0", "--bootstrap", r.kafka.bootstrap_servers, "--steps", "100000",
                                     "--run-dir", r.dir + "/" + id};
    args.insert(args.end(), sets.begin(), sets.end());
    args.insert(args.end(), {"--set", "security.learner_key=\"" + key + "\""});
    return std::make_unique<testing::ChildProcess>(args, r.dir + "/" + id + ".log");
  };
  auto good = learner("good", 0, keys + "/good.key_secret");
  REQUIRE(testing::eventually([&] { return testing::count_events(r.dir + "/good/metrics.jsonl", "adopt") >= 3; }, 120s));
  auto stranger = learner("stranger", 1, keys + "/stranger.key_secret");
  REQUIRE(testing::eventually([&] { return testing::count_events(r.dir + "/stranger/metrics.jsonl", "step") >= 1; }, 120s));
  const size_t adopted = testing::count_events(r.dir + "/good/metrics.jsonl", "adopt");
  REQUIRE(testing::eventually([&] { return testing::count_events(r.dir + "/good/metrics.jsonl", "adopt") >= adopted + 3; },
                              120s));
  CHECK(testing::count_events(r.dir + "/stranger/metrics.jsonl", "adopt") == 0);
  for (auto* l : {good.get(), stranger.get()}) l->signal(SIGTERM);
  for (auto* l : {good.get(), stranger.get()}) CHECK(l->wait_exit(60s) == std::optional<int>(0));
  merger->signal(SIGTERM);
  REQUIRE(merger->wait_exit(60s) == std::optional<int>(0));
  INFO(merger->log());
  CHECK_THAT(merger->log(), Catch::Contains("parameters authenticated (CURVE)") &&
                                Catch::Contains("refused a subscriber") && Catch::Contains("is not in"));
  const auto stop = testing::last_event(r.dir + "/M0/metrics.jsonl", "stop");
  REQUIRE(stop.has_value());
  double refused = 0, allowed = 0;
  for (const auto& [key, v] : stop->at("metrics").items()) {
    if (key.find("zap_decisions_total") == std::string::npos) continue;
    (key.find("refused") != std::string::npos ? refused : allowed) += v.get<double>();
  }
  CHECK(allowed >= 1);
  CHECK(refused >= 1);
  testing::require_verify_pass(r.kafka, r.dir, r.sets);
}

TEST_CASE("a learner of a run with CURVE and no key of its own is refused at start naming the setting",
          "[curve][security]") {
  testing::TinyRun r("curve-nokey", {"train.eval_every=0"});
  std::vector<std::string> args = {testing::learner_binary(), "-c", testing::tiny_config_path(), "--id", "L0",
                                   "--region", "r0", "--regions", "r0", "--bootstrap", r.kafka.bootstrap_servers,
                                   "--steps", "10", "--set", "security.merger_public_key=\"/nonexistent/merger.key\""};
  args.insert(args.end(), r.sets.begin(), r.sets.end());
  testing::ChildProcess l(args, r.dir + "/L0.log");
  CHECK(l.wait_exit(60s) == std::optional<int>(1));
  CHECK_THAT(l.log(), Catch::Contains("security.learner_key is not set"));
}
