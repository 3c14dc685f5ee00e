// diloco-eval: the held-out loss of a built-in model file (the final global model of a run,
// diloco-replay rebuild or remerge --out), on the held-out chapters of the run config's corpus,
// exactly as the learners and the evaluator measure it.
#include <CLI/CLI.hpp>

#include <iomanip>
#include <iostream>

#include <nlohmann/json.hpp>

#include "core/config/run_config.h"
#include "core/data/corpus.h"
#include "core/errors.h"
#include "core/model/cpu_runtime.h"
#include "core/train/model_file.h"
#include "core/train/model_setup.h"

using namespace diloco;

int main(int argc, char** argv) {
  CLI::App app{
      "diloco-eval: the held-out loss (nats/char) of a model file of the built-in model, over the held-out\n"
      "chapters of the run config's corpus (data.path, data.heldout_fraction), train.eval_batches batches of\n"
      "train.batch sequences: the number the evaluator reports for the global model.\n"};
  std::string model_file, config_file;
  std::vector<std::string> overrides;
  int64_t batches = -1;
  bool json = false;
  app.add_option("model", model_file, "model file (safetensors), e.g. runs/<run>/final_model.safetensors")->required();
  app.add_option("-c,--config", config_file, "the run config (TOML)")->required()->check(CLI::ExistingFile);
  app.add_option("-s,--set", overrides, "override a config value: section.key=value (repeatable)");
  app.add_option("--batches", batches, "held-out batches (default: train.eval_batches)");
  app.add_flag("--json", json, "print one JSON object");
  CLI11_PARSE(app, argc, argv);
  try {
    set_torch_threads(1);
    const RunConfig config = load_run_config(config_file, overrides);
    const ModelOptions fallback = model_options(config.model);
    LoadedModel loaded = load_model_file(model_file, &fallback);
    Corpus corpus = load_corpus(config.data.path);
    BatchStream heldout = heldout_batches(corpus, config.data, config.train.batch, loaded.model.options().context);
    const int64_t n = batches >= 0 ? batches : config.train.eval_batches;
    const double loss = heldout_loss(loaded.model, heldout, n);
    if (json)
      std::cout << nlohmann::json{{"heldout_loss", loss}, {"batches", n}, {"model", model_file}}.dump() << "\n";
    else
      std::cout << std::fixed << std::setprecision(4) << "held-out loss " << loss << " nats/char over " << n
                << " batches\n";
    return 0;
  } catch (const Error& e) {
    std::cerr << "diloco-eval: error: " << e.what() << "\n";
    return 1;
  }
}
