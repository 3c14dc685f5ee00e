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
    testing::ChildProcess p({testing::learner_binary(), "-c", testing::tiny_config_path(), "--bootstrap",
                             "127.0.0.1:1", "--steps", "5"},
                            dir + "/broker.log");
    CHECK(p.wait_exit(90s) == std::optional<int>(1));
    CHECK_THAT(p.log(), Catch::Contains("scripts/broker start"));
  }
  {
    // 25M parameters in one fragment: its checkpoint cannot fit one Kafka message. Refused before
    // the broker is even asked (the bootstrap address here has none), and the merger the same way.
    const std::vector<std::string> too_large = {"-c", testing::tiny_config_path(), "--bootstrap", "127.0.0.1:1",
                                                "--set", "model.width=1024", "--set", "diloco.fragments=1"};
    std::vector<std::string> learner_args = {testing::learner_binary()};
    learner_args.insert(learner_args.end(), too_large.begin(), too_large.end());
    testing::ChildProcess learner(learner_args, dir + "/size-learner.log");
    std::vector<std::string> merger_args = {testing::merger_binary()};
    merger_args.insert(merger_args.end(), too_large.begin(), too_large.end());
    testing::ChildProcess merger(merger_args, dir + "/size-merger.log");
    for (auto* p : {&learner, &merger}) {
      CHECK(p->wait_exit(90s) == std::optional<int>(1));
      CHECK_THAT(p->log(), Catch::Contains("above the 67108864-byte limit of one Kafka message"));
      CHECK_THAT(p->log(), Catch::Contains("set diloco.fragments to at least"));
    }
  }
}
