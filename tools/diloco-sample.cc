// diloco-sample: generates text from a model file (the final global model of a run, written by
// the --eval-only learner as <run folder>/final_model.safetensors, any learner's --export, or
// diloco-replay rebuild).
#include <CLI/CLI.hpp>

#include <iostream>
#include <optional>
#include <random>

#include "core/config/run_config.h"
#include "core/data/corpus.h"
#include "core/errors.h"
#include "core/model/cpu_runtime.h"
#include "core/train/model_file.h"

using namespace diloco;

namespace {

struct SampleOptions {
  std::string prompt = "And God said";
  int length = 400;
  double temperature = 0.8;
  uint64_t seed = 1;
};

// Autoregressive sampling, one character at a time, over the last `context` characters.
std::string sample(const Transformer& model, const SampleOptions& o) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> tokens;
  for (char c : o.prompt) tokens.push_back(encode_char(c));
  std::mt19937_64 rng(o.seed);
  std::string out = o.prompt;
  const auto context = static_cast<size_t>(model.options().context);
  for (int i = 0; i < o.length; ++i) {
    size_t start = tokens.size() > context ? tokens.size() - context : 0;
    std::vector<int64_t> window(tokens.begin() + static_cast<std::ptrdiff_t>(start), tokens.end());
    auto input = torch::tensor(window, torch::kInt64).unsqueeze(0);
    auto logits = model.logits(input)[0][-1];
    int64_t next = 0;
    if (o.temperature <= 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      auto probs = torch::softmax(logits.to(torch::kFloat64) / o.temperature, 0).contiguous();
      const double* p = probs.data_ptr<double>();
      std::discrete_distribution<int64_t> pick(p, p + probs.numel());
      next = pick(rng);
    }
    tokens.push_back(next);
    out.push_back(decode_token(next));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "diloco-sample: generates text from a trained model, so you can see what it learned.\n"
      "The model file is the one scripts/run-local leaves in the run folder (final_model.safetensors),\n"
      "any file written by diloco-learner --export, or a version rebuilt by diloco-replay rebuild.\n"};
  std::string model_file, config_file;
  std::vector<std::string> overrides;
  SampleOptions o;
  bool show_info = false;
  app.add_option("model", model_file, "model file, e.g. runs/<run>/final_model.safetensors")->required();
  app.add_option("-c,--config", config_file,
                 "run config whose [model] gives the architecture, for a file that does not name it");
  app.add_option("-s,--set", overrides, "override a config value: section.key=value (repeatable)");
  app.add_option("-p,--prompt", o.prompt, "text to continue (printable ASCII and newlines)")->capture_default_str();
  app.add_option("-n,--length", o.length, "characters to generate")->capture_default_str()->check(CLI::Range(0, 1000000));
  app.add_option("-t,--temperature", o.temperature, "sampling temperature: 0 picks the likeliest character, 1 samples the model as is")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 10.0));
  app.add_option("--seed", o.seed, "random seed (the same seed gives the same text)")->capture_default_str();
  app.add_flag("--info", show_info, "print where the model came from (run, versions, held-out loss) before the text");
  CLI11_PARSE(app, argc, argv);
  try {
    set_torch_threads(1);
    std::optional<ModelOptions> fallback;
    if (!config_file.empty()) fallback = model_options(load_run_config(config_file, overrides).model, kVocabSize);
    LoadedModel loaded = load_model_file(model_file, fallback ? &*fallback : nullptr);
    if (show_info) std::cout << "# " << loaded.info.dump() << "\n";
    std::cout << sample(loaded.model, o) << "\n";
    return 0;
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
