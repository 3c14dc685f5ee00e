#include "learner/learner.h"

#include <sys/resource.h>

#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/data/corpus.h"
#include "core/fragments/message_budget.h"
#include "core/fragments/schedule.h"
#include "core/kafka/consumer.h"
#include "core/kafka/log_reader.h"
#include "core/kafka/run_log.h"
#include "core/kafka/traffic.h"
#include "core/metrics/metrics.h"
#include "core/process.h"
#include "core/model/cpu_runtime.h"
#include "core/train/inner_optimizer.h"
#include "core/train/model_file.h"
#include "core/train/model_setup.h"
#include "learner/delta_publisher.h"
#include "learner/fragment_track.h"
#include "learner/param_inbox.h"
#include "learner/resume.h"

namespace diloco {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

long max_rss_kb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss;
}

uint32_t region_index(const LearnerOptions& o) {
  for (uint32_t i = 0; i < o.regions.size(); ++i)
    if (o.regions[i] == o.region) return i;
  throw InvalidInput("region '" + o.region + "' is not in --regions");
}

class Learner {
 public:
  Learner(const LearnerOptions& options, const std::atomic<bool>& stop)
      : o_(options), stop_(stop), setup_(build_model(options.config)), metrics_("diloco_learner_") {
    // A model whose fragments cannot travel is refused now, not when its first delta is sent.
    if (networked()) check_message_sizes(o_.config, setup_.layout, o_.kafka.max_message_bytes);
  }

  int run();

 private:
  bool networked() const { return o_.mode != LearnerMode::Standalone; }
  DecodeLimits limits() const {
    return run_decode_limits(o_.config, setup_.layout);
  }
  void load_global_state();
  ResumePoint read_resume_point();
  void wait_for_versions(const std::map<uint32_t, uint64_t>& versions, uint64_t step);
  void adopt_received(uint64_t step, float loss);
  bool cut_early(uint32_t p, uint64_t coming, uint64_t step, float loss);
  void publish_delta(uint32_t p, uint64_t step, float loss, bool early);
  void wait_for_merges(uint64_t step, float loss);
  void heartbeat(uint64_t step, float loss);
  void log(nlohmann::json record);
  bool out_of_budget(uint64_t step) const;
  int eval_only_loop();
  void export_model(nlohmann::json info);

  const LearnerOptions& o_;
  const std::atomic<bool>& stop_;
  ModelSetup setup_;
  Metrics metrics_;
  std::unique_ptr<JsonLines> log_;
  std::unique_ptr<MetricsEndpoint> endpoint_;
  std::vector<FragmentTrack> fragments_;  // the global state of every fragment as this learner knows it
  std::vector<uint64_t> seqs_;              // per fragment: seq of the last delta sent
  std::optional<CutSchedule> schedule_;     // Train mode: when each fragment is next due
  std::unique_ptr<DeltaPublisher> publisher_;
  std::unique_ptr<ParamInbox> inbox_;
  std::vector<FragmentParams> held_at_start_;  // what load_global_state read, for the inbox
  Clock::time_point start_ = Clock::now();
  Clock::time_point last_heartbeat_{};
  double step_time_ema_ = 0;
  double tokens_per_s_ = 0;
  uint64_t total_tokens_ = 0;
  uint64_t adopted_ = 0;
  double compute_seconds_ = 0;  // in inner steps (with the speed-factor sleep), not waiting
  double wait_seconds_ = 0;     // waiting for merges (diloco.wait_steps >= 0)
};

void Learner::log(nlohmann::json record) {
  record["t"] = seconds_since(start_);
  record["time_us"] = unix_us();
  record["learner"] = o_.learner_id;
  if (log_) log_->write(record);
}

bool Learner::out_of_budget(uint64_t step) const {
  int64_t steps = o_.steps > 0 ? o_.steps : o_.config.train.total_steps;
  if (o_.mode != LearnerMode::EvalOnly && static_cast<int64_t>(step) >= steps) return true;
  return o_.max_seconds > 0 && seconds_since(start_) >= o_.max_seconds;
}

void Learner::load_global_state() {
  auto n = setup_.layout.num_fragments();
  fragments_.clear();
  seqs_.assign(n, 0);
  for (uint32_t p = 0; p < n; ++p) fragments_.emplace_back(fragment_tensors(setup_.model, setup_.layout, p), 0);
  if (!networked()) return;
  std::cerr << "learner " << o_.learner_id << ": reading the global state from " << RunTopics{o_.config.run.id}.state()
            << "\n";
  StateScan scan = wait_for_states(o_.kafka, RunTopics{o_.config.run.id}, limits(), o_.genesis_timeout,
                                   [&](size_t missing) {
                                     if (stop_) return false;  // asked to stop before the run began
                                     std::cerr << "learner " << o_.learner_id << ": waiting for version 0 of " << missing
                                               << " fragment(s): start a merger\n";
                                     return true;
                                   });
  held_at_start_.clear();
  for (auto& [p, state] : scan.latest) {
    if (p >= n) continue;
    held_at_start_.push_back(FragmentParams{.run_id = state.run_id, .fingerprint = state.fingerprint, .fragment = p,
                                            .version = state.version, .checksum = state.checksum,
                                            .tensors = state.params});
    load_fragment(setup_.model, setup_.layout, p, state.params);
    fragments_[p] = FragmentTrack(std::move(state.params), state.version, state.checksum);
  }
  std::cerr << "learner " << o_.learner_id << ": starting from versions";
  for (const auto& f : fragments_) std::cerr << " " << f.version();
  std::cerr << "\n";
}

// Cuts p now, ahead of its schedule, if a version `coming` of p would otherwise miss or overwrite
// this learner's unsent progress (diloco.cut_on_arrival); p's next cut is then H steps later.
bool Learner::cut_early(uint32_t p, uint64_t coming, uint64_t step, float loss) {
  const auto& d = o_.config.diloco;
  if (o_.mode != LearnerMode::Train || !fragments_[p].cut_before_adopting(coming, d.cut_on_arrival, d.H)) return false;
  publish_delta(p, step, loss, true);
  schedule_->cut(p, step);
  return true;
}

void Learner::adopt_received(uint64_t step, float loss) {
  if (!inbox_) return;
  std::vector<uint64_t> known;
  for (const auto& f : fragments_) known.push_back(f.version());
  const auto& d = o_.config.diloco;
  // A merger's quorum for p is in: a learner whose own cut of p is close sends it now, inside the
  // grace window, so that it joins that merge instead of missing it by a few steps.
  for (const RoundOpen& notice : inbox_->take_round_opens()) {
    const uint32_t p = notice.fragment;
    if (p >= fragments_.size() || notice.version < fragments_[p].version()) continue;
    if (!cut_early(p, notice.version + 1, step, loss)) continue;
    log({{"event", "round_open_cut"}, {"fragment", p}, {"version", notice.version}, {"merger", notice.merger_instance}});
  }
  for (const auto& taken : inbox_->take(known)) {
    const FragmentParams& params = *taken;
    uint32_t p = params.fragment;
    auto& f = fragments_[p];
    // Cut before an overwrite: with overwrite-on-adoption, a learner a few steps behind the others
    // would lose all its progress on p since its base when another learner's merge arrives first.
    // Cutting first sends that progress, and restarting p's cycle here pulls this learner's
    // schedule into phase with the learners whose merge just arrived.
    cut_early(p, params.version, step, loss);
    uint64_t behind = params.version - f.version();
    const double alpha = d.blend_alpha;
    const bool rebase = d.adopt == "rebase";
    auto local = alpha > 0 || rebase ? fragment_tensors(setup_.model, setup_.layout, p) : std::vector<DenseTensor>{};
    load_fragment(setup_.model, setup_.layout, p,
                  rebase ? f.rebase(params.version, params.checksum, params.tensors, local)
                         : f.adopt(params.version, params.checksum, params.tensors, alpha, local));
    ++adopted_;
    metrics_.add("versions_adopted_total", 1);
    metrics_.set("fragment_version", static_cast<double>(f.version()), {{"fragment", std::to_string(p)}});
    metrics_.observe("adoption_gap_versions", static_cast<double>(behind), {1, 2, 4, 8, 16, 32});
    log({{"event", "adopt"}, {"fragment", p}, {"version", f.version()}, {"versions_behind", behind},
         {"checksum", f.checksum()}});
  }
}

void Learner::publish_delta(uint32_t p, uint64_t step, float loss, bool early) {
  auto& f = fragments_[p];
  if (f.steps() == 0) return;
  const auto& codec = o_.config.codec;
  CutDelta cut = f.cut(copy_fragment(setup_.model, setup_.layout, p), codec.dtype, codec.block_size, codec.topk);
  DeltaHeader h;
  h.run_id = o_.config.run.id;
  h.fingerprint = setup_.layout.fingerprint;
  h.learner_id = o_.learner_id;
  h.region = o_.region;
  h.fragment = p;
  // Wall-clock milliseconds as a floor keep seqs increasing across restarts of this learner id,
  // so a merger never mistakes a new delta for a re-read old one.
  seqs_[p] = std::max<uint64_t>(seqs_[p] + 1, static_cast<uint64_t>(unix_us() / 1000));
  h.seq = seqs_[p];
  h.base_version = cut.base_version;
  h.inner_steps = cut.inner_steps;
  h.tokens = cut.tokens;
  h.learner_step = step;
  h.train_loss = std::isfinite(loss) ? loss : 0.0f;
  h.send_time_us = unix_us();
  CodecOptions options{.dtype = codec.dtype, .block_size = codec.block_size, .topk = codec.topk,
                       .byte_shuffle = codec.byte_shuffle, .zstd_level = codec.zstd_level};
  auto bytes = encode_delta(h, std::span<const QuantizedTensor>(cut.tensors), options);
  metrics_.add("deltas_submitted_total", 1);
  metrics_.add("delta_wire_bytes_total", static_cast<double>(bytes.size()));
  if (early) metrics_.add("deltas_cut_on_arrival_total", 1);
  log({{"event", "delta"}, {"step", step}, {"fragment", p}, {"seq", h.seq}, {"base_version", h.base_version},
       {"inner_steps", h.inner_steps}, {"tokens", h.tokens}, {"wire_bytes", bytes.size()}, {"early", early}});
  publisher_->submit(OutgoingDelta{std::move(h), std::move(bytes)});
  f.expect_merge(step, o_.config.diloco.wait_steps);
}

// Synchronous modes (diloco.wait_steps >= 0): before the next inner step, wait until every
// fragment whose wait is due holds a version above the base its last delta was cut on. The wait
// polls the inbox, adopts, sends heartbeats and gives up after diloco.wait_timeout_seconds.
void Learner::wait_for_merges(uint64_t step, float loss) {
  const double timeout = o_.config.diloco.wait_timeout_seconds;
  for (uint32_t p = 0; p < fragments_.size(); ++p) {
    if (!fragments_[p].must_wait(step)) continue;
    const uint64_t base = fragments_[p].awaited_base().value_or(0);
    const auto t0 = Clock::now();
    auto last_note = t0;
    bool timed_out = false;
    while (!stop_ && !out_of_budget(step)) {
      adopt_received(step, loss);
      if (!fragments_[p].must_wait(step)) break;
      heartbeat(step, loss);
      if (seconds_since(t0) >= timeout) {
        timed_out = true;
        fragments_[p].give_up_wait();
        std::cerr << "learner " << o_.learner_id << ": gave up waiting for a merge of fragment " << p
                  << " above version " << base << " after " << timeout << " s\n";
        log({{"event", "wait_timeout"}, {"fragment", p}, {"base_version", base}, {"seconds", seconds_since(t0)}});
        break;
      }
      if (seconds_since(last_note) >= 10) {
        last_note = Clock::now();
        std::cerr << "learner " << o_.learner_id << ": step " << step << ": waiting " << static_cast<int>(seconds_since(t0))
                  << " s for a merge of fragment " << p << " above version " << base << "\n";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    const double waited = seconds_since(t0);
    wait_seconds_ += waited;
    metrics_.add("wait_seconds_total", waited);
    log({{"event", "wait"}, {"fragment", p}, {"base_version", base}, {"seconds", waited}, {"timed_out", timed_out}});
  }
}

ResumePoint Learner::read_resume_point() {
  const RunTopics topics{o_.config.run.id};
  std::vector<MemberRecord> records;
  try {
    read_to_end(o_.kafka, {topics.members()}, [&](const ConsumedMessage& m) {
      MemberRecord r{.key = m.key, .stamp_ms = m.timestamp_ms};
      if (!m.tombstone) {
        try {
          r.member = decode_member(m.value, limits());
        } catch (const Rejection&) {
          return;  // not an announcement of this run: it says nothing about where the run stands
        }
      }
      records.push_back(std::move(r));
    }, o_.members_read_ms);
  } catch (const Unavailable& e) {
    std::cerr << "learner " << o_.learner_id << ": cannot read " << topics.members() << " (" << e.what()
              << "): starting at step 0\n";
    return {};
  }
  const bool synchronous = o_.config.diloco.wait_steps >= 0;
  ResumePoint r = resume_point(o_.learner_id, records,
                               static_cast<int64_t>(o_.config.merger.liveness_seconds * 1000), synchronous);
  if (r.restarted) {
    std::cerr << "learner " << o_.learner_id << ": restarted, continuing at step " << r.step
              << (synchronous ? " (one below the slowest of " : " (its last announced step; ") << r.live_peers
              << " live peer(s))\n";
    log({{"event", "resume"}, {"step", r.step}, {"live_peers", r.live_peers}, {"synchronous", synchronous}});
  }
  return r;
}

// A restarted learner first takes the versions the mergers announce, so that its first deltas are
// cut on current bases (a delta on a base its earlier process already had merged is superseded).
void Learner::wait_for_versions(const std::map<uint32_t, uint64_t>& versions, uint64_t step) {
  const auto t0 = Clock::now();
  const double timeout = o_.resume_wait_s;
  std::set<uint32_t> silent;  // fragments whose mergers went silent: not waited for
  // Whether a fragment is still worth waiting for; one whose mergers went silent is given up.
  auto behind = [&] {
    bool waiting = false;
    for (const auto& [p, v] : versions) {
      if (p >= fragments_.size() || fragments_[p].version() >= v || silent.count(p)) continue;
      if (inbox_ && inbox_->owner_silent(p, o_.resume_silent_intervals)) {
        silent.insert(p);
        std::cerr << "learner " << o_.learner_id << ": fragment " << p << ": no merger announced it for "
                  << o_.resume_silent_intervals << " of its announce intervals; not waiting for version " << v
                  << " (training on version " << fragments_[p].version() << ")\n";
      } else {
        waiting = true;
      }
    }
    return waiting;
  };
  while (behind() && !stop_ && seconds_since(t0) < timeout) {
    adopt_received(step, 0);
    heartbeat(step, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (behind())
    std::cerr << "learner " << o_.learner_id << ": the announced versions did not arrive within " << timeout
              << " s; training on what it holds\n";
  log({{"event", "resume_versions"}, {"seconds", seconds_since(t0)}, {"complete", !behind() && silent.empty()},
       {"silent_fragments", silent.size()}});
}

void Learner::heartbeat(uint64_t step, float loss) {
  if (!publisher_ || seconds_since(last_heartbeat_) < o_.heartbeat_interval_s) return;
  last_heartbeat_ = Clock::now();
  Member m;
  m.run_id = o_.config.run.id;
  m.instance_id = o_.learner_id;
  m.role = o_.mode == LearnerMode::EvalOnly ? Role::Evaluator : Role::Learner;
  m.region = o_.region;
  m.time_us = unix_us();
  m.step = step;
  m.step_time_s = static_cast<float>(step_time_ema_);
  m.tokens_per_s = static_cast<float>(tokens_per_s_);
  m.loss = std::isfinite(loss) ? loss : 0.0f;
  m.tokens = total_tokens_;
  m.bytes_sent = publisher_->stats().bytes_delivered;
  if (inbox_) m.bytes_received = inbox_->bytes_received();
  for (uint32_t p = 0; p < fragments_.size(); ++p) {
    m.owned_fragments.push_back(p);
    m.fragment_versions.push_back(fragments_[p].version());
  }
  publisher_->submit_heartbeat(o_.learner_id, encode_member(m));
}

void Learner::export_model(nlohmann::json info) {
  if (o_.export_path.empty()) return;
  nlohmann::json versions = nlohmann::json::array();
  for (const auto& f : fragments_) versions.push_back(f.version());
  info["run_id"] = o_.config.run.id;
  info["learner"] = o_.learner_id;
  info["mode"] = learner_mode_name(o_.mode);
  info["versions"] = versions;
  info["fingerprint"] = setup_.layout.fingerprint;
  info["config"] = o_.config.source;
  info["time_us"] = unix_us();
  try {
    save_model_file(o_.export_path, setup_.model, info);
    log({{"event", "export"}, {"path", o_.export_path}, {"versions", versions}});
  } catch (const std::exception& e) {  // a full disk must not stop training or evaluation
    std::cerr << "learner " << o_.learner_id << ": could not write " << o_.export_path << ": " << e.what() << "\n";
  }
}

int Learner::eval_only_loop() {
  const auto& train = o_.config.train;
  Corpus corpus = load_corpus(o_.config.data.path);
  BatchStream heldout = heldout_batches(corpus, o_.config.data, train.batch, o_.config.model.context);
  auto version_sum = [&] {
    uint64_t sum = 0;
    for (const auto& f : fragments_) sum += f.version();
    return sum;
  };
  std::optional<uint64_t> evaluated;  // the version sum of the last evaluation
  auto evaluate = [&] {
    double loss = heldout_loss(setup_.model, heldout, train.eval_batches);
    metrics_.set("global_eval_loss", loss);
    nlohmann::json versions = nlohmann::json::array();
    for (const auto& f : fragments_) versions.push_back(f.version());
    log({{"event", "global_eval"}, {"eval_loss", loss}, {"versions", versions}, {"version_sum", version_sum()}});
    std::cerr << "eval: global held-out loss " << loss << " at versions " << versions.dump() << "\n";
    if (version_sum() != evaluated.value_or(0)) export_model({{"heldout_loss", loss}});
    evaluated = version_sum();
  };
  Clock::time_point last_eval{};
  while (!stop_ && !out_of_budget(0)) {
    adopt_received(0, 0);
    heartbeat(0, 0);
    if (seconds_since(last_eval) >= o_.eval_interval_s) {
      last_eval = Clock::now();
      evaluate();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  // The last versions published before the stop: evaluate (and export) them too.
  adopt_received(0, 0);
  if (evaluated != version_sum()) evaluate();
  return 0;
}

int Learner::run() {
  set_torch_threads(1);
  retain_freed_memory();
  if (!o_.run_dir.empty()) {
    std::filesystem::create_directories(o_.run_dir);
    log_ = std::make_unique<JsonLines>(o_.run_dir + "/metrics.jsonl");
  }
  endpoint_ = std::make_unique<MetricsEndpoint>(metrics_, o_.metrics_port);
  metrics_.add("wait_seconds_total", 0);  // listed from the start, also in runs that never wait
  const auto& config = o_.config;
  log({{"event", "start"}, {"mode", learner_mode_name(o_.mode)}, {"region", o_.region}, {"config", config.source},
       {"parameters", setup_.model.num_parameters()}, {"fragments", setup_.layout.num_fragments()},
       {"fingerprint", setup_.layout.fingerprint}});

  RunTopics topics{config.run.id};
  int partitions = 1;
  if (networked()) {
    wait_for_broker(o_.kafka);
    {
      ConsumerOptions probe_options{.kafka = o_.kafka};
      Consumer probe(probe_options);
      partitions = probe.partition_count(topics.deltas(o_.region), 10000);
    }
    load_global_state();
    if (stop_) {  // asked to stop while waiting for the run's version 0: nothing was trained
      log({{"event", "stop"}, {"step", 0}, {"tokens", 0}, {"reason", "signal"}, {"compute_seconds", 0.0},
           {"wait_seconds", 0.0}});
      std::cerr << "learner " << o_.learner_id << ": stopped before the run began\n";
      return 0;
    }
    ProducerOptions producer{.kafka = o_.kafka, .delivery_timeout_ms = 0};
    producer.kafka.client_id = o_.learner_id;
    publisher_ = std::make_unique<DeltaPublisher>(
        DeltaPublisherOptions{.producer = producer, .topics = topics, .partitions = partitions,
                              .chunk_bytes = o_.config.codec.chunk_bytes},
        metrics_);
    inbox_ = std::make_unique<ParamInbox>(
        ParamInboxOptions{.kafka = o_.kafka, .topics = topics, .limits = limits(), .endpoints = o_.merger_endpoints,
                          .held = std::move(held_at_start_)},
        metrics_);
  } else {
    load_global_state();
  }

  int exit_code = 0;
  if (o_.mode == LearnerMode::EvalOnly) {
    exit_code = eval_only_loop();
  } else {
    const auto& train = config.train;
    Corpus corpus = load_corpus(config.data.path);
    ShardSpec shard{.learner = o_.index, .num_learners = o_.learners, .region = region_index(o_),
                    .num_regions = static_cast<uint32_t>(o_.regions.size())};
    BatchStream batches = training_batches(corpus, config.data, shard, train.batch, config.model.context, config.run.seed);
    BatchStream heldout = heldout_batches(corpus, config.data, train.batch, config.model.context);
    InnerOptimizer optimizer(setup_.model.parameters(), inner_optimizer_options(train));
    const StreamingSchedule schedule{
        .sync_interval = config.diloco.H, .num_fragments = config.diloco.fragments,
        .offset = config.diloco.stagger ? stagger_offset(o_.index, o_.learners, config.diloco.H) : 0u};
    // A learner restarted under the same id continues where the run stands (learner/resume.h).
    uint64_t first_step = 0;
    std::map<uint32_t, uint64_t> current_versions;
    if (networked()) {
      const ResumePoint resume = read_resume_point();
      if (resume.restarted) {
        first_step = resume.step;
        current_versions = resume.versions;
      }
    }
    schedule_.emplace(schedule, first_step);
    const uint64_t tokens_per_step = static_cast<uint64_t>(train.batch * config.model.context);
    double loss_ema = 0;
    float loss_value = 0;
    uint64_t step = first_step;
    if (!current_versions.empty()) wait_for_versions(current_versions, step);
    auto evaluate = [&] {
      double eval = heldout_loss(setup_.model, heldout, train.eval_batches);
      metrics_.set("eval_loss", eval);
      log({{"event", "eval"}, {"step", step}, {"eval_loss", eval}, {"tokens", total_tokens_}});
      std::cerr << "learner " << o_.learner_id << ": step " << step << " loss " << loss_ema << " held-out " << eval
                << " (" << static_cast<int>(tokens_per_s_) << " tokens/s)\n";
    };
    if (train.eval_every > 0) evaluate();  // the starting point of every loss curve
    while (!stop_ && !out_of_budget(step)) {
      wait_for_merges(step, loss_value);
      if (stop_ || out_of_budget(step)) break;
      auto t0 = Clock::now();
      Batch b = batches.next();
      torch::Tensor loss = setup_.model.loss(b.input, b.target);
      loss.backward();
      optimizer.step(static_cast<int64_t>(step));
      optimizer.zero_grad();
      loss_value = loss.item<float>();
      ++step;
      total_tokens_ += tokens_per_step;
      for (auto& f : fragments_) f.count_step(tokens_per_step);
      if (o_.mode == LearnerMode::Train) {
        for (uint32_t p : schedule_->due(step)) {
          publish_delta(p, step, loss_value, false);
          schedule_->cut(p, step);
        }
      }
      adopt_received(step, loss_value);
      double compute = seconds_since(t0);
      if (o_.speed_factor > 1.0)
        std::this_thread::sleep_for(std::chrono::duration<double>(compute * (o_.speed_factor - 1.0)));
      double step_time = seconds_since(t0);
      compute_seconds_ += step_time;
      step_time_ema_ = step_time_ema_ == 0 ? step_time : 0.9 * step_time_ema_ + 0.1 * step_time;
      tokens_per_s_ = static_cast<double>(tokens_per_step) / step_time_ema_;
      loss_ema = loss_ema == 0 ? loss_value : 0.95 * loss_ema + 0.05 * loss_value;
      metrics_.set("step", static_cast<double>(step));
      metrics_.set("step_time_seconds", step_time_ema_);
      metrics_.set("tokens_per_second", tokens_per_s_);
      metrics_.set("train_loss", loss_value);
      metrics_.add("tokens_total", static_cast<double>(tokens_per_step));
      heartbeat(step, loss_value);
      if (o_.log_every > 0 && step % static_cast<uint64_t>(o_.log_every) == 0) {
        nlohmann::json record{{"event", "step"},          {"step", step},
                              {"loss", loss_value},       {"loss_ema", loss_ema},
                              {"step_time", step_time_ema_}, {"tokens", total_tokens_},
                              {"tokens_per_s", tokens_per_s_}, {"adopted", adopted_},
                              {"max_rss_kb", max_rss_kb()}, {"compute_seconds", compute_seconds_},
                              {"wait_seconds", wait_seconds_}};
        if (publisher_) {
          auto s = publisher_->stats();
          record["deltas_delivered"] = s.delivered;
          record["deltas_superseded"] = s.superseded;
          record["deltas_in_flight"] = s.in_flight;
          record["deltas_waiting"] = s.waiting;
          record["bytes_sent"] = s.bytes_delivered;
        }
        if (inbox_) {
          record["params_received"] = inbox_->received();
          record["params_rejected"] = inbox_->rejected();
          record["bytes_received"] = inbox_->bytes_received();
        }
        const KafkaTraffic kafka = kafka_traffic();
        record["kafka_sent"] = kafka.sent;
        record["kafka_received"] = kafka.received;
        metrics_.set("kafka_bytes_sent", static_cast<double>(kafka.sent));
        metrics_.set("kafka_bytes_received", static_cast<double>(kafka.received));
        nlohmann::json versions = nlohmann::json::array();
        for (const auto& f : fragments_) versions.push_back(f.version());
        record["versions"] = versions;
        log(record);
      }
      if (train.eval_every > 0 && step % static_cast<uint64_t>(train.eval_every) == 0) evaluate();
    }
    log({{"event", "stop"}, {"step", step}, {"tokens", total_tokens_}, {"reason", stop_ ? "signal" : "budget"},
         {"compute_seconds", compute_seconds_}, {"wait_seconds", wait_seconds_}});
    export_model({{"step", step}, {"tokens", total_tokens_}});
  }

  if (publisher_) {
    heartbeat(0, 0);
    auto undelivered = publisher_->close(o_.shutdown_flush);
    auto s = publisher_->stats();
    std::cerr << "learner " << o_.learner_id << ": " << s.delivered << " deltas delivered, " << s.superseded
              << " superseded, " << undelivered.size() << " not delivered";
    for (auto [p, seq] : undelivered) std::cerr << " (fragment " << p << " seq " << seq << ")";
    std::cerr << "\n";
    nlohmann::json lost = nlohmann::json::array();
    for (auto [p, seq] : undelivered) lost.push_back({{"fragment", p}, {"seq", seq}});
    nlohmann::json record{{"event", "shutdown"}, {"delivered", s.delivered},   {"superseded", s.superseded},
                          {"bytes_sent", s.bytes_delivered}, {"undelivered", lost}};
    if (inbox_) record["bytes_received"] = inbox_->bytes_received();
    const KafkaTraffic kafka = kafka_traffic();
    record["kafka_sent"] = kafka.sent;
    record["kafka_received"] = kafka.received;
    log(record);
  }
  return exit_code;
}

}  // namespace

const char* learner_mode_name(LearnerMode mode) {
  switch (mode) {
    case LearnerMode::Train: return "train";
    case LearnerMode::NoPublish: return "no-publish";
    case LearnerMode::Standalone: return "standalone";
    case LearnerMode::EvalOnly: return "eval-only";
  }
  return "?";
}

int run_learner(const LearnerOptions& options, const std::atomic<bool>& stop) {
  Learner learner(options, stop);
  return learner.run();
}

}  // namespace diloco
