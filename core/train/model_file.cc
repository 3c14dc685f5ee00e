#include "core/train/model_file.h"

#include <fstream>

#include "core/errors.h"

namespace diloco {

namespace {

std::vector<int64_t> options_vector(const ModelOptions& o) { return {o.vocab, o.layers, o.width, o.heads, o.context}; }

template <typename... Args>
void require(bool condition, const Args&... message) {
  if (!condition) throw InvalidInput(detail::concat(message...));
}

}  // namespace

void save_model_file(const std::filesystem::path& path, const Transformer& model, const nlohmann::json& info) {
  c10::Dict<std::string, torch::Tensor> parameters;
  const auto& names = model.parameter_names();
  for (size_t i = 0; i < names.size(); ++i) parameters.insert(names[i], model.parameters()[i].detach().clone());
  torch::serialize::OutputArchive archive;
  archive.write("tensors", c10::IValue(parameters));
  archive.write("options", torch::tensor(options_vector(model.options()), torch::kInt64));
  archive.write("info", c10::IValue(info.dump()));
  save_archive(archive, path);
}

void save_archive(torch::serialize::OutputArchive& archive, const std::filesystem::path& path) {
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  try {
    if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
    archive.save_to(tmp.string());
    std::filesystem::rename(tmp, path);
  } catch (const std::exception& e) {
    throw IoError("cannot write " + path.string() + ": " + e.what());
  }
}

LoadedModel load_model_file(const std::filesystem::path& path) {
  require(std::filesystem::exists(path), "no model file ", path,
          " (a run folder keeps it as final_model.pt; the --eval-only learner writes it with --export)");
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path.string());
  } catch (const c10::Error& e) {
    throw InvalidInput("cannot read model file " + path.string() + ": not a libtorch archive (" + e.what_without_backtrace() + ")");
  }
  try {
    torch::Tensor options_tensor;
    archive.read("options", options_tensor);
    require(options_tensor.dim() == 1 && options_tensor.numel() == 5, "the options tensor is not 5 integers");
    auto o = options_tensor.to(torch::kInt64).contiguous();
    const int64_t* v = o.data_ptr<int64_t>();
    ModelOptions options{.vocab = v[0], .layers = v[1], .width = v[2], .heads = v[3], .context = v[4]};
    Transformer model(options, 0);
    c10::IValue parameters_value, info_value;
    archive.read("tensors", parameters_value);
    archive.read("info", info_value);
    auto parameters = parameters_value.toGenericDict();
    torch::NoGradGuard no_grad;
    const auto& names = model.parameter_names();
    require(parameters.size() == names.size(), "holds ", parameters.size(), " tensors, the architecture has ", names.size());
    for (size_t i = 0; i < names.size(); ++i) {
      auto it = parameters.find(names[i]);
      require(it != parameters.end(), "tensor ", names[i], " is missing");
      torch::Tensor t = it->value().toTensor();
      require(t.sizes() == model.parameters()[i].sizes(), "tensor ", names[i], " has shape ", t.sizes(),
              ", the architecture says ", model.parameters()[i].sizes());
      model.parameters()[i].copy_(t);
    }
    return LoadedModel{std::move(model), nlohmann::json::parse(info_value.toStringRef())};
  } catch (const InvalidInput& e) {
    throw InvalidInput("model file " + path.string() + ": " + e.what());
  } catch (const std::exception& e) {
    throw InvalidInput("model file " + path.string() + " is not a diloco model file: " + e.what());
  }
}

}  // namespace diloco
