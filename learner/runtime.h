// The learner runtime: everything a learner does besides training, over named fp32 host buffers
// and without torch. A client (diloco-learner for the built-in libtorch model, the Python package's
// Session for any PyTorch or NumPy model) owns the model and the inner loop, registers its tensors
// here, and calls step() after every inner step:
//
//   LearnerRuntime runtime(options, tensors, sync);   // the layout and fingerprint: no I/O yet
//   runtime.start();          // the run's version 0 (proposed by this learner if the run has
//                             // none), or the current versions, written into the buffers
//   loop: inner step (the client's), then runtime.step({.tokens = n, .loss = l});
//   runtime.close();          // flushes the deltas still in flight
//
// step() counts the step, cuts the fragments that are due (delta = anchor - theta, plus the
// error-feedback residual, quantized and handed to a background publisher), adopts the global
// versions that arrived (overwrite or rebase, ARCHITECTURE.md section 5), sends heartbeats and
// writes metrics. It never blocks on the network; in a synchronous mode (diloco.wait_steps >= 0)
// it waits for the merges due, as the paper's synchronous DiLoCo does.
//
// Host buffers. The runtime reads and writes the registered fp32 buffers only inside its calls,
// on the calling thread. A client whose tensors live on a device registers host copies and gives
// a HostSync: the runtime asks for exactly the tensors of a fragment it is about to read (a cut,
// a rebase) and hands back exactly those it wrote (an adoption), so only that fragment crosses.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/config/run_config.h"
#include "core/fragments/layout.h"
#include "core/kafka/options.h"

namespace diloco {

class Metrics;

enum class LearnerMode {
  Train,       // train, publish deltas, adopt global fragments
  NoPublish,   // train and adopt, but never compute or send deltas (overhead baseline)
  Standalone,  // no Kafka, no ZeroMQ: the single-learner baseline (start() adopts nothing)
  EvalOnly,    // never train: follow the global fragments (a client evaluates the global model)
};
const char* learner_mode_name(LearnerMode);

// One tensor of the model as a client registers it: its name and shape, and `numel` contiguous
// fp32 values in host memory that hold the tensor (or its host copy, see HostSync).
struct RegisteredTensor {
  std::string name;
  std::vector<int64_t> shape;
  float* host = nullptr;
};

// For tensors that live where the runtime cannot read them: indices are positions in the
// registered list. Leave both empty when the host buffers are the tensors themselves.
struct HostSync {
  std::function<void(std::span<const uint32_t> tensors)> to_host;    // before the runtime reads them
  std::function<void(std::span<const uint32_t> tensors)> from_host;  // after the runtime wrote them
};

struct RuntimeOptions {
  RunConfig config;
  LearnerMode mode = LearnerMode::Train;
  std::string learner_id = "learner-0";
  std::string region = "region0";
  KafkaOptions kafka;
  std::vector<std::string> merger_endpoints;  // in addition to those announced in `members`
  // With diloco.stagger: this learner's index among `learners` shifts its schedule.
  uint32_t index = 0;
  uint32_t learners = 1;
  // The client's step budget when it knows it (0: unknown): a synchronous wait is skipped once the
  // budget is spent, as no further inner step would need the merge.
  int64_t steps = 0;
  // The shape of one inner step, announced in `members`: sequences per step and tokens per
  // sequence (0: not declared). Mergers refuse a delta of this learner that claims more than
  // inner_steps x batch x context tokens, and step() refuses a report of more than batch x context
  // tokens; learners of different batch sizes share a run, each weighted by its real tokens.
  uint32_t batch = 0;
  uint32_t context = 0;
  double heartbeat_interval_s = 2;
  int log_every = 10;          // steps between `step` lines in metrics.jsonl
  std::string run_dir;         // metrics.jsonl goes here (created if missing; empty: no file)
  int metrics_port = 0;        // Prometheus endpoint on 127.0.0.1 (0: off)
  std::string client = "diloco-learner";  // who drives the runtime, in the start event
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
  // Another process announcing this learner id within merger.liveness_seconds holds it, unless
  // no newer announcement of it arrives for this long (a killed process announces nothing more):
  // start() then goes on, otherwise it refuses with an error naming the id.
  double id_claim_wait_s = 5;
  std::chrono::milliseconds shutdown_flush{10000};
  // Polled about every 10 ms in every wait (the broker, genesis, the versions of a restart, a
  // synchronous merge): true ends the wait. start() then returns false; step() returns.
  std::function<bool()> should_stop;
  // The fragments this learner takes part in (empty: all of them). A learner of some fragments
  // proposes, cuts, adopts and announces only those, holds no state for the others, and needs host
  // buffers only for the tensors they hold (the others' may be null). For measuring a few
  // fragments of a model too large for one machine (bench/scale.sh --only); a run trains every
  // fragment only if every fragment has a learner.
  std::vector<uint32_t> fragments;
  // A directory where each fragment's error-feedback residual and values at its last cut are kept
  // (8 bytes per parameter, in unlinked files: nothing is left there when the process ends) and
  // read a range at a time, instead of memory; empty: in memory. For fragments larger than the
  // host's memory allows (docs/operations.md, "Memory per process"): a cut then writes its values
  // to the directory, and a cut and an adoption read the residual back.
  std::string spill_dir;
};

// What a client tells the runtime about one inner step.
struct StepReport {
  uint64_t tokens = 0;             // tokens the step trained on (a delta's weight counts them)
  std::optional<float> loss;       // the step's training loss, if the client has it
  // Seconds of compute the step took; default: since the previous step() returned (or since
  // start()), which counts whatever the client did in between.
  std::optional<double> seconds;
};

class LearnerRuntime {
 public:
  // Computes the fragment layout and fingerprint from the tensors (partition_tensors over
  // config.diloco.fragments) and checks the config and every buffer. No I/O. Throws
  // InvalidInput naming the tensor or setting (a null buffer, a bad name or shape, too few
  // tensors for the fragments, messages too large for Kafka).
  LearnerRuntime(RuntimeOptions options, std::vector<RegisteredTensor> tensors, HostSync sync = {});
  ~LearnerRuntime();  // close()s with its bounded flush if the client did not
  LearnerRuntime(const LearnerRuntime&) = delete;
  LearnerRuntime& operator=(const LearnerRuntime&) = delete;

  // Joins the run: waits for the broker (kafka.connect_timeout_ms), refuses a learner id another
  // live process holds, reads the run's newest state; if the run has no version 0 yet, proposes
  // this learner's tensors as version 0 and waits for the mergers to commit it; writes the
  // run's parameters into the buffers; finds where a restarted learner continues (step_count())
  // and waits for the versions its mergers announce. Standalone: nothing but the metrics.
  // Returns false when should_stop ended a wait first (nothing was trained; close() still
  // applies). Throws InvalidInput when the run holds another model (the message names the first
  // tensor that differs) or when a merger rejected this learner's proposal (with its reason),
  // Unavailable when the broker does not answer or version 0 does not come within
  // genesis_timeout.
  bool start();

  // One inner step done: see the file comment. Call after the optimizer step, with no other call
  // of the runtime running. Throws InternalError before start() or after close(), InvalidInput
  // (counting nothing) for 0 tokens or more than the declared batch x context.
  void step(const StepReport& report);
  // Between steps, or all the time in EvalOnly mode: adopts the versions that arrived and sends a
  // heartbeat when due. Returns how many fragments took a new version.
  size_t poll();
  // A held-out evaluation the client made: an `eval` line (`global_eval` in EvalOnly mode, with
  // the versions evaluated) in metrics.jsonl and the eval_loss gauge.
  void record_eval(double loss);
  // Stops: a `stop` line, the last heartbeat (with the real step, and `leaving`), then up to
  // shutdown_flush for the deltas in flight, and a `shutdown` line naming any not delivered.
  // `reason`: "budget", "signal", "error"... Idempotent.
  void close(std::string_view reason = "budget");

  const FragmentLayout& layout() const;
  uint64_t fingerprint() const;
  const RuntimeOptions& options() const;
  bool started() const;
  bool closed() const;
  // Inner steps done: from the resume point of a restart, plus one per step().
  uint64_t step_count() const;
  uint64_t tokens() const;
  // The global version each fragment's parameters come from.
  std::vector<uint64_t> versions() const;
  // The registered tensors fragment p holds (whole or some of their rows), as positions in the
  // registered list, each once, in that order.
  std::vector<uint32_t> fragment_tensors(uint32_t p) const;
  Metrics& metrics();
  // One line into metrics.jsonl, with t, time_us and the learner id added.
  void log(nlohmann::json record);

  // What a restart needs to continue with its local progress (its own model and optimizer state
  // saved beside it): every fragment's base version, anchor, residuals, counters and cut point,
  // the step and token counts and the delta sequence numbers, as bytes. load_state() takes them
  // back after start() (the versions that arrived since are adopted at the next step, rebased
  // onto the restored progress); it throws InvalidInput for bytes of another run, model or
  // learner, or corrupt bytes.
  std::vector<uint8_t> save_state() const;
  void load_state(std::span<const uint8_t> bytes);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace diloco
