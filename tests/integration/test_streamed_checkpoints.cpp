// Checkpoints above codec.segment_bytes travel streamed (core/codec/messages.h): segments, each a
// message of its own, keyed "<fragment>/<record>" on the compacted `state` topic. Real broker,
// real processes: a merger writes them, a restarted merger recovers from them, a learner joins
// from them, and replay rebuilds and verifies every version. Proposals of version 0 and
// snapshots stream the same way: the merger commits version 0 from streamed proposals (which
// replay reads back), and with an fp32 downlink every version reaches the learners as a streamed
// snapshot.
#include <catch2/catch.hpp>

#include <csignal>
#include <map>

#include "core/fragments/message_budget.h"
#include "core/kafka/log_reader.h"
#include "core/kafka/run_log.h"
#include "tests/integration/child_process.h"
#include "tests/integration/run_fixture.h"

using namespace diloco;
using namespace std::chrono_literals;

namespace {

std::vector<nlohmann::json> events(const std::string& path, const std::string& name) {
  std::vector<nlohmann::json> out;
  for (const auto& j : testing::read_json_lines(path))
    if (j.value("event", "") == name) out.push_back(j);
  return out;
}

std::vector<std::string> learner_args(const testing::TinyRun& r, const std::string& id) {
  std::vector<std::string> args = {testing::learner_binary(), "-c", testing::tiny_config_path(), "--id", id,
                                   "--region", "r0", "--regions", "r0", "--bootstrap", r.kafka.bootstrap_servers,
                                   "--steps", "100000", "--run-dir", r.dir + "/" + id};
  args.insert(args.end(), r.sets.begin(), r.sets.end());
  return args;
}

}  // namespace

TEST_CASE("streamed checkpoints: written in segments, recovered from, joined from, replayed",
          "[merger][segments][recovery]") {
  // Tiny's fragments hold about 30k parameters: with params, momentum and the int4 downlink's
  // residual, 360 KB of values each, so 16 KiB segments make about 22 of them per checkpoint. Each
  // segment travels in 4 pieces of 4 KiB (codec.chunk_bytes), as a full-size one does (256 MiB in
  // pieces of 4 MiB): the segments of one message share its chunk id.
  testing::TinyRun r("segments", {"train.eval_every=0", "diloco.H=4", "merger.checkpoint_every=1",
                                  "codec.segment_bytes=16384", "codec.chunk_bytes=4096"});
  auto merger = testing::start_merger(r.kafka, r.dir, "M0", r.sets, "A");
  testing::ChildProcess learner(learner_args(r, "L0"), r.dir + "/L0.log");
  const std::string log_a = r.dir + "/A/metrics.jsonl";
  INFO(merger->log());
  REQUIRE(testing::eventually([&] { return events(log_a, "merge").size() >= 8; }, 120s));
  merger->signal(SIGTERM);
  REQUIRE(merger->wait_exit(60s) == std::optional<int>(0));

  // The learner's proposals of version 0 went out in segments too (120 KB of values each), and
  // the merger committed version 0 of every fragment from them.
  const auto proposals = events(r.dir + "/L0/metrics.jsonl", "genesis_proposal");
  REQUIRE(proposals.size() == 4);
  for (const auto& e : proposals) CHECK(e.at("segments").get<uint32_t>() >= 5);
  CHECK(events(log_a, "genesis").size() == 4);

  // The checkpoints went out as segments: many records per fragment, none under the bare key.
  std::map<std::string, bool> newest;
  read_to_end(r.kafka, {r.topics.state()}, [&](const ConsumedMessage& m) { newest[m.key] = !m.tombstone; }, 30000);
  for (uint32_t p = 0; p < 4; ++p) {
    INFO("fragment " << p);
    size_t records = 0;
    for (const auto& [key, value] : newest) records += value && key.rfind(std::to_string(p) + "/", 0) == 0;
    CHECK(records >= 20);
  }

  // Read back as a learner reads them: every fragment's newest version, its parameters whole.
  const auto layout = builtin_layout(r.config);
  const DecodeLimits limits = run_decode_limits(r.config, layout);
  const StateScan scan = read_states(r.kafka, r.topics, limits, 4, 60000, StateParts::ParamsOnly);
  CHECK(scan.rejected == 0);
  REQUIRE(scan.latest.size() == 4);
  uint64_t versions = 0;
  for (const auto& [p, state] : scan.latest) {
    CHECK(state.params.size() == layout.fragments[p].size());
    CHECK(checksum_fp32(state.params) == state.checksum);
    versions += state.version;
  }
  CHECK(versions >= 8);

  // A merger started again recovers every fragment from its streamed checkpoint (a version above
  // 0, nothing to replay: every merge wrote one; the older checkpoints still on the partition are
  // each let go of as the next one begins) and goes on merging; a second learner joins.
  auto again = testing::start_merger(r.kafka, r.dir, "M0", r.sets, "B");
  testing::ChildProcess joiner(learner_args(r, "L1"), r.dir + "/L1.log");
  const std::string log_b = r.dir + "/B/metrics.jsonl";
  INFO(again->log());
  REQUIRE(testing::eventually([&] { return events(log_b, "recovered").size() >= 4; }, 120s));
  for (const auto& e : events(log_b, "recovered")) {
    INFO(e.dump());
    const uint32_t p = e.at("fragment").get<uint32_t>();
    CHECK(e.at("version").get<uint64_t>() == scan.latest.at(p).version);
    CHECK(e.at("checksum").get<uint64_t>() == scan.latest.at(p).checksum);
    CHECK(e.at("checkpoint_pieces").get<uint32_t>() >= 20);
  }
  REQUIRE(testing::eventually([&] { return events(r.dir + "/L1/metrics.jsonl", "delta").size() >= 4; }, 120s));
  REQUIRE(testing::eventually([&] { return events(log_b, "merge").size() >= 8; }, 120s));
  for (auto* child : {&learner, &joiner}) {
    child->signal(SIGTERM);
    REQUIRE(child->wait_exit(60s) == std::optional<int>(0));
  }
  again->signal(SIGTERM);
  REQUIRE(again->wait_exit(60s) == std::optional<int>(0));
  // Replay reads the streamed checkpoints too, and rebuilds every version bit for bit; the audit
  // counts each streamed proposal once, at its segment 0, as version 0 of its fragment.
  testing::require_verify_pass(r.kafka, r.dir, r.sets);
  testing::require_replay_pass(r.kafka, r.dir, r.sets, "audit");
}

TEST_CASE("streamed snapshots: with an fp32 downlink every version reaches a learner in segments",
          "[merger][segments]") {
  // An fp32 downlink sends every new version as a snapshot: 120 KB of values a fragment, so 4 KiB
  // segments make about 30 ZeroMQ messages of each.
  testing::TinyRun r("segments-fp32", {"train.eval_every=0", "diloco.H=4", "codec.downlink_dtype=\"fp32\"",
                                       "codec.segment_bytes=4096"});
  auto merger = testing::start_merger(r.kafka, r.dir, "M0", r.sets, "A");
  testing::ChildProcess learner(learner_args(r, "L0"), r.dir + "/L0.log");
  const std::string log_a = r.dir + "/A/metrics.jsonl";
  const std::string log_l = r.dir + "/L0/metrics.jsonl";
  INFO(merger->log());
  REQUIRE(testing::eventually([&] { return events(log_a, "merge").size() >= 8; }, 120s));
  // The learner adopts the merged versions: each came whole out of its segments.
  REQUIRE(testing::eventually([&] { return events(log_l, "adopt").size() >= 4; }, 60s));
  learner.signal(SIGTERM);
  REQUIRE(learner.wait_exit(60s) == std::optional<int>(0));
  merger->signal(SIGTERM);
  REQUIRE(merger->wait_exit(60s) == std::optional<int>(0));
  const auto shutdown = events(log_l, "shutdown");
  REQUIRE(shutdown.size() == 1);
  INFO(shutdown.front().dump());
  CHECK(shutdown.front().at("snapshots_received").get<uint64_t>() >= 4);
  CHECK(shutdown.front().at("updates_received").get<uint64_t>() == 0);
  // Every adopted version is the merger's, bit for bit (the checksum its merge record names).
  std::map<std::pair<uint32_t, uint64_t>, uint64_t> merged;
  for (const auto& e : events(log_a, "merge"))
    merged[{e.at("fragment").get<uint32_t>(), e.at("version").get<uint64_t>()}] = e.at("checksum").get<uint64_t>();
  for (const auto& e : events(log_l, "adopt")) {
    INFO(e.dump());
    const auto it = merged.find({e.at("fragment").get<uint32_t>(), e.at("version").get<uint64_t>()});
    REQUIRE(it != merged.end());
    CHECK(e.at("checksum").get<uint64_t>() == it->second);
  }
  testing::require_verify_pass(r.kafka, r.dir, r.sets);
}
