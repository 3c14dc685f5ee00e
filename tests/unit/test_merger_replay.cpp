// The merger's pure parts together, as the driver will use them: learners' deltas go through the
// FragmentMerger and merge_step for several versions; then every version is rebuilt bit for bit
// from the genesis state (and from a checkpoint) using only the merge records and the deltas they
// name by position, and every delta is accounted for exactly once.
#include <catch2/catch.hpp>

#include <cstring>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "core/codec/messages.h"
#include "merger/fragment_merger.h"
#include "merger/merge_step.h"
#include "merger/recovery.h"
#include "merger/outer_optimizer.h"
#include "merger/weighting.h"

using namespace diloco;

namespace {

const std::vector<TensorSpec> kLayout{{"token_embedding", {3, 4}}, {"blocks.0.w", {4, 5}},
                                      {"head", {7}}};

std::vector<DenseTensor> random_tensors(std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<DenseTensor> out;
  for (uint32_t t = 0; t < kLayout.size(); ++t) {
    DenseTensor tensor{t, kLayout[t].shape, std::vector<float>(kLayout[t].numel())};
    for (auto& v : tensor.values) v = dist(rng);
    out.push_back(std::move(tensor));
  }
  return out;
}

bool same_bits(const std::vector<DenseTensor>& a, const std::vector<DenseTensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t t = 0; t < a.size(); ++t)
    if (a[t].values.size() != b[t].values.size() ||
        std::memcmp(a[t].values.data(), b[t].values.data(), a[t].values.size() * 4) != 0)
      return false;
  return true;
}

// Version 0 of fragment 1 of run "run": random parameters, zero momentum.
FragmentState genesis_state(std::mt19937& rng) {
  FragmentState genesis;
  genesis.run_id = "run";
  genesis.fingerprint = 7;
  genesis.fragment = 1;
  genesis.params = random_tensors(rng, 1.0f);
  genesis.momentum = initial_momentum(genesis.params);
  return genesis;
}

using Key = std::tuple<std::string, int32_t, int64_t>;
Key key(const LogPosition& p) { return {p.topic, p.partition, p.offset}; }

struct Log {
  std::map<Key, std::vector<DenseTensor>> deltas;  // the delta topics, by position
  std::vector<MergeRecord> records;                 // the merges topic
};

// Rebuilds the state at the version after `records` from `start`, reading deltas from the log.
FragmentState rebuild(FragmentState start, const Log& log, size_t first_record,
                      const MergeOptions& options, std::vector<uint64_t>& checksums) {
  FragmentState next;
  for (size_t r = first_record; r < log.records.size(); ++r) {
    const MergeRecord& record = log.records[r];
    REQUIRE(record.prev_version == start.version);
    std::vector<MergeInput> inputs;
    for (const auto& ref : record.inputs) inputs.push_back({ref, log.deltas.at(key(ref.position))});
    MergeOptions o = options;
    o.rule = record.rule;
    o.optimizer = record.optimizer;
    o.hyper = record.hyper;
    o.share = record.share;
    o.staleness_scale = record.staleness_scale;
    merge_step(start, inputs, o, next);
    checksums.push_back(next.checksum);
    std::swap(start, next);
  }
  return start;
}

}  // namespace

TEST_CASE("every version is rebuilt bit for bit from the logged merges", "[merger]") {
  std::mt19937 rng(2024);
  MergeOptions options;
  options.hyper.quorum = 2;
  options.hyper.max_staleness = 2;
  options.hyper.staleness_alpha = 0.5f;
  options.tensors = kLayout;

  FragmentState genesis = genesis_state(rng);

  // How often each learner sends a delta and adopts the newest version: a and b keep up, c
  // sends twice from some bases (the second time is superseded), d is always too stale.
  struct Habit {
    int send_every, send_phase, adopt_every;
  };
  const std::map<std::string, Habit> habits{
      {"a", {1, 0, 1}}, {"b", {1, 0, 1}}, {"c", {3, 0, 6}}, {"d", {5, 4, 5}}};
  const std::vector<std::string> learners{"a", "b", "c", "d"};
  std::map<std::string, uint64_t> base, seq;
  Log log;
  std::set<Key> offered;
  std::map<uint64_t, FragmentState> live_states{{0, genesis}};
  std::vector<uint64_t> live_checksums;

  FragmentState state = genesis, next;
  FragmentMerger merger(1, 0, options.hyper, 0.0);
  const GraceWindow no_grace;
  int64_t offset = 0;
  double now = 0;
  for (int round = 0; round < 12; ++round) {
    for (const auto& learner : learners) {
      const Habit& habit = habits.at(learner);
      if (round % habit.send_every != habit.send_phase) continue;
      for (int repeat = 0; repeat < 1 + (round % 2); ++repeat) {
        DeltaRef ref;
        ref.position = {"diloco.run.deltas." + std::string(learner < "c" ? "eu" : "us"), 0,
                        offset++};
        ref.learner_id = learner;
        ref.seq = ++seq[learner];
        ref.base_version = base[learner];
        ref.inner_steps = 10;
        ref.tokens = learner == "b" ? 640 : 320;
        auto tensors = random_tensors(rng, 0.01f);
        log.deltas[key(ref.position)] = tensors;
        offered.insert(key(ref.position));
        merger.offer(ref, std::move(tensors), now += 0.1);
      }
    }
    if (!merger.poll(now, learners, no_grace)) continue;
    MergePlan plan = merger.take_merge_inputs(now);
    MergeRecord record = merge_step(state, plan.inputs, options, next);
    record.dropped = std::move(plan.dropped);
    log.records.push_back(record);
    merger.merge_committed(next.version);
    merger.published(now += 0.05);
    std::swap(state, next);
    live_states[state.version] = state;
    live_checksums.push_back(state.checksum);
    for (const auto& [learner, habit] : habits)
      if (round % habit.adopt_every == 0) base[learner] = state.version;
  }
  REQUIRE(log.records.size() >= 8);
  const auto stopped = merger.stop();

  SECTION("from genesis") {
    std::vector<uint64_t> checksums;
    const FragmentState rebuilt = rebuild(genesis, log, 0, options, checksums);
    CHECK(checksums == live_checksums);
    CHECK(rebuilt.version == state.version);
    CHECK(same_bits(rebuilt.params, state.params));
    CHECK(same_bits(rebuilt.momentum, state.momentum));
    for (size_t r = 0; r < log.records.size(); ++r) CHECK(checksums[r] == log.records[r].checksum);
  }

  SECTION("from a checkpoint") {
    const uint64_t checkpoint = 4;
    std::vector<uint64_t> checksums;
    const FragmentState rebuilt =
        rebuild(live_states.at(checkpoint), log, checkpoint, options, checksums);
    CHECK(same_bits(rebuilt.params, state.params));
    CHECK(same_bits(rebuilt.momentum, state.momentum));
    CHECK(checksums.back() == state.checksum);
  }

  SECTION("every delta is merged once or dropped once") {
    std::map<Key, int> seen;
    for (const auto& record : log.records) {
      for (const auto& ref : record.inputs) ++seen[key(ref.position)];
      for (const auto& d : record.dropped) ++seen[key(d.delta.position)];
    }
    for (const auto& d : stopped) ++seen[key(d.delta.position)];
    CHECK(seen.size() == offered.size());
    for (const auto& k : offered) CHECK(seen[k] == 1);
    size_t stale = 0, superseded = 0;
    for (const auto& record : log.records)
      for (const auto& d : record.dropped) {
        stale += d.reason == DropReason::TooStale;
        superseded += d.reason == DropReason::Superseded;
      }
    CHECK(stale > 0);       // the scenario exercises both kinds of drops
    CHECK(superseded > 0);
  }

  SECTION("a recovered merger carries on from the log") {
    // Recovery: the bookkeeping of every record (kept in checkpoints, rebuilt after them).
    FragmentState bookkeeping;
    for (const auto& record : log.records) account(bookkeeping, record);
    FragmentMerger recovered(1, log.records.back().version, options.hyper, 100.0, bookkeeping.merged_bases);
    CHECK(recovered.version() == state.version);
    // Re-reading the last merged delta of a learner does not merge it again.
    const DeltaRef again = log.records.back().inputs.front();
    const auto dropped = recovered.offer(again, log.deltas.at(key(again.position)), 100.1);
    REQUIRE(dropped);
    CHECK(dropped->reason == DropReason::Superseded);
  }
}

TEST_CASE("delayed Nesterov and CGAD states are rebuilt bit for bit from a checkpoint and the records",
          "[merger]") {
  const auto kind = GENERATE(OuterOptimizerKind::DelayedNesterov, OuterOptimizerKind::Cgad);
  INFO(outer_optimizer_name(kind));
  std::mt19937 rng(77);
  MergeOptions options;
  options.optimizer = kind;
  options.hyper.lr = kind == OuterOptimizerKind::Cgad ? 0.01f : 0.4f;
  options.hyper.momentum = 0.5f;
  options.hyper.staleness_alpha = 0.5f;
  options.hyper.dn_period = 3;
  options.hyper.dn_activation = 0.2f;
  options.hyper.cgad_cutoff = 4;
  options.tensors = kLayout;
  auto layout = std::make_shared<FragmentLayout>(FragmentLayout{.fragments = {{}, kLayout}, .fingerprint = 7});
  const DecodeLimits limits{.run_id = "run", .fingerprint = 7, .layout = layout.get()};

  FragmentState genesis = genesis_state(rng);
  genesis.outer_state = initial_momentum(genesis.params);

  // Ten merges of one or two of three learners, on bases up to three versions old; every record
  // and every state goes through the codec as the logs would hold them.
  Log log;
  std::map<uint64_t, FragmentState> states{{0, genesis}};
  FragmentState state = genesis, next;
  int64_t offset = 0;
  for (int m = 0; m < 10; ++m) {
    std::vector<DeltaRef> refs;
    for (int i = 0; i < 1 + m % 2; ++i) {
      DeltaRef ref;
      ref.position = {"diloco.run.deltas.eu", 0, offset++};
      ref.learner_id = std::string(1, static_cast<char>('a' + (m + i) % 3));
      ref.seq = static_cast<uint64_t>(offset);
      ref.base_version = state.version - std::min<uint64_t>(state.version, static_cast<uint64_t>((m + i) % 4));
      ref.inner_steps = 10;
      ref.tokens = 320 + 64 * static_cast<uint64_t>(i);
      weigh(ref, state.version, options.hyper);
      log.deltas[key(ref.position)] = random_tensors(rng, 0.01f);
      refs.push_back(ref);
    }
    std::vector<MergeInput> inputs;
    for (const auto& ref : refs) inputs.push_back({ref, log.deltas.at(key(ref.position))});
    set_merge_share(options, inputs, 3, true);
    MergeRecord record = merge_step(state, inputs, options, next);
    record.merger_instance = "merger";
    log.records.push_back(decode_merge_record(encode_merge_record(record), limits));
    std::swap(state, next);
    state.layout = layout;  // a checkpoint carries the run's layout
    states[state.version] = decode_fragment_state(encode_fragment_state(state), limits);
  }
  REQUIRE(state.outer_state.size() == kLayout.size());
  CHECK(log.records[1].staleness_scale < 1.0f);  // an input one version old

  for (uint64_t checkpoint : {0, 4, 5, 8}) {
    INFO("checkpoint " << checkpoint);
    std::vector<uint64_t> checksums;
    const FragmentState rebuilt = rebuild(states.at(checkpoint), log, checkpoint, MergeOptions{.tensors = kLayout}, checksums);
    CHECK(rebuilt.version == state.version);
    CHECK(same_bits(rebuilt.params, state.params));
    CHECK(same_bits(rebuilt.momentum, state.momentum));
    CHECK(same_bits(rebuilt.outer_state, state.outer_state));
    for (size_t r = 0; r < checksums.size(); ++r) CHECK(checksums[r] == log.records[checkpoint + r].checksum);
  }

  // An older checkpoint without the buffer rebuilds from zeros: the same as genesis's zeros.
  FragmentState old_genesis = genesis;
  old_genesis.outer_state.clear();
  std::vector<uint64_t> checksums;
  const FragmentState from_old = rebuild(old_genesis, log, 0, MergeOptions{.tensors = kLayout}, checksums);
  CHECK(same_bits(from_old.outer_state, state.outer_state));
  CHECK(from_old.checksum == state.checksum);
}

TEST_CASE("a genesis record accounts for its proposal's position and for no learner's deltas", "[merger][genesis]") {
  MergeRecord genesis{.run_id = "run", .fingerprint = 7, .fragment = 1, .version = 0, .prev_version = 0,
                      .inputs = {DeltaRef{.position = {"diloco.run.genesis", 1, 4}, .learner_id = "a", .seq = 99}},
                      .genesis = true};
  FragmentState state;
  account(state, genesis);
  CHECK(state.recent == std::set<LogPosition>{{"diloco.run.genesis", 1, 4}});
  // Learner a's deltas on version 0 are still to come: neither its seq nor a merged base is taken.
  CHECK(state.accounted.empty());
  CHECK(state.merged_bases.empty());
  CHECK_FALSE(is_merge(genesis));
}

// An independent reference: two merges of one 2-value tensor worked out by hand, made on the live
// path (FragmentMerger, merge_step) and rebuilt from the records; both must give the hand values.
TEST_CASE("two merges match values worked out by hand, live and rebuilt from the records", "[merger]") {
  const std::vector<TensorSpec> layout{{"blocks.0.w", {2}}};
  FragmentState genesis;
  genesis.run_id = "run";
  genesis.fingerprint = 7;
  genesis.fragment = 0;
  genesis.params = {{0, {2}, {1.0f, 2.0f}}};
  genesis.momentum = initial_momentum(genesis.params);
  MergeOptions options;
  options.rule = MergeRule::WeightedAverage;
  options.optimizer = OuterOptimizerKind::Nesterov;
  options.hyper.lr = 0.5f;
  options.hyper.momentum = 0.5f;
  options.hyper.quorum = 2;
  options.hyper.max_staleness = kUnlimitedStaleness;
  options.tensors = layout;

  auto ref = [](const std::string& learner, uint64_t seq, uint64_t base, int64_t offset, uint64_t tokens) {
    DeltaRef r;
    r.position = {"diloco.run.deltas.r0", 0, offset};
    r.learner_id = learner;
    r.seq = seq;
    r.base_version = base;
    r.inner_steps = 10;
    r.tokens = tokens;
    return r;
  };
  Log log;
  FragmentState state = genesis, next;
  FragmentMerger merger(0, 0, options.hyper, 0.0);
  const GraceWindow no_grace;
  auto offer = [&](DeltaRef r, std::vector<float> d) {
    std::vector<DenseTensor> delta{{0, {2}, std::move(d)}};
    log.deltas[key(r.position)] = delta;
    REQUIRE_FALSE(merger.offer(r, DeltaTensors(std::move(delta)), 0.0));
  };
  auto merge = [&] {
    REQUIRE(merger.poll(1.0, {}, no_grace));
    MergePlan plan = merger.take_merge_inputs(1.0);
    MergeRecord record = merge_step(state, plan.inputs, options, next);
    std::swap(state, next);
    merger.merge_committed(state.version);
    merger.published(1.0);
    log.records.push_back(record);
  };
  // Version 1: a (100 tokens in 10 steps: weight 100 x 10 = 1000) sends (0.5, -0.5); b (300
  // tokens: weight 300 x 30 = 9000) sends (0.1, 0.1). Weighted average g = (0.14, 0.04).
  // Nesterov from zero momentum: buf = g; theta -= 0.5 * (g + 0.5 * buf) = 0.75 g:
  // theta = (1 - 0.105, 2 - 0.03) = (0.895, 1.97).
  offer(ref("a", 1, 0, 0, 100), {0.5f, -0.5f});
  offer(ref("b", 1, 0, 1, 300), {0.1f, 0.1f});
  merge();
  REQUIRE(state.version == 1);
  CHECK(state.params[0].values[0] == Approx(0.895).epsilon(1e-6));
  CHECK(state.params[0].values[1] == Approx(1.97).epsilon(1e-6));
  CHECK(state.momentum[0].values[0] == Approx(0.14).epsilon(1e-6));
  CHECK(state.momentum[0].values[1] == Approx(0.04).epsilon(1e-6));
  // Version 2: a and b again on base 1, equal weights (100 tokens each): g = (0.2, 0.0).
  // buf = 0.5 * (0.14, 0.04) + g = (0.27, 0.02); theta -= 0.5 * (g + 0.5 * buf):
  // theta = (0.895 - 0.5 * (0.2 + 0.135), 1.97 - 0.5 * (0 + 0.01)) = (0.7275, 1.965).
  offer(ref("a", 2, 1, 2, 100), {0.3f, 0.1f});
  offer(ref("b", 2, 1, 3, 100), {0.1f, -0.1f});
  merge();
  REQUIRE(state.version == 2);
  CHECK(state.params[0].values[0] == Approx(0.7275).epsilon(1e-6));
  CHECK(state.params[0].values[1] == Approx(1.965).epsilon(1e-6));

  // Rebuilt from version 0 with only the records and the deltas they name: the same bits.
  std::vector<uint64_t> checksums;
  const FragmentState rebuilt = rebuild(genesis, log, 0, options, checksums);
  CHECK(same_bits(rebuilt.params, state.params));
  CHECK(same_bits(rebuilt.momentum, state.momentum));
  REQUIRE(checksums.size() == 2);
  CHECK(checksums[1] == state.checksum);
  CHECK(log.records[0].inputs.size() == 2);
  CHECK(log.records[0].inputs[1].weight == 9000.0);
}
