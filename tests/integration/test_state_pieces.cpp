// A checkpoint larger than codec.chunk_bytes goes to the compacted `state` topic in pieces keyed
// "<fragment>/<index>"; compaction keeps the newest record of each key. A later checkpoint in fewer
// pieces (or whole, under "<fragment>") would leave the earlier ones' extra pieces there forever:
// the merger writes tombstones for them in the checkpoint's transaction, also when it learned the
// earlier count from its recovery. Real broker, merger restarted with another chunk size twice.
#include <catch2/catch.hpp>

#include <csignal>
#include <map>

#include "core/codec/chunk.h"
#include "core/kafka/log_reader.h"
#include "tests/integration/child_process.h"
#include "tests/integration/run_fixture.h"

using namespace diloco;
using namespace std::chrono_literals;

namespace {

size_t count_merges(const std::string& path) {
  size_t n = 0;
  for (const auto& j : testing::read_json_lines(path)) n += j.value("event", "") == "merge";
  return n;
}

// The newest record of each key of the state topic: true for a value, false for a tombstone.
std::map<std::string, bool> newest_by_key(const testing::TinyRun& r) {
  std::map<std::string, bool> out;
  read_to_end(r.kafka, {r.topics.state()}, [&](const ConsumedMessage& m) { out[m.key] = !m.tombstone; }, 30000);
  return out;
}

}  // namespace

TEST_CASE("a checkpoint in fewer pieces than the one before tombstones the keys of the pieces it leaves behind",
          "[merger][chunks][compaction]") {
  testing::TinyRun r("pieces", {"train.eval_every=0", "diloco.H=4", "merger.checkpoint_every=1"});
  auto with_chunks = [&](uint64_t bytes) {
    auto sets = r.sets;
    sets.insert(sets.end(), {"--set", "codec.chunk_bytes=" + std::to_string(bytes)});
    return sets;
  };
  std::vector<std::string> args = {testing::learner_binary(), "-c", testing::tiny_config_path(), "--id", "L0",
                                   "--region", "r0", "--regions", "r0", "--bootstrap", r.kafka.bootstrap_servers,
                                   "--steps", "100000", "--run-dir", r.dir + "/L0"};
  args.insert(args.end(), r.sets.begin(), r.sets.end());

  // Three mergers one after the other: checkpoints in 4 KiB pieces, then whole, then in 16 KiB pieces.
  const std::vector<std::pair<std::string, uint64_t>> phases = {{"A", 4096}, {"B", 1 << 20}, {"C", 16384}};
  std::unique_ptr<testing::ChildProcess> learner;
  std::map<std::string, bool> after_first;
  for (const auto& [name, chunk] : phases) {
    auto merger = testing::start_merger(r.kafka, r.dir, "M0", with_chunks(chunk), name);
    if (!learner) learner = std::make_unique<testing::ChildProcess>(args, r.dir + "/L0.log");
    const std::string log = r.dir + "/" + name + "/metrics.jsonl";
    INFO(merger->log());
    REQUIRE(testing::eventually([&] { return count_merges(log) >= 8; }, 120s));  // every fragment checkpointed again
    merger->signal(SIGTERM);
    REQUIRE(merger->wait_exit(60s) == std::optional<int>(0));
    if (after_first.empty()) after_first = newest_by_key(r);
  }
  learner->signal(SIGTERM);
  REQUIRE(learner->wait_exit(60s) == std::optional<int>(0));

  // The first checkpoints were in pieces: many keys per fragment.
  const size_t first_pieces = after_first.count("0/0") ? after_first.size() : 0;
  REQUIRE(first_pieces > 4 * 8);
  const auto newest = newest_by_key(r);
  for (uint32_t p = 0; p < 4; ++p) {
    INFO("fragment " << p);
    const std::string whole = std::to_string(p);
    // The last checkpoint is in pieces again: the whole one of the second merger is tombstoned...
    REQUIRE(newest.count(whole));
    CHECK_FALSE(newest.at(whole));
    // ...its own pieces are values, and the first merger's pieces beyond them tombstones.
    size_t values = 0, tombstones = 0;
    for (const auto& [key, value] : newest) {
      if (key.rfind(whole + "/", 0) != 0) continue;
      const size_t index = std::stoul(key.substr(whole.size() + 1));
      if (value) {
        ++values;
      } else {
        ++tombstones;
        CHECK(index >= 1);
      }
    }
    CHECK(values >= 2);
    CHECK(tombstones >= 1);
    for (size_t i = 0; i < values; ++i) CHECK(newest.at(whole + "/" + std::to_string(i)));
    for (size_t i = values; i < values + tombstones; ++i) CHECK_FALSE(newest.at(whole + "/" + std::to_string(i)));
  }
  // The logs still rebuild every version (the tombstones are not checkpoints).
  testing::require_verify_pass(r.kafka, r.dir, r.sets);
}
