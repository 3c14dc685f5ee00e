// A learner: one island of compute training the shared model with AdamW on its own data shard,
// publishing per-fragment deltas on the streaming schedule and adopting global fragments at step
// boundaries. It never blocks on the network: deltas go through DeltaPublisher, global fragments
// arrive through ParamInbox, and the training thread only touches the model.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "core/config/run_config.h"
#include "core/kafka/options.h"

namespace diloco {

enum class LearnerMode {
  Train,       // train, publish deltas, adopt global fragments
  NoPublish,   // train and adopt, but never compute or send deltas (overhead baseline)
  Standalone,  // no Kafka, no ZeroMQ: the single-learner baseline
  EvalOnly,    // never train: follow the global fragments and report the global held-out loss
};
const char* learner_mode_name(LearnerMode);

struct LearnerOptions {
  RunConfig config;
  LearnerMode mode = LearnerMode::Train;
  std::string learner_id = "learner-0";
  std::string region = "region0";
  std::vector<std::string> regions = {"region0"};  // every region of the run (data split by region)
  uint32_t index = 0;         // this learner's index among `learners` (data shard; stagger if diloco.stagger)
  uint32_t learners = 1;
  KafkaOptions kafka;
  std::vector<std::string> merger_endpoints;  // in addition to those announced in `members`
  double speed_factor = 1.0;  // > 1 slows each step by that factor (emulates older hardware)
  int64_t steps = 0;          // stop after this many inner steps (0: config.train.total_steps)
  double max_seconds = 0;     // stop after this long (0: no limit)
  double eval_interval_s = 10;  // EvalOnly: seconds between evaluations of the global model
  double heartbeat_interval_s = 2;
  int log_every = 10;          // steps between metrics lines
  std::string run_dir;         // metrics.jsonl goes here (created if missing)
  std::string export_path;     // model file (core/train/model_file.h) written at stop; EvalOnly: also after each eval
  int metrics_port = 0;        // Prometheus endpoint on 127.0.0.1 (0: off)
  std::chrono::seconds genesis_timeout{600};
  // A restart (learner/resume.h): reading the members topic, and how long to wait for the
  // versions the mergers announce before training (they answer the subscription at once; this
  // covers two merger heartbeats, a request for a missed version and slack).
  int members_read_ms = 10000;
  double resume_wait_s = 6;
  // A fragment whose mergers have been silent for this many of their announce intervals (killed,
  // and their announcements still within the liveness window) is not waited for: nobody can send
  // it. The inbox keeps asking, and the version is adopted when a merger serves it.
  double resume_silent_intervals = 2;
  std::chrono::milliseconds shutdown_flush{10000};
};

// Runs until the step budget, the time budget or `stop` (set by a signal handler). Returns the
// process exit code: 0 on a clean stop. Throws InvalidInput / Unavailable with a message naming
// the problem for bad configs, a missing corpus or no broker at start-up.
int run_learner(const LearnerOptions& options, const std::atomic<bool>& stop);

}  // namespace diloco
