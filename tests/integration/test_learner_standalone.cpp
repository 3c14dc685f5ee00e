// The single-learner baseline on the tiny config learns the corpus: held-out loss below 2.6
// nats/char after 200 steps (unigram entropy 3.07, untrained about 4.6). Needs the corpus that
// scripts/bootstrap extracts, not the broker.
#include <catch2/catch.hpp>

#include "tests/integration/child_process.h"
#include "tests/integration/run_fixture.h"

using namespace diloco;
using namespace std::chrono_literals;

TEST_CASE("standalone learner on tiny: held-out loss below 2.6 after 200 steps", "[learner][standalone]") {
  std::string dir = testing::temp_dir("standalone");
  testing::ChildProcess learner({testing::learner_binary(), "-c", testing::tiny_config_path(), "--standalone",
                                 "--steps", "200", "--set", "train.eval_every=100", "--run-dir", dir},
                                dir + "/learner.log");
  auto code = learner.wait_exit(180s);
  INFO(learner.log());
  REQUIRE(code.has_value());
  REQUIRE(*code == 0);
  std::vector<double> evals;
  for (const auto& j : testing::read_json_lines(dir + "/metrics.jsonl"))
    if (j.value("event", "") == "eval") evals.push_back(j["eval_loss"]);
  REQUIRE(evals.size() == 3);  // steps 0, 100 and 200
  CHECK(evals[0] > 4.0);        // an untrained model is close to ln(96) = 4.56 nats/char
  CHECK(evals[1] < 3.5);
  CHECK(evals[2] < 2.6);
  CHECK(evals[2] < evals[1]);
}

TEST_CASE("learner refuses bad input with a clear error and a non-zero exit", "[learner][errors]") {
  std::string dir = testing::temp_dir("learner-errors");
  {
    testing::ChildProcess p({testing::learner_binary(), "-c", testing::tiny_config_path(), "--standalone", "--set",
                             "model.width=65"},
                            dir + "/width.log");
    CHECK(p.wait_exit(60s) == std::optional<int>(1));
    CHECK_THAT(p.log(), Catch::Contains("model.width (65) must be a multiple of model.heads (4)"));
  }
  {
    testing::ChildProcess p({testing::learner_binary(), "-c", testing::tiny_config_path(), "--standalone", "--set",
                             "data.path=\"/nonexistent/kjv.txt\""},
                            dir + "/data.log");
    CHECK(p.wait_exit(60s) == std::optional<int>(1));
    CHECK_THAT(p.log(), Catch::Contains("scripts/bootstrap"));
  }
  {
    const auto start = std::chrono::steady_clock::now();
    testing::ChildProcess p({testing::learner_binary(), "-c", testing::tiny_config_path(), "--bootstrap",
                             "127.0.0.1:1", "--steps", "5", "--connect-timeout", "3"},
                            dir + "/broker.log");
    CHECK(p.wait_exit(90s) == std::optional<int>(1));
    CHECK_THAT(p.log(), Catch::Contains("scripts/broker start"));
    CHECK_THAT(p.log(), Catch::Contains("within 3 s"));
    CHECK(std::chrono::steady_clock::now() - start < 30s);  // the default wait is 30 s
  }
  {
    // Refused before the broker is even asked (the bootstrap address here has none): chunks that
    // cannot fit one Kafka record, by learner and merger alike, and a 554M-parameter fragment
    // whose fp32 deltas (4 B per parameter, built whole; its checkpoint, snapshots and proposal
    // would travel streamed) cannot be one buffer, by the learner, whose model it is (a merger
    // learns the model from the learners' proposals, and holds none at start).
    struct Case {
      std::vector<std::string> sets, expected, binaries;
    };
    const std::vector<Case> cases = {
        {{"--set", "codec.chunk_bytes=67108864"},
         {"codec.chunk_bytes is 67108864 bytes", "above the 67108864-byte limit of one Kafka record",
          "lower codec.chunk_bytes to at most 67107840"},
         {testing::learner_binary(), testing::merger_binary()}},
        {{"--set", "model.width=2048", "--set", "model.layers=11", "--set", "diloco.fragments=1", "--set",
          "codec.dtype=\"fp32\"", "--set", "codec.topk=0"},
         {"fragment 0 has 554469376 parameters", "its delta message", "above the 2146435072-byte limit of one message",
          "set diloco.fragments to at least 2", "codec.dtype = \"int4\""},
         {testing::learner_binary()}},
    };
    int n = 0;
    for (const auto& [sets, expected, binaries] : cases) {
      std::vector<std::string> common = {"-c", testing::tiny_config_path(), "--bootstrap", "127.0.0.1:1"};
      common.insert(common.end(), sets.begin(), sets.end());
      for (const std::string& binary : binaries) {
        std::vector<std::string> args = {binary};
        args.insert(args.end(), common.begin(), common.end());
        testing::ChildProcess p(args, dir + "/size-" + std::to_string(++n) + ".log");
        CHECK(p.wait_exit(90s) == std::optional<int>(1));
        for (const auto& text : expected) CHECK_THAT(p.log(), Catch::Contains(text));
      }
    }
  }
}
