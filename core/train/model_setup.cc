#include "core/train/model_setup.h"

#include "core/fragments/partition.h"

namespace diloco {

ModelSetup build_model(const RunConfig& config) {
  ModelOptions options = model_options(config.model, kVocabSize);
  Transformer model(options, config.run.seed);
  auto specs = model.tensor_specs();
  FragmentLayout layout = partition_tensors(specs, config.diloco.fragments, architecture(options));
  return ModelSetup{std::move(model), std::move(layout)};
}

std::vector<DenseTensor> fragment_tensors(const Transformer& model, const FragmentLayout& layout, uint32_t p) {
  auto values = copy_fragment(model, layout, p);
  std::vector<DenseTensor> out;
  out.reserve(values.size());
  for (uint32_t i = 0; i < values.size(); ++i)
    out.push_back(DenseTensor{i, layout.fragments[p][i].shape, std::move(values[i])});
  return out;
}

void load_fragment(Transformer& model, const FragmentLayout& layout, uint32_t p,
                   const std::vector<DenseTensor>& tensors) {
  std::vector<std::vector<float>> values;
  values.reserve(tensors.size());
  for (const auto& t : tensors) values.push_back(t.values);
  write_fragment(model, layout, p, values);
}

FragmentState genesis_state(const RunConfig& config, const ModelSetup& setup, uint32_t p) {
  FragmentState state;
  state.run_id = config.run.id;
  state.fingerprint = setup.layout.fingerprint;
  state.fragment = p;
  state.version = 0;
  state.params = fragment_tensors(setup.model, setup.layout, p);
  state.momentum = state.params;
  for (auto& t : state.momentum) std::fill(t.values.begin(), t.values.end(), 0.0f);
  const auto optimizer = parse_outer_optimizer(config.merger.optimizer);
  if (optimizer && has_outer_state(*optimizer)) state.outer_state = state.momentum;
  state.checksum = checksum_fp32(state.params);
  return state;
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
