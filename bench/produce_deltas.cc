// Fake learners for the merger benchmarks (bench/merger_throughput.sh): produces well-formed
// deltas of a run's real model and fragment layout to its delta topic, as fast as the broker takes
// them (a backlog to drain) or at a fixed pace (a steady stream for the failover measurement).
//
//   bench-produce_deltas -c configs/demo.toml --set run.id="X" --learners 4 --rounds 100
//                        [--region r0] [--pace 0] [--summary FILE] [--genesis]
//
// A run's version 0 comes from a learner's proposal, which a merger commits: --genesis first
// proposes the built-in model's layout (or --tensors's) with seeded values (N(0, 0.02)) for every fragment that
// has no version 0 and waits until a running merger committed them (--rounds 0: nothing more).
// Deltas of a fragment without version 0 are rejected, so a backlog is made after that.
//
// Round r (r = 0, 1, ...) sends, for every fragment p and every fake learner m = 0..K-1 in that
// order, one delta of fragment p. Its base (--bases):
// - genesis (the default): every delta is on version 0, and each round's K learners are new ones
//   (ids fake-<m>-r<r>), as if every learner joined, sent one delta and left. No delta names a
//   version that does not exist yet, however far the merger is behind, so a backlog of any size
//   is valid: with merger.quorum=K and no learner heartbeats (so the grace window is 0) the merger
//   merges fragment p exactly when the K-th delta of a round arrives (version r -> r+1, staleness
//   r, all K of equal weight), every delta is merged and none is dropped (max_staleness unlimited).
//   With merger.quorum=1 every delta is merged alone (one transaction per delta).
// - rounds: round r is on version r, from learners fake-<m>. Valid only while the merger keeps up:
//   the merger drops a delta whose base it has not made yet ("base from the future").
// A fragment lives in one partition of the one region topic, so the merger reads the rounds in
// order.
//
// Delta values are gaussian (stddev 1e-3, seeded, one set per learner and fragment, reused every
// round), quantized once with the run's codec settings (no error feedback) and kept that way, then
// encoded each round as a learner encodes them (encode_delta). seq = a wall-clock millisecond floor + round, so seqs grow
// across invocations. --pace S waits S seconds between rounds. SIGINT/SIGTERM stop after the
// current round, flush and exit 0. --summary writes a JSON summary (fp32 bytes per fragment, wire
// bytes, counts).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/codec/messages.h"
#include "core/config/run_config.h"
#include "core/errors.h"
#include "core/kafka/consumer.h"
#include "core/kafka/delta_headers.h"
#include "core/kafka/producer.h"
#include "core/kafka/topics.h"
#include "core/process.h"
#include "core/kafka/run_log.h"
#include "core/model/builtin_specs.h"
#include "bench/bench_layout.h"
#include "core/codec/chunk.h"
#include "core/fragments/message_budget.h"

using namespace diloco;

namespace {

// The fragments whose version 0 is committed: the genesis records in `merges`, read to its end.
// Not the checkpoints in `state`: those hold the whole model, decoded at once.
std::set<uint32_t> committed_genesis(const KafkaOptions& kafka, const RunTopics& topics, const DecodeLimits& limits,
                                     int partitions) {
  Consumer consumer(ConsumerOptions{.kafka = kafka});
  std::vector<TopicPartitionOffset> from_start;
  for (int32_t i = 0; i < partitions; ++i) from_start.push_back({topics.merges(), i, -2});
  consumer.assign(from_start);
  std::set<uint32_t> out;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!consumer.at_end()) {
    if (std::chrono::steady_clock::now() > deadline) throw Unavailable("cannot read " + topics.merges() + " to its end");
    auto m = consumer.poll(200);
    if (!m || m->tombstone) continue;
    try {
      const MergeRecord r = decode_merge_record(m->value, limits);
      if (r.genesis) out.insert(r.fragment);
    } catch (const Rejection&) {
    }
  }
  return out;
}

// Proposes seeded values of every fragment without version 0, as a learner would, and waits until
// a merger committed every fragment's version 0.
void propose_genesis(const KafkaOptions& kafka, const RunConfig& config, const RunTopics& topics,
                     const std::shared_ptr<const FragmentLayout>& layout, const std::vector<uint32_t>& fragments,
                     const std::string& region, int partitions) {
  const DecodeLimits limits = run_decode_limits(config, *layout);
  const std::set<uint32_t> committed = committed_genesis(kafka, topics, limits, partitions);
  std::mt19937 rng(static_cast<uint32_t>(config.run.seed));
  std::normal_distribution<float> normal(0.0f, 0.02f);
  int failed = 0;
  Producer producer(ProducerOptions{.kafka = kafka}, [&](const DeliveryReport& r) { failed += r.ok ? 0 : 1; });
  const uint64_t seq = static_cast<uint64_t>(unix_us() / 1000);
  for (uint32_t p : fragments) {
    if (committed.count(p)) continue;
    GenesisProposal proposal{.run_id = config.run.id, .fingerprint = layout->fingerprint, .learner_id = "fake-genesis",
                             .region = region, .fragment = p, .seq = seq, .send_time_us = unix_us(), .layout = layout};
    for (uint32_t t = 0; t < layout->fragments[p].size(); ++t) {
      const auto& spec = layout->fragments[p][t];
      std::vector<float> v(static_cast<size_t>(spec.numel()));
      for (auto& x : v) x = normal(rng);
      proposal.tensors.push_back(DenseTensor{t, spec.shape, std::move(v)});
    }
    (void)produce_proposal(producer, topics, partitions, proposal, config.codec.segment_bytes, config.codec.chunk_bytes,
                           p, 60000);
    // Delivered before the next fragment is made: librdkafka keeps a copy of every piece until
    // then, and a model's worth of queued proposals is more memory than the rest of the run.
    if (producer.flush(60000) != 0 || failed) throw Unavailable("the proposals of version 0 were not delivered");
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(5);
  auto all_committed = [&] {
    const auto now = committed_genesis(kafka, topics, limits, partitions);
    return std::all_of(fragments.begin(), fragments.end(), [&](uint32_t p) { return now.count(p) > 0; });
  };
  while (!all_committed()) {
    if (std::chrono::steady_clock::now() > deadline || stop_requested())
      throw Unavailable("version 0 was not committed within 5 minutes: is a merger of the run running?");
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  std::cerr << "bench-produce_deltas: version 0 of every fragment sent is committed\n";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench-produce_deltas: fake learners producing real-sized deltas for the merger benchmarks"};
  std::string config_file, region = "r0", summary, bootstrap = default_bootstrap_servers();
  std::vector<std::string> overrides;
  uint32_t learners = 4;
  uint64_t rounds = 100;
  double pace = 0;
  app.add_option("-c,--config", config_file, "run config (TOML)")->required()->check(CLI::ExistingFile);
  app.add_option("-s,--set", overrides, "override a config value: section.key=value (repeatable)");
  std::string tensors;
  app.add_option("--tensors", tensors, "the model as NAME=D0xD1,... (e.g. embed=128256x4096) instead of the config's built-in one");
  app.add_option("--learners", learners, "fake learners K (deltas per fragment per round)")->capture_default_str();
  app.add_option("--rounds", rounds, "rounds to send")->capture_default_str();
  std::string bases = "genesis";
  app.add_option("--bases", bases,
                 "genesis: every delta on version 0, new learners each round (a valid backlog of any size); "
                 "rounds: round r on version r (valid only while the merger keeps up)")
      ->capture_default_str()
      ->check(CLI::IsMember({"genesis", "rounds"}));
  app.add_option("--region", region, "region: deltas go to diloco.<run>.deltas.<region>")->capture_default_str();
  app.add_option("--pace", pace, "seconds between two rounds (0: as fast as the broker takes them)")->capture_default_str();
  app.add_option("--bootstrap", bootstrap, "Kafka bootstrap servers")->capture_default_str();
  app.add_option("--summary", summary, "write a JSON summary here");
  bool genesis_first = false;
  std::string only;
  app.add_option("--only", only,
                 "only these fragments (e.g. 0,3): proposals and deltas of the others are not sent (a model too "
                 "large for the machine, of which some fragments travel)");
  app.add_flag("--genesis", genesis_first,
               "first propose version 0 of every fragment without one and wait until a merger committed it");
  CLI11_PARSE(app, argc, argv);
  install_stop_handlers();
  return_large_buffers();

  try {
    RunConfig config = load_run_config(config_file, overrides);
    const auto layout_ptr = std::make_shared<const FragmentLayout>(bench::bench_layout(config, tensors));  // no model is allocated
    const FragmentLayout& layout = *layout_ptr;
    const std::vector<uint32_t> run_fragments = bench::bench_fragments(layout, only);
    const uint32_t P = static_cast<uint32_t>(run_fragments.size());  // fragments sent, p = run_fragments[j]
    KafkaOptions kafka{.bootstrap_servers = bootstrap, .client_id = "bench-produce_deltas"};
    RunTopics topics{config.run.id};
    wait_for_broker(kafka);
    int partitions = 0;
    {
      Consumer probe(ConsumerOptions{.kafka = kafka});
      partitions = probe.partition_count(topics.deltas(region), 10000);
    }
    if (genesis_first) propose_genesis(kafka, config, topics, layout_ptr, run_fragments, region, partitions);

    // One set of delta tensors per (learner, fragment), seeded, kept quantized as they travel (int4:
    // about 0.5 bytes per parameter and learner; the fp32 values of one tensor exist at a time).
    CodecOptions codec{.dtype = config.codec.dtype, .block_size = config.codec.block_size,
                       .byte_shuffle = config.codec.byte_shuffle, .zstd_level = config.codec.zstd_level};
    std::mt19937 rng(static_cast<uint32_t>(config.run.seed * 7919 + 17));
    std::normal_distribution<float> normal(0.0f, 1e-3f);
    std::vector<std::vector<std::vector<QuantizedTensor>>> values(learners);
    for (uint32_t m = 0; m < learners; ++m)
      for (uint32_t p : run_fragments) {
        std::vector<QuantizedTensor> tensors;
        for (uint32_t t = 0; t < layout.fragments[p].size(); ++t) {
          const auto& spec = layout.fragments[p][t];
          std::vector<float> v(static_cast<size_t>(spec.numel()));
          for (auto& x : v) x = normal(rng);
          tensors.push_back(quantize(t, spec.shape, v, codec.dtype, codec.block_size));
        }
        values[m].push_back(std::move(tensors));
      }
    const uint32_t inner_steps = config.diloco.H;
    const uint64_t tokens = static_cast<uint64_t>(inner_steps) * static_cast<uint64_t>(config.train.batch * config.model.context);
    const uint64_t seq0 = static_cast<uint64_t>(unix_us() / 1000);

    uint64_t failed = 0, delivered = 0;
    ProducerOptions producer_options{.kafka = kafka, .queue_max_messages = 10000};
    Producer producer(producer_options, [&](const DeliveryReport& r) { r.ok ? ++delivered : ++failed; });

    std::vector<uint64_t> fp32_bytes(P);
    for (uint32_t j = 0; j < P; ++j) fp32_bytes[j] = static_cast<uint64_t>(layout.fragment_numel(run_fragments[j])) * 4;
    uint64_t sent = 0, wire_bytes = 0, fp32_total = 0, round = 0;
    double encode_seconds = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (; round < rounds && !stop_requested(); ++round) {
      auto round_start = std::chrono::steady_clock::now();
      for (uint32_t j = 0; j < P; ++j)
        for (uint32_t m = 0; m < learners; ++m) {
          const uint32_t p = run_fragments[j];
          const bool genesis = bases == "genesis";
          DeltaHeader h{.run_id = config.run.id, .fingerprint = layout.fingerprint,
                        .learner_id = "fake-" + std::to_string(m) + (genesis ? "-r" + std::to_string(round) : ""),
                        .region = region, .fragment = p, .seq = seq0 + round, .base_version = genesis ? 0 : round, .inner_steps = inner_steps, .tokens = tokens,
                        .learner_step = (round + 1) * inner_steps, .train_loss = 2.0f, .send_time_us = unix_us()};
          auto e0 = std::chrono::steady_clock::now();
          auto bytes = encode_delta(h, std::span<const QuantizedTensor>(values[m][j]), codec);
          encode_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - e0).count();
          // In pieces of codec.chunk_bytes when larger, as a learner sends it (a 250M-parameter
          // fragment's int4 delta is above one Kafka record).
          for_each_piece(bytes, ChunkId{config.run.id, h.learner_id, p, h.seq}, config.codec.chunk_bytes,
                         [&](uint32_t, uint32_t, std::span<const uint8_t> piece) {
                           producer.produce({.topic = topics.deltas(region),
                                             .partition = static_cast<int32_t>(p % static_cast<uint32_t>(partitions)),
                                             .key = std::to_string(p), .value = piece, .headers = delta_headers(h)},
                                            sent, 60000);
                         });
          ++sent;
          wire_bytes += bytes.size();
          fp32_total += fp32_bytes[j];
        }
      producer.poll(0);
      if (pace > 0) {
        auto next = round_start + std::chrono::duration<double>(pace);
        while (!stop_requested() && std::chrono::steady_clock::now() < next) {
          producer.poll(10);
        }
      }
    }
    int left = producer.flush(120000);
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    nlohmann::json out{{"run", config.run.id},
                       {"region", region},
                       {"learners", learners},
                       {"rounds", round},
                       {"fragments", P},
                       {"fragment_ids", run_fragments},
                       {"layout_fragments", layout.num_fragments()},
                       {"partitions", partitions},
                       {"fp32_bytes_per_fragment", fp32_bytes},
                       {"deltas", sent},
                       {"delivered", delivered},
                       {"failed", failed + static_cast<uint64_t>(left)},
                       {"fp32_bytes", fp32_total},
                       {"wire_bytes", wire_bytes},
                       {"wire_bytes_per_delta", sent ? wire_bytes / sent : 0},
                       {"encode_seconds", encode_seconds},
                       {"seconds", seconds},
                       {"codec", {{"dtype", static_cast<int>(codec.dtype)}, {"block", codec.block_size},
                                  {"shuffle", codec.byte_shuffle}, {"zstd_level", codec.zstd_level}}}};
    if (!summary.empty()) std::ofstream(summary) << out.dump() << "\n";
    std::cerr << "bench-produce_deltas: " << out.dump() << "\n";
    return failed == 0 && left == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "bench-produce_deltas: error: " << e.what() << "\n";
    return 1;
  }
}
