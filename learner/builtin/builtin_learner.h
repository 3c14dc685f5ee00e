// diloco-learner's client of the learner runtime: the built-in libtorch character transformer
// (core/model/transformer.h) on the King James Bible, trained with AdamW. The model's parameters
// are contiguous fp32 CPU tensors, so they are the runtime's host buffers themselves: a cut reads
// them and an adoption writes them in place, with no copy on either side.
#pragma once

#include <atomic>
#include <string>
#include <vector>

#include "learner/runtime.h"

namespace diloco {

struct BuiltinLearnerOptions {
  RuntimeOptions runtime;     // config, mode, id, region, Kafka, metrics, ...
  std::vector<std::string> regions = {"region0"};  // every region of the run (data split by region)
  double speed_factor = 1.0;  // > 1 slows each step by that factor (emulates older hardware)
  int64_t steps = 0;          // stop after this many inner steps (0: config.train.total_steps)
  double max_seconds = 0;     // stop after this long (0: no limit)
  double eval_interval_s = 10;  // EvalOnly: seconds between evaluations of the global model
  std::string export_path;    // model file written at stop; EvalOnly: also after each evaluation
};

// Runs until the step budget, the time budget or `stop` (set by a signal handler). Returns the
// process exit code: 0 on a clean stop. Throws InvalidInput / Unavailable with a message naming
// the problem for bad configs, a missing corpus, another model in the run or no broker.
int run_builtin_learner(const BuiltinLearnerOptions& options, const std::atomic<bool>& stop);

}  // namespace diloco
