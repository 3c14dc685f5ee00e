// diloco-replay on a real run: three tiny learners and a merger that is killed with SIGKILL and
// replaced. The real binary, run as a child process, verifies every version, rebuilds the final
// model bit for bit as the live mergers committed it (their merge records' checksums), lists a
// corrupted delta as rejected without crashing anything, and re-merges the run with its own
// settings to exactly its final checksums. Expected values come from the logs, read here.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>

#include "core/files/safetensors.h"
#include "core/fragments/message_budget.h"
#include "core/kafka/consumer.h"
#include "core/kafka/log_reader.h"
#include "core/kafka/producer.h"
#include "tests/integration/child_process.h"
#include "tests/integration/run_fixture.h"
#include "tests/tensor_bits.h"

using namespace diloco;
using namespace std::chrono_literals;

namespace {

std::string replay_binary() { return DILOCO_BINARY_DIR "/bin/diloco-replay"; }

struct Outcome {
  int code = -1;
  std::string output;  // stdout and stderr together
  // The JSON documents among the output lines (progress lines are plain text).
  std::vector<nlohmann::json> json() const {
    std::vector<nlohmann::json> out;
    std::istringstream in(output);
    for (std::string line; std::getline(in, line);)
      if (!line.empty() && line[0] == '{') out.push_back(nlohmann::json::parse(line));
    return out;
  }
};

// Runs diloco-replay with the common options first; fails the test if it does not exit in time.
Outcome run_replay(const std::string& dir, std::vector<std::string> common, const std::vector<std::string>& args) {
  static int n = 0;
  std::vector<std::string> argv = {replay_binary()};
  argv.insert(argv.end(), common.begin(), common.end());
  argv.insert(argv.end(), args.begin(), args.end());
  testing::ChildProcess p(argv, dir + "/replay-" + std::to_string(++n) + ".log");
  auto code = p.wait_exit(120s);
  INFO("diloco-replay " << args.front() << ":\n" << p.log());
  REQUIRE(code.has_value());
  return Outcome{*code, p.log()};
}

struct LoggedRun {
  std::map<uint32_t, MergeRecord> last_merge;        // per fragment, the newest version
  std::map<uint32_t, std::vector<MergeRecord>> merges;  // per fragment, records with inputs
  size_t deltas = 0;                                 // messages in the delta topics
};

LoggedRun read_logs(const KafkaOptions& kafka, const RunConfig& config, const RunTopics& topics,
                    const std::vector<std::string>& regions) {
  const FragmentLayout layout = builtin_layout(config);
  const DecodeLimits limits = run_decode_limits(config, layout);
  LoggedRun out;
  read_to_end(kafka, {topics.merges()}, [&](const ConsumedMessage& m) {
    MergeRecord r = decode_merge_record(m.value, limits);
    if (!is_merge(r)) return;
    if (!out.last_merge.count(r.fragment) || r.version > out.last_merge[r.fragment].version) out.last_merge[r.fragment] = r;
    out.merges[r.fragment].push_back(r);
  }, 60000);
  std::vector<std::string> delta_topics;
  for (const auto& r : regions) delta_topics.push_back(topics.deltas(r));
  read_to_end(kafka, delta_topics, [&](const ConsumedMessage&) { ++out.deltas; }, 60000);
  return out;
}

// A safetensors file's tensors of one fragment, by name, in layout order.
std::vector<DenseTensor> file_tensors(const std::string& path, const std::vector<TensorSpec>& layout) {
  const SafetensorsFile file = load_safetensors(path);
  std::vector<DenseTensor> out;
  for (uint32_t i = 0; i < layout.size(); ++i) {
    auto it = std::find_if(file.tensors.begin(), file.tensors.end(), [&](const NamedTensor& t) { return t.name == layout[i].name; });
    REQUIRE(it != file.tensors.end());
    REQUIRE(it->shape == layout[i].shape);
    out.push_back(DenseTensor{i, it->shape, it->values});
  }
  return out;
}


std::unique_ptr<testing::ChildProcess> start(const std::string& dir, const std::string& id, std::vector<std::string> args) {
  args.insert(args.begin() + 1, {"-c", testing::tiny_config_path(), "--id", id, "--run-dir", dir + "/" + id});
  return std::make_unique<testing::ChildProcess>(args, dir + "/" + id + ".log");
}

size_t merge_events(const std::string& dir, const std::string& id) {
  size_t n = 0;
  for (const auto& j : testing::read_json_lines(dir + "/" + id + "/metrics.jsonl")) n += j.value("event", "") == "merge";
  return n;
}

// Events of the newest process writing the instance's metrics file: those after its last "start"
// (a replacement appends to its predecessor's file).
size_t events_since_start(const std::string& dir, const std::string& id, const std::string& event) {
  size_t n = 0;
  for (const auto& j : testing::read_json_lines(dir + "/" + id + "/metrics.jsonl")) {
    const std::string e = j.value("event", "");
    if (e == "start") n = 0;
    n += e == event;
  }
  return n;
}

// Exit code 0 within `limit`, or the process's log in the failure.
void require_exit(testing::ChildProcess& p, std::chrono::seconds limit) {
  const std::optional<int> code = p.wait_exit(limit);
  INFO(p.log());
  REQUIRE(code == std::optional<int>(0));
}

}  // namespace

TEST_CASE("diloco-replay verifies, rebuilds, lists and re-merges a run whose merger was killed", "[replay]") {
  KafkaOptions kafka = testing::require_broker();
  const std::string run = testing::unique_run_id("replay");
  const std::vector<std::string> regions = {"r0", "r1"};
  RunTopics topics = testing::create_run(kafka, run, regions, 2);
  const std::string dir = testing::temp_dir("replay");
  // Sparse deltas and sparse updates (top-k with error feedback both ways, as configs/demo.toml
  // sends deltas): the merge record names the downlink's top-k, and every version must rebuild
  // from it bit for bit, through a recovery, verify and remerge.
  const std::vector<std::string> sets = {"train.eval_every=0",        "merger.checkpoint_every=3",
                                         "codec.block_size=1024",     "codec.topk=96",
                                         "codec.downlink_block_size=1024", "codec.downlink_topk=256",
                                         "merger.optimizer=sgd",      "merger.outer_lr=2.0"};
  RunConfig config = testing::tiny_config(run, sets);
  std::vector<std::string> set_args = {"--set", "run.id=\"" + run + "\""};
  for (const auto& s : sets) set_args.insert(set_args.end(), {"--set", s});
  auto merger = [&] {
    std::vector<std::string> args = {testing::merger_binary(), "--bootstrap", kafka.bootstrap_servers,
                                     "--session-timeout-ms", "6000"};
    args.insert(args.end(), set_args.begin(), set_args.end());
    return start(dir, "M0", args);
  };

  // The run: a merger killed mid-run and replaced; the learners train to the end.
  auto first = merger();
  std::vector<std::unique_ptr<testing::ChildProcess>> learners;
  for (int i = 0; i < 3; ++i) {
    std::vector<std::string> args = {testing::learner_binary(), "--index", std::to_string(i), "--learners", "3",
                                     "--region", regions[static_cast<size_t>(i) % 2], "--regions", "r0,r1",
                                     "--bootstrap", kafka.bootstrap_servers, "--steps", "240", "--log-every", "20"};
    args.insert(args.end(), set_args.begin(), set_args.end());
    learners.push_back(start(dir, "L" + std::to_string(i), args));
  }
  bool merging = testing::eventually([&] { return merge_events(dir, "M0") >= 8; }, 150s);
  INFO(first->log());
  REQUIRE(merging);
  first->signal(SIGKILL);
  REQUIRE(first->wait_exit(10s).has_value());
  auto second = merger();
  for (auto& l : learners) require_exit(*l, 180s);
  // The replacement's own recovery (the killed merger's open transaction is aborted by the broker
  // first), then its merges of what the learners sent after the kill, until none comes for 5 s.
  // Stopped earlier, it would leave those deltas pending, and the final model would be the one of
  // the first few merges (a fast machine finishes the learners before the replacement recovers).
  REQUIRE(testing::eventually([&] { return events_since_start(dir, "M0", "recovered") > 0; }, 90s));
  {
    size_t seen = 0;
    auto changed = std::chrono::steady_clock::now();
    testing::eventually(
        [&] {
          const size_t n = merge_events(dir, "M0");
          if (n != seen) seen = n, changed = std::chrono::steady_clock::now();
          return std::chrono::steady_clock::now() - changed > 5s;
        },
        120s);
  }
  INFO(second->log());
  CHECK(events_since_start(dir, "M0", "merge") > 0);
  second->signal(SIGTERM);
  require_exit(*second, 60s);

  // Two corrupted deltas from a plain producer: garbage, and a real delta cut in half.
  const LoggedRun logged = read_logs(kafka, config, topics, regions);
  REQUIRE(logged.last_merge.size() == 4);
  std::vector<uint8_t> garbage = {'n', 'o', 't', ' ', 'a', ' ', 'd', 'e', 'l', 't', 'a'};
  std::vector<ConsumedMessage> real = fetch_positions(kafka, {{topics.deltas("r1"), 1, 0}}, 30000);
  REQUIRE(real.size() == 1);
  std::vector<uint8_t> truncated(real[0].value.begin(), real[0].value.begin() + static_cast<std::ptrdiff_t>(real[0].value.size() / 2));
  std::map<uint64_t, LogPosition> injected;
  {
    Producer producer({.kafka = kafka}, [&](const DeliveryReport& r) {
      if (r.ok) injected[r.token] = LogPosition{r.topic, r.partition, r.offset};
    });
    producer.produce({.topic = topics.deltas("r0"), .partition = 0, .key = "0", .value = garbage,
                      .headers = {{"learner", "intruder"}, {"fragment", "0"}}}, 1, 10000);
    producer.produce({.topic = topics.deltas("r1"), .partition = 1, .key = "1", .value = truncated}, 2, 10000);
    REQUIRE(producer.flush(20000) == 0);
  }
  REQUIRE(injected.size() == 2);

  const std::vector<std::string> common = {"-c", testing::tiny_config_path(), "--run", run, "--bootstrap",
                                           kafka.bootstrap_servers, "--set", sets[0], "--set", sets[1]};
  const FragmentLayout layout = builtin_layout(config);
  size_t merge_records = 0;
  for (const auto& [p, records] : logged.merges) merge_records += records.size();

  {
    // verify: every merge record of every fragment is rebuilt and checked.
    Outcome verify = run_replay(dir, common, {"verify"});
    INFO(verify.output);
    CHECK(verify.code == 0);
    CHECK(verify.output.find("PASS") != std::string::npos);
    CHECK(verify.output.find("verified 4 fragments: " + std::to_string(merge_records) + " merge records") !=
          std::string::npos);
  }
  {
    // rebuild at the final version: every fragment at its newest version, as the mergers committed it.
    uint64_t final_version = 0;
    for (const auto& [p, r] : logged.last_merge) final_version = std::max(final_version, r.version);
    const std::string file = dir + "/final.safetensors";
    Outcome rebuilt = run_replay(dir, common, {"rebuild", "--version", std::to_string(final_version), "--out", file});
    INFO(rebuilt.output);
    REQUIRE(rebuilt.code == 0);
    for (uint32_t p = 0; p < 4; ++p) {
      auto tensors = file_tensors(file, layout.fragments[p]);
      CHECK(checksum_fp32(tensors) == logged.last_merge.at(p).checksum);
    }
    // One fragment at a middle version, which no checkpoint holds (checkpoint_every = 3).
    const MergeRecord& middle = logged.merges.at(1).at(1);
    REQUIRE(middle.version % 3 != 0);
    const std::string part = dir + "/fragment1.safetensors";
    Outcome one = run_replay(dir, common, {"rebuild", "--version", std::to_string(middle.version), "--fragment", "1", "--out", part});
    REQUIRE(one.code == 0);
    CHECK(checksum_fp32(file_tensors(part, layout.fragments[1])) == middle.checksum);

    Outcome missing = run_replay(dir, common, {"rebuild", "--version", "100000", "--out", dir + "/none.safetensors"});
    CHECK(missing.code == 2);
    CHECK(missing.output.find("does not exist") != std::string::npos);
  }
  {
    // list: every delta with its fate; the corrupted ones rejected with their reasons.
    Outcome listed = run_replay(dir, common, {"list", "--json"});
    REQUIRE(listed.code == 0);
    std::map<std::tuple<std::string, int32_t, int64_t>, nlohmann::json> rows;
    for (auto& row : listed.json()) rows[{row["topic"], row["partition"], row["offset"]}] = row;
    CHECK(rows.size() == logged.deltas + 2);
    const LogPosition& bad = injected.at(1);
    const LogPosition& cut = injected.at(2);
    REQUIRE(rows.count({bad.topic, bad.partition, bad.offset}));
    const auto& bad_row = rows[{bad.topic, bad.partition, bad.offset}];
    CHECK(bad_row["fate"] == "rejected");
    CHECK(bad_row["reason"] == reject_reason_name(RejectReason::NotZstd));
    CHECK(bad_row["learner"] == "intruder");
    REQUIRE(rows.count({cut.topic, cut.partition, cut.offset}));
    CHECK(rows[{cut.topic, cut.partition, cut.offset}]["fate"] == "rejected");
    CHECK(!rows[{cut.topic, cut.partition, cut.offset}]["reason"].get<std::string>().empty());
    size_t merged = 0;
    for (const auto& [p, records] : logged.merges)
      for (const auto& r : records)
        for (const auto& in : r.inputs) {
          auto it = rows.find({in.position.topic, in.position.partition, in.position.offset});
          REQUIRE(it != rows.end());
          CHECK(it->second["fate"] == "merged");
          CHECK(it->second["version"] == r.version);
          CHECK(it->second["learner"] == in.learner_id);
          ++merged;
        }
    CHECK(merged > 0);

    Outcome table = run_replay(dir, common, {"list", "--topic", "r0", "--partition", "0"});
    CHECK(table.code == 0);
    CHECK(table.output.find("rejected not_zstd") != std::string::npos);

    Outcome shown = run_replay(dir, common, {"show", "--topic", "r0", "--partition", "0", "--offset", std::to_string(bad.offset)});
    CHECK(shown.code == 0);
    CHECK(shown.output.find("\"fate\": \"rejected\"") != std::string::npos);
    Outcome dumped = run_replay(dir, common, {"dump", "--topic", "r0", "--partition", "0", "--offset", std::to_string(bad.offset),
                                              "--out", dir + "/bad.safetensors"});
    CHECK(dumped.code == 2);
    CHECK(dumped.output.find("rejected") != std::string::npos);
  }
  {
    // show and dump of a real delta: the tensors are the decoded delta's, bit for bit.
    Delta delta = decode_delta(real[0].value, run_decode_limits(config, layout));
    const auto& specs = layout.fragments[delta.header.fragment];
    Outcome shown = run_replay(dir, common, {"show", "--topic", topics.deltas("r1"), "--partition", "1", "--offset", "0"});
    REQUIRE(shown.code == 0);
    CHECK(shown.output.find("\"name\": \"" + specs[0].name + "\"") != std::string::npos);
    CHECK(shown.output.find("\"learner\": \"" + delta.header.learner_id + "\"") != std::string::npos);
    const std::string file = dir + "/delta.safetensors";
    Outcome dumped = run_replay(dir, common, {"dump", "--topic", "r1", "--partition", "1", "--offset", "0", "--out", file});
    REQUIRE(dumped.code == 0);
    CHECK(testing::same_bits(file_tensors(file, specs), delta.tensors));
    Outcome merge = run_replay(dir, common, {"show", "--merge", "--partition", "0", "--offset", "0"});
    CHECK(merge.code == 0);
    CHECK(merge.output.find("\"prev_version\": 0") != std::string::npos);
  }
  {
    // verify is not disturbed by the corrupted deltas (no record names them).
    Outcome verify = run_replay(dir, common, {"verify"});
    CHECK(verify.code == 0);
  }
  {
    // remerge with the run's settings reproduces every final checksum, in its report and in the
    // model it writes; other settings do not.
    const std::string file = dir + "/remerged.safetensors";
    Outcome same = run_replay(dir, common, {"remerge", "--rule", "rda", "--alpha", "0", "--quorum", "1", "--outer-lr",
                                            "2.0", "--momentum", "0.9", "--optimizer", "sgd", "--json", "--out", file});
    REQUIRE(same.code == 0);
    auto docs = same.json();
    REQUIRE(docs.size() == 1);
    const auto& report = docs[0];
    CHECK(report["grouping"] == "recorded");
    REQUIRE(report["fragments"].size() == 4);
    for (const auto& f : report["fragments"]) {
      const MergeRecord& last = logged.last_merge.at(f["fragment"].get<uint32_t>());
      CHECK(f["version"] == last.version);
      CHECK(f["checksum"] == last.checksum);
      CHECK(f["identical"] == true);
    }
    for (uint32_t p = 0; p < 4; ++p) CHECK(checksum_fp32(file_tensors(file, layout.fragments[p])) == logged.last_merge.at(p).checksum);

    Outcome avg = run_replay(dir, common, {"remerge", "--rule", "avg", "--quorum", "2", "--json"});
    REQUIRE(avg.code == 0);
    auto other = avg.json();
    REQUIRE(other.size() == 1);
    CHECK(other[0]["grouping"] == "regrouped");
    size_t differ = 0;
    for (const auto& f : other[0]["fragments"])
      differ += f["checksum"] != logged.last_merge.at(f["fragment"].get<uint32_t>()).checksum;
    CHECK(differ == 4);
  }
  {
    // A forged merge record (a plain producer's write is committed too) whose checksum is not
    // what its inputs give: verify names it and exits 1.
    MergeRecord forged = logged.last_merge.at(0);
    forged.prev_version = forged.version;
    forged.version += 1;
    for (auto& in : forged.inputs) in.staleness += 1;
    forged.checksum ^= 1;
    auto bytes = encode_merge_record(forged);
    LogPosition at;
    Producer producer({.kafka = kafka}, [&](const DeliveryReport& r) { at = {r.topic, r.partition, r.offset}; });
    producer.produce({.topic = topics.merges(), .partition = 0, .key = "0", .value = bytes}, 1, 10000);
    REQUIRE(producer.flush(20000) == 0);
    Outcome verify = run_replay(dir, common, {"verify"});
    INFO(verify.output);
    CHECK(verify.code == 1);
    CHECK(verify.output.find("MISMATCH fragment 0: rebuilding version " + std::to_string(forged.version)) != std::string::npos);
    CHECK(verify.output.find(topics.merges() + "[0]@" + std::to_string(at.offset)) != std::string::npos);
  }
  {
    // A checkpoint whose downlink residual is off (parameters, momentum and outer state as they
    // should be): a merger restarted from it would add the wrong residual to its next update and
    // make other versions from then on, so verify names it and exits 1.
    const DecodeLimits limits = run_decode_limits(config, layout);
    std::optional<FragmentState> newest;
    read_to_end(kafka, {topics.state()}, [&](const ConsumedMessage& m) {
      if (m.tombstone) return;
      FragmentState s = decode_fragment_state(m.value, limits);
      if (s.version > 0 && !s.downlink_residual.empty() && (!newest || s.version > newest->version)) newest = std::move(s);
    }, 30000);
    REQUIRE(newest.has_value());
    newest->downlink_residual.at(0).values.at(0) += 1e-3f;
    newest->layout = std::make_shared<const FragmentLayout>(layout);
    Producer producer({.kafka = kafka}, nullptr);
    producer.produce({.topic = topics.state(), .partition = static_cast<int32_t>(newest->fragment % 2),
                      .key = std::to_string(newest->fragment), .value = encode_fragment_state(*newest)},
                     1, 10000);
    REQUIRE(producer.flush(20000) == 0);
    Outcome verify = run_replay(dir, common, {"verify"});
    INFO(verify.output);
    CHECK(verify.code == 1);
    CHECK(verify.output.find("checkpoint at " + topics.state()) != std::string::npos);
    CHECK(verify.output.find("of version " + std::to_string(newest->version) + " has checksum") != std::string::npos);
    CHECK(verify.output.find("downlink residual") != std::string::npos);
  }
}

TEST_CASE("diloco-replay names a missing run or an absent broker and exits 2", "[replay]") {
  KafkaOptions kafka = testing::require_broker();
  const std::string dir = testing::temp_dir("replay-errors");
  const std::string run = testing::unique_run_id("no-such-run");
  Outcome missing = run_replay(dir, {"-c", testing::tiny_config_path(), "--bootstrap", kafka.bootstrap_servers}, {"verify", "--run", run});
  CHECK(missing.code == 2);
  CHECK(missing.output.find("run " + run + " not found") != std::string::npos);
  Outcome no_broker = run_replay(dir, {"-c", testing::tiny_config_path(), "--bootstrap", "127.0.0.1:1", "--connect-timeout", "2"},
                                 {"list"});
  CHECK(no_broker.code == 2);
  CHECK(no_broker.output.find("no Kafka broker answered") != std::string::npos);
  Outcome usage = run_replay(dir, {"-c", testing::tiny_config_path()}, {"rebuild", "--out", dir + "/x.safetensors"});
  CHECK(usage.code == 2);
}
