#include "learner/builtin/builtin_learner.h"

#include <chrono>
#include <iostream>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/data/corpus.h"
#include "core/errors.h"
#include "core/fragments/message_budget.h"
#include "core/metrics/metrics.h"
#include "core/model/cpu_runtime.h"
#include "core/process.h"
#include "core/train/inner_optimizer.h"
#include "core/train/model_file.h"
#include "core/train/model_setup.h"

namespace diloco {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

uint32_t region_index(const BuiltinLearnerOptions& o) {
  for (uint32_t i = 0; i < o.regions.size(); ++i)
    if (o.regions[i] == o.runtime.region) return i;
  throw InvalidInput("region '" + o.runtime.region + "' is not in --regions");
}

std::vector<RegisteredTensor> registered(const Transformer& model) {
  std::vector<RegisteredTensor> out;
  for (size_t i = 0; i < model.parameters().size(); ++i) {
    const torch::Tensor& t = model.parameters()[i];
    out.push_back(RegisteredTensor{model.parameter_names()[i], t.sizes().vec(), t.data_ptr<float>()});
  }
  return out;
}

// A model whose messages cannot travel is refused before it is built: it may be large (the
// runtime checks the same once it has the tensors).
Transformer checked_model(const BuiltinLearnerOptions& o) {
  const RunConfig& config = o.runtime.config;
  if (o.runtime.mode != LearnerMode::Standalone)
    check_message_sizes(config, builtin_layout(config), o.runtime.kafka.max_message_bytes);
  return Transformer(model_options(config.model), config.run.seed);
}

class BuiltinLearner {
 public:
  BuiltinLearner(const BuiltinLearnerOptions& options, const std::atomic<bool>& stop)
      : o_(options), stop_(stop), model_(checked_model(options)), runtime_(runtime_options(), registered(model_)) {}

  int run();

 private:
  RuntimeOptions runtime_options() const {
    RuntimeOptions r = o_.runtime;
    r.steps = budget();
    r.batch = static_cast<uint32_t>(o_.runtime.config.train.batch);
    r.context = static_cast<uint32_t>(o_.runtime.config.model.context);
    r.should_stop = [this] { return stop_.load(); };
    return r;
  }
  int64_t budget() const { return o_.steps > 0 ? o_.steps : o_.runtime.config.train.total_steps; }
  bool out_of_budget() const {
    if (o_.runtime.mode != LearnerMode::EvalOnly && static_cast<int64_t>(runtime_.step_count()) >= budget()) return true;
    return o_.max_seconds > 0 && seconds_since(start_) >= o_.max_seconds;
  }
  void export_model(nlohmann::json info);
  int train();
  int evaluate_global();

  const BuiltinLearnerOptions& o_;
  const std::atomic<bool>& stop_;
  Transformer model_;
  LearnerRuntime runtime_;
  Clock::time_point start_ = Clock::now();
};

void BuiltinLearner::export_model(nlohmann::json info) {
  if (o_.export_path.empty()) return;
  info["run_id"] = o_.runtime.config.run.id;
  info["learner"] = o_.runtime.learner_id;
  info["mode"] = learner_mode_name(o_.runtime.mode);
  info["versions"] = runtime_.versions();
  info["fingerprint"] = runtime_.fingerprint();
  info["config"] = o_.runtime.config.source;
  info["time_us"] = unix_us();
  try {
    save_model_file(o_.export_path, model_, info);
    runtime_.log({{"event", "export"}, {"path", o_.export_path}, {"versions", runtime_.versions()}});
  } catch (const std::exception& e) {  // a full disk must not stop training or evaluation
    std::cerr << "learner " << o_.runtime.learner_id << ": could not write " << o_.export_path << ": " << e.what() << "\n";
  }
}

// EvalOnly: follows the global fragments and measures the global model's held-out loss every
// eval_interval_s, exporting it after each evaluation of new versions.
int BuiltinLearner::evaluate_global() {
  const auto& config = o_.runtime.config;
  Corpus corpus = load_corpus(config.data.path);
  BatchStream heldout = heldout_batches(corpus, config.data, config.train.batch, config.model.context);
  std::optional<std::vector<uint64_t>> evaluated;
  auto evaluate = [&] {
    const double loss = heldout_loss(model_, heldout, config.train.eval_batches);
    runtime_.record_eval(loss);
    nlohmann::json versions = runtime_.versions();
    std::cerr << "eval: global held-out loss " << loss << " at versions " << versions.dump() << "\n";
    if (evaluated != runtime_.versions()) export_model({{"heldout_loss", loss}});
    evaluated = runtime_.versions();
  };
  Clock::time_point last_eval{};
  while (!stop_ && !out_of_budget()) {
    // Evaluate before polling, so the first evaluation is of the versions the evaluator started from.
    if (seconds_since(last_eval) >= o_.eval_interval_s) {
      last_eval = Clock::now();
      evaluate();
    }
    runtime_.poll();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  // The last versions published before the stop: evaluate (and export) them too.
  runtime_.poll();
  if (evaluated != runtime_.versions()) evaluate();
  return 0;
}

int BuiltinLearner::train() {
  const auto& config = o_.runtime.config;
  const auto& train = config.train;
  Corpus corpus = load_corpus(config.data.path);
  ShardSpec shard{.learner = o_.runtime.index, .num_learners = o_.runtime.learners, .region = region_index(o_),
                  .num_regions = static_cast<uint32_t>(o_.regions.size())};
  BatchStream batches = training_batches(corpus, config.data, shard, train.batch, config.model.context, config.run.seed);
  BatchStream heldout = heldout_batches(corpus, config.data, train.batch, config.model.context);
  InnerOptimizer optimizer(model_.parameters(), inner_optimizer_options(train));
  const uint64_t tokens_per_step = static_cast<uint64_t>(train.batch * config.model.context);
  double loss_ema = 0;
  auto evaluate = [&] {
    const double eval = heldout_loss(model_, heldout, train.eval_batches);
    runtime_.record_eval(eval);
    std::cerr << "learner " << o_.runtime.learner_id << ": step " << runtime_.step_count() << " loss " << loss_ema
              << " held-out " << eval << " (" << static_cast<int>(runtime_.metrics().value("tokens_per_second"))
              << " tokens/s)\n";
  };
  if (train.eval_every > 0) evaluate();  // the starting point of every loss curve
  while (!stop_ && !out_of_budget()) {
    const auto t0 = Clock::now();
    Batch b = batches.next();
    torch::Tensor loss = model_.loss(b.input, b.target);
    loss.backward();
    optimizer.step(static_cast<int64_t>(runtime_.step_count()));
    optimizer.zero_grad();
    const float loss_value = loss.item<float>();
    if (o_.speed_factor > 1.0)
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds_since(t0) * (o_.speed_factor - 1.0)));
    runtime_.step({.tokens = tokens_per_step, .loss = loss_value, .seconds = seconds_since(t0)});
    loss_ema = loss_ema == 0 ? loss_value : 0.95 * loss_ema + 0.05 * loss_value;
    if (train.eval_every > 0 && runtime_.step_count() % static_cast<uint64_t>(train.eval_every) == 0) evaluate();
  }
  export_model({{"step", runtime_.step_count()}, {"tokens", runtime_.tokens()}});
  return 0;
}

int BuiltinLearner::run() {
  set_torch_threads(1);
  retain_freed_memory();
  if (!runtime_.start()) {
    runtime_.close("signal");
    return 0;
  }
  const int code = o_.runtime.mode == LearnerMode::EvalOnly ? evaluate_global() : train();
  runtime_.close(stop_ ? "signal" : "budget");
  return code;
}

}  // namespace

int run_builtin_learner(const BuiltinLearnerOptions& options, const std::atomic<bool>& stop) {
  BuiltinLearner learner(options, stop);
  return learner.run();
}

}  // namespace diloco
