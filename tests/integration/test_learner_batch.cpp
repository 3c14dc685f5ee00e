// Mixed hardware: learners of different batch sizes in one run. Real broker, one merger and two
// learner processes started with different train.batch: each announces its batch and context in
// `members`, the merger bounds each delta's tokens by its own learner's announcement, and merges
// weigh each input by the tokens it really trained on. A delta that claims more tokens than its
// learner announced is refused, and the learner (its RefusalWatch) is told why.
#include <catch2/catch.hpp>

#include <csignal>
#include <set>
#include <thread>

#include "core/fragments/message_budget.h"
#include "core/kafka/log_reader.h"
#include "core/kafka/producer.h"
#include "core/kafka/run_log.h"
#include "core/metrics/metrics.h"
#include "core/process.h"
#include "learner/refusal_watch.h"
#include "tests/integration/child_process.h"
#include "tests/integration/run_fixture.h"

using namespace diloco;
using namespace std::chrono_literals;

namespace {

std::unique_ptr<testing::ChildProcess> learner(const testing::TinyRun& r, const std::string& id, int index, int batch,
                                               int steps) {
  std::vector<std::string> args = {testing::learner_binary(), "-c", testing::tiny_config_path(), "--id", id,
                                   "--index", std::to_string(index), "--learners", "2", "--region", "r0",
                                   "--regions", "r0", "--bootstrap", r.kafka.bootstrap_servers, "--steps",
                                   std::to_string(steps), "--run-dir", r.dir + "/" + id, "--log-every", "10"};
  args.insert(args.end(), r.sets.begin(), r.sets.end());
  args.insert(args.end(), {"--set", "train.batch=" + std::to_string(batch)});
  return std::make_unique<testing::ChildProcess>(args, r.dir + "/" + id + ".log");
}

size_t count_events(const std::string& path, const std::string& event, const std::string& learner) {
  size_t n = 0;
  for (const auto& j : testing::read_json_lines(path))
    if (j.value("event", "") == event && j.value("learner", "") == learner) ++n;
  return n;
}

}  // namespace

TEST_CASE("learners of different batch sizes share a run, merged by their real tokens, and a delta claiming more than "
          "its learner announced is refused and the learner is told why",
          "[learner][batch]") {
  testing::TinyRun r("batch", {"train.eval_every=0", "diloco.H=8", "merger.quorum=2"});
  const int context = r.config.model.context;
  auto merger = testing::start_merger(r.kafka, r.dir, "M0", r.sets);
  // The learners train until stopped: the liar's drop is recorded with a later merge of fragment 0,
  // which only learners still running bring (on a slow machine a fixed number of steps can end
  // before the liar's delta is read).
  auto small = learner(r, "small", 0, 4, 100000);
  auto large = learner(r, "large", 1, 16, 100000);

  // A learner that lies: it announces 1 sequence of 1 token per step, then sends a delta that
  // claims 10 steps of 16 x context tokens. It watches for refusals as every learner does.
  const std::string merger_log = r.dir + "/M0/metrics.jsonl";
  {
    Member liar{.run_id = r.run, .instance_id = "liar", .role = Role::Learner, .region = "r0", .batch = 1,
                .context = 1};
    Producer producer({.kafka = r.kafka}, nullptr);
    producer.produce({.topic = r.topics.members(), .partition = 0, .key = "liar", .value = encode_member(liar)}, 0,
                     10000);
    REQUIRE(producer.flush(20000) == 0);
  }
  REQUIRE(testing::eventually([&] { return count_events(merger_log, "learner_declared", "small") == 1; }, 120s));
  REQUIRE(testing::eventually([&] { return count_events(merger_log, "learner_declared", "liar") == 1; }, 30s));

  const auto layout = std::make_shared<const FragmentLayout>(builtin_layout(r.config));
  Metrics metrics("test_");
  std::vector<std::string> said;
  RefusalWatch watch({.kafka = r.kafka, .topics = r.topics, .partitions = 2, .learner_id = "liar",
                      .limits = run_decode_limits(r.config, *layout),
                      .say = [&](const std::string& text) { said.push_back(text); }},
                     metrics);
  {
    DeltaHeader h{.run_id = r.run, .fingerprint = layout->fingerprint, .learner_id = "liar", .region = "r0",
                  .fragment = 0, .seq = 1, .base_version = 0, .inner_steps = 10,
                  .tokens = static_cast<uint64_t>(10 * 16 * context), .learner_step = 10};
    std::vector<DenseTensor> tensors;
    for (const auto& spec : layout->fragments.at(0))
      tensors.push_back(DenseTensor{static_cast<uint32_t>(tensors.size()), spec.shape,
                                    std::vector<float>(static_cast<size_t>(spec.numel()), 1e-4f)});
    Producer producer({.kafka = r.kafka}, nullptr);
    producer.produce({.topic = r.topics.deltas("r0"), .partition = 0, .key = "0",
                      .value = encode_delta(h, std::span<const DenseTensor>(tensors), CodecOptions{.dtype = DType::F32})},
                     0, 10000);
    REQUIRE(producer.flush(20000) == 0);
  }
  // The drop is recorded with fragment 0's next merge, which the two real learners bring.
  const bool told = testing::eventually([&] {
    watch.poll();
    return watch.refused() > 0;
  }, 120s);
  INFO(merger->log());
  REQUIRE(told);
  REQUIRE(said.size() == 1);
  CHECK_THAT(said[0], Catch::StartsWith("a merger refused a delta of this learner: invalid: ") &&
                          Catch::Contains(detail::concat(10 * 16 * context, " tokens in 10 inner steps, more than the 1 "
                                                         "sequences x 1 tokens per step that learner liar announced")));
  CHECK(metrics.value("deltas_refused_total", {{"reason", "invalid"}}) == 1);

  // Enough merges for the checks below, then a clean stop.
  REQUIRE(testing::eventually([&] {
    size_t merges = 0;
    for (const auto& j : testing::read_json_lines(merger_log)) merges += j.value("event", "") == "merge";
    return merges >= 6;
  }, 120s));
  for (auto* l : {small.get(), large.get()}) l->signal(SIGTERM);
  for (auto* l : {small.get(), large.get()}) {
    auto code = l->wait_exit(60s);
    INFO(l->log());
    REQUIRE(code == std::optional<int>(0));
  }
  merger->signal(SIGTERM);
  REQUIRE(merger->wait_exit(60s) == std::optional<int>(0));
  CHECK(count_events(merger_log, "learner_declared", "large") == 1);

  // Every input of the real learners carries its own batch's tokens and weighs by them.
  const DecodeLimits limits = run_decode_limits(r.config, *layout);
  size_t both = 0, inputs = 0, liar_refusals = 0;
  read_to_end(r.kafka, {r.topics.merges()}, [&](const ConsumedMessage& m) {
    const MergeRecord record = decode_merge_record(m.value, limits);
    if (record.genesis) return;  // its one input is a proposal of version 0
    std::set<std::string> learners;
    for (const auto& in : record.inputs) {
      INFO("fragment " << record.fragment << " version " << record.version << " input of " << in.learner_id);
      REQUIRE((in.learner_id == "small" || in.learner_id == "large"));
      const uint64_t batch = in.learner_id == "small" ? 4 : 16;
      CHECK(in.tokens == uint64_t{in.inner_steps} * batch * static_cast<uint64_t>(context));
      // No staleness discount (alpha 0): weight = tokens x tokens per step (weighting.h), so a
      // step of the large learner weighs 16 times a step of the small one.
      const double tokens = static_cast<double>(in.tokens);
      CHECK(in.weight == Approx(tokens * tokens / in.inner_steps));
      learners.insert(in.learner_id);
      ++inputs;
    }
    for (const auto& d : record.dropped) {
      if (d.delta.learner_id == "liar") ++liar_refusals;
      CHECK((d.delta.learner_id == "liar" || d.reason != DropReason::Invalid));
    }
    if (learners.size() == 2) ++both;
  }, 30000);
  CHECK(inputs >= 8);
  CHECK(both >= 2);
  CHECK(liar_refusals == 1);
  // The real learners were told of no refusal.
  for (const char* id : {"small", "large"}) {
    auto stop = testing::last_event(r.dir + "/" + id + "/metrics.jsonl", "step");
    REQUIRE(stop.has_value());
    CHECK(stop->value("deltas_refused", uint64_t{99}) == 0);
  }
  // Replay rebuilds every version with the refusal in the log.
  testing::require_verify_pass(r.kafka, r.dir, r.sets);
}

TEST_CASE("a learner's proposal of version 0 that lost the race to another's is not reported as a refused delta",
          "[learner][refusals]") {
  testing::TinyRun r("refusal-genesis", {});
  const auto layout = std::make_shared<const FragmentLayout>(builtin_layout(r.config));
  Metrics metrics("test_");
  std::vector<std::string> said;
  RefusalWatch watch({.kafka = r.kafka, .topics = r.topics, .partitions = 2, .learner_id = "small",
                      .limits = run_decode_limits(r.config, *layout),
                      .say = [&](const std::string& text) { said.push_back(text); }},
                     metrics);
  // The watch reads from the topics' ends as it finds them: let it find them first.
  const auto settle = std::chrono::steady_clock::now() + 3s;
  while (std::chrono::steady_clock::now() < settle) {
    watch.poll();
    std::this_thread::sleep_for(50ms);
  }
  // What a merger writes when two learners propose together: the loser's proposals, then one of
  // its deltas refused for a real reason.
  Producer producer({.kafka = r.kafka}, nullptr);
  auto reject = [&](const std::string& topic, int64_t offset, const std::string& reason) {
    RejectedInput rejected{.run_id = r.run, .source = {topic, 0, offset}, .reason = reason, .detail = "test",
                           .rejected_by = "M0", .time_us = unix_us(), .sender = "small"};
    producer.produce({.topic = r.topics.rejected(), .partition = 0, .key = "", .value = encode_rejected(rejected)}, 0,
                     10000);
  };
  reject(r.topics.genesis(), 2, "genesis_exists");
  reject(r.topics.genesis(), 3, "genesis_exists");
  reject(r.topics.deltas("r0"), 7, "invalid");
  REQUIRE(producer.flush(20000) == 0);
  REQUIRE(testing::eventually([&] {
    watch.poll();
    return watch.refused() > 0;
  }, 30s));
  watch.poll();
  CHECK(watch.refused() == 1);
  REQUIRE(said.size() == 1);
  CHECK_THAT(said[0], Catch::StartsWith("a merger refused a delta of this learner: invalid: "));
}
