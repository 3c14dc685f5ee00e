#include "core/train/model_file.h"

#include "core/errors.h"
#include "core/files/safetensors.h"

namespace diloco {

namespace {

template <typename... Args>
void require(bool condition, const Args&... message) {
  if (!condition) throw InvalidInput(detail::concat(message...));
}

}  // namespace

nlohmann::json model_options_json(const ModelOptions& o) {
  return {{"vocab", o.vocab}, {"layers", o.layers}, {"width", o.width}, {"heads", o.heads}, {"context", o.context}};
}

void save_model_file(const std::filesystem::path& path, const Transformer& model, const nlohmann::json& info) {
  std::vector<NamedTensor> tensors;
  const auto& names = model.parameter_names();
  for (size_t i = 0; i < names.size(); ++i) {
    torch::Tensor t = model.parameters()[i].detach().contiguous();
    tensors.push_back(NamedTensor{names[i], t.sizes().vec(),
                                  std::vector<float>(t.data_ptr<float>(), t.data_ptr<float>() + t.numel())});
  }
  save_safetensors(path, tensors, {{"model", model_options_json(model.options()).dump()}, {"info", info.dump()}});
}

LoadedModel load_model_file(const std::filesystem::path& path, const ModelOptions* fallback) {
  require(std::filesystem::exists(path), "no model file ", path,
          " (a run folder keeps it as final_model.safetensors; the --eval-only learner writes it with --export)");
  SafetensorsFile file = load_safetensors(path);
  try {
    ModelOptions options;
    if (auto it = file.metadata.find("model"); it != file.metadata.end()) {
      const auto m = nlohmann::json::parse(it->second);
      options = ModelOptions{.vocab = m.at("vocab"), .layers = m.at("layers"), .width = m.at("width"),
                             .heads = m.at("heads"), .context = m.at("context")};
    } else {
      require(fallback != nullptr, "no \"model\" entry in its metadata: give the run's config (-c) for the architecture");
      options = *fallback;
    }
    Transformer model(options, 0);
    std::map<std::string, const NamedTensor*> by_name;
    for (const auto& t : file.tensors) by_name[t.name] = &t;
    torch::NoGradGuard no_grad;
    const auto& names = model.parameter_names();
    require(file.tensors.size() == names.size(), "holds ", file.tensors.size(), " tensors, the architecture has ",
            names.size());
    for (size_t i = 0; i < names.size(); ++i) {
      auto it = by_name.find(names[i]);
      require(it != by_name.end(), "tensor ", names[i], " is missing");
      const auto& want = model.parameters()[i];
      require(it->second->shape == want.sizes().vec(), "tensor ", names[i], " has another shape than the architecture's");
      want.copy_(torch::from_blob(const_cast<float*>(it->second->values.data()), want.sizes(), torch::kFloat32));
    }
    nlohmann::json info = nlohmann::json::object();
    if (auto it = file.metadata.find("info"); it != file.metadata.end()) info = nlohmann::json::parse(it->second);
    return LoadedModel{std::move(model), std::move(info)};
  } catch (const InvalidInput& e) {
    throw InvalidInput("model file " + path.string() + ": " + e.what());
  } catch (const std::exception& e) {
    throw InvalidInput("model file " + path.string() + " is not a diloco model file: " + e.what());
  }
}

}  // namespace diloco
