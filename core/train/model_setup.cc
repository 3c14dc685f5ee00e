#include "core/train/model_setup.h"

#include "core/errors.h"
#include "core/fragments/partition.h"

namespace diloco {

ModelSetup build_model(const RunConfig& config) {
  ModelOptions options = model_options(config.model, kVocabSize);
  Transformer model(options, config.run.seed);
  auto specs = model.tensor_specs();
  FragmentLayout layout = partition_tensors(specs, config.diloco.fragments, architecture(options));
  return ModelSetup{std::move(model), std::move(layout)};
}

FragmentLayout build_layout(const RunConfig& config) {
  ModelOptions options = model_options(config.model, kVocabSize);
  const auto specs = Transformer::specs(options);
  return partition_tensors(specs, config.diloco.fragments, architecture(options));
}

std::map<uint32_t, std::vector<DenseTensor>> seeded_fragments(const RunConfig& config, const FragmentLayout& layout,
                                                              std::span<const uint32_t> fragments) {
  const ModelOptions options = model_options(config.model, kVocabSize);
  // Where each tensor of the model's list goes: (fragment, index in the fragment), for those wanted.
  std::map<std::string, std::pair<uint32_t, uint32_t>> wanted;
  std::map<uint32_t, std::vector<DenseTensor>> out;
  for (uint32_t p : fragments) {
    if (p >= layout.num_fragments())
      throw InvalidInput(detail::concat("fragment ", p, " is not in the layout (", layout.num_fragments(), " fragments)"));
    auto& tensors = out[p];
    tensors.clear();
    for (uint32_t i = 0; i < layout.fragments[p].size(); ++i) {
      const auto& spec = layout.fragments[p][i];
      tensors.push_back(DenseTensor{i, spec.shape, std::vector<float>(static_cast<size_t>(spec.numel()))});
      wanted[spec.name] = {p, i};
    }
  }
  torch::Tensor scratch;  // for the tensors not wanted, which still advance the generator
  Transformer::initialise_in_order(options, config.run.seed, [&](size_t, const TensorSpec& spec) {
    auto it = wanted.find(spec.name);
    if (it == wanted.end()) {
      if (scratch.numel() < spec.numel()) scratch = torch::empty({spec.numel()}, torch::kFloat32);
      return scratch.narrow(0, 0, spec.numel()).view(spec.shape);
    }
    auto& values = out[it->second.first][it->second.second].values;
    return torch::from_blob(values.data(), spec.shape, torch::kFloat32);
  });
  return out;
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
  return genesis_state(config, setup.layout, p, fragment_tensors(setup.model, setup.layout, p));
}

FragmentState genesis_state(const RunConfig& config, const FragmentLayout& layout, uint32_t p,
                            std::vector<DenseTensor> params) {
  FragmentState state;
  state.run_id = config.run.id;
  state.fingerprint = layout.fingerprint;
  state.fragment = p;
  state.version = 0;
  state.params = std::move(params);
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
