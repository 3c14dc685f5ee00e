#include "tools/replay/tensor_file.h"

#include <torch/torch.h>

#include "core/errors.h"
#include "core/train/model_file.h"

namespace diloco {

void save_tensor_archive(const std::filesystem::path& path, const std::string& key,
                         std::span<const DenseTensor> tensors, std::span<const TensorSpec> layout,
                         const nlohmann::json& info) {
  c10::Dict<std::string, torch::Tensor> dict;
  for (const auto& t : tensors) {
    DILOCO_ENFORCE(t.index < layout.size(), "tensor index ", t.index, " outside a layout of ", layout.size());
    auto values = torch::from_blob(const_cast<float*>(t.values.data()), t.shape, torch::kFloat32);
    dict.insert(layout[t.index].name, values.clone());
  }
  torch::serialize::OutputArchive archive;
  archive.write(key, c10::IValue(dict));
  archive.write("info", c10::IValue(info.dump()));
  save_archive(archive, path);
}

}  // namespace diloco
