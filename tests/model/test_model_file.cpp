// The built-in model's file (core/train/model_file.h): a safetensors file of its parameters by
// name with the architecture and facts about the run in its metadata; it comes back bit for bit,
// any safetensors reader sees the names and shapes, and a file of another architecture is refused.
#include <catch2/catch.hpp>
#include <unistd.h>

#include <filesystem>

#include "core/errors.h"
#include "core/files/safetensors.h"
#include "core/train/model_file.h"

using namespace diloco;
using Catch::Matchers::Contains;

namespace {

const ModelOptions kSmall{.vocab = 96, .layers = 2, .width = 16, .heads = 4, .context = 8};

struct TempFile {
  std::filesystem::path path = std::filesystem::temp_directory_path() /
                               ("diloco-model-file-" + std::to_string(::getpid()) + "-" +
                                std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()) +
                                ".safetensors");
  ~TempFile() { std::filesystem::remove(path); }
};

bool same_parameters(const Transformer& a, const Transformer& b) {
  if (a.parameters().size() != b.parameters().size()) return false;
  for (size_t i = 0; i < a.parameters().size(); ++i)
    if (!torch::equal(a.parameters()[i], b.parameters()[i])) return false;
  return true;
}

std::string refusal(const std::filesystem::path& path, const ModelOptions* fallback = nullptr) {
  try {
    (void)load_model_file(path, fallback);
  } catch (const InvalidInput& e) {
    return e.what();
  }
  return "accepted";
}

}  // namespace

TEST_CASE("a model file gives back the model bit for bit, with its architecture and info", "[model_file]") {
  TempFile file;
  const Transformer model(kSmall, 42);
  save_model_file(file.path, model, {{"run_id", "r1"}, {"versions", {3, 4}}});
  const LoadedModel loaded = load_model_file(file.path);
  CHECK(loaded.model.options().layers == kSmall.layers);
  CHECK(loaded.model.options().width == kSmall.width);
  CHECK(loaded.model.options().heads == kSmall.heads);
  CHECK(loaded.model.options().context == kSmall.context);
  CHECK(same_parameters(loaded.model, model));
  CHECK(loaded.info["run_id"] == "r1");
  CHECK(loaded.info["versions"] == nlohmann::json{3, 4});
}

TEST_CASE("a model file is plain safetensors: the parameters by name and shape", "[model_file]") {
  TempFile file;
  const Transformer model(kSmall, 42);
  save_model_file(file.path, model, nlohmann::json::object());
  const SafetensorsFile raw = load_safetensors(file.path);
  REQUIRE(raw.tensors.size() == model.parameters().size());
  for (size_t i = 0; i < raw.tensors.size(); ++i) {
    INFO(model.parameter_names()[i]);
    CHECK(raw.tensors[i].name == model.parameter_names()[i]);
    CHECK(raw.tensors[i].shape == model.parameters()[i].sizes().vec());
    const torch::Tensor t = model.parameters()[i].detach().contiguous();
    CHECK(raw.tensors[i].values == std::vector<float>(t.data_ptr<float>(), t.data_ptr<float>() + t.numel()));
  }
  CHECK(nlohmann::json::parse(raw.metadata.at("model"))["width"] == kSmall.width);
}

TEST_CASE("a file without the architecture takes the given one, and is refused without", "[model_file]") {
  TempFile file;
  const Transformer model(kSmall, 5);
  std::vector<NamedTensor> tensors;
  for (size_t i = 0; i < model.parameters().size(); ++i) {
    const torch::Tensor t = model.parameters()[i].detach().contiguous();
    tensors.push_back({model.parameter_names()[i], t.sizes().vec(),
                       std::vector<float>(t.data_ptr<float>(), t.data_ptr<float>() + t.numel())});
  }
  save_safetensors(file.path, tensors);  // as diloco-replay rebuild writes a run of unknown architecture
  CHECK_THAT(refusal(file.path), Contains("give the run's config"));
  CHECK(same_parameters(load_model_file(file.path, &kSmall).model, model));
  auto wider = kSmall;
  wider.width = 32;
  CHECK_THAT(refusal(file.path, &wider), Contains(file.path.string()) && Contains("token_embedding"));
  tensors.pop_back();
  save_safetensors(file.path, tensors);
  CHECK_THAT(refusal(file.path, &kSmall), Contains("holds 28 tensors, the architecture has 29"));
}
