#include "core/train/model_setup.h"

namespace diloco {

ModelSetup build_model(const RunConfig& config) {
  Transformer model(model_options(config.model), config.run.seed);
  return ModelSetup{std::move(model), builtin_layout(config)};
}

double heldout_loss(const Transformer& model, BatchStream& heldout, int64_t batches) {
  torch::NoGradGuard no_grad;
  heldout.restore({});
  double total = 0;
  for (int64_t i = 0; i < batches; ++i) {
    Batch b = heldout.next();
    total += model.loss(b.input, b.target).item<double>();
  }
  return batches > 0 ? total / static_cast<double>(batches) : 0.0;
}

}  // namespace diloco
