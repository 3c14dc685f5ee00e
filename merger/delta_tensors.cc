#include "merger/delta_tensors.h"

#include <algorithm>

#include "core/errors.h"

namespace diloco {

namespace {

// The number of values of `q`, once its payload and scales are checked to hold exactly that many.
size_t checked_values(const QuantizedTensor& q) {
  const int64_t n = q.numel();
  if (n < 0 || q.payload.size() != payload_bytes(q.dtype, n) ||
      q.scales.size() != num_blocks(q.dtype, q.block_size, n))
    throw InvalidInput(detail::concat("quantized tensor ", q.index, " (", dtype_name(q.dtype), ") of ", n,
                                      " values has ", q.payload.size(), " payload bytes and ", q.scales.size(),
                                      " scales"));
  return static_cast<size_t>(n);
}

}  // namespace

TensorReader::TensorReader(const QuantizedTensor& q) : quantized_(&q), size_(checked_values(q)) {}

std::span<const float> TensorReader::read(size_t begin, size_t end, std::vector<float>& scratch) const {
  DILOCO_ENFORCE(begin <= end && end <= size_, "read [", begin, ", ", end, ") of a tensor of ", size_, " values");
  if (!quantized_) return values_.subspan(begin, end - begin);
  const QuantizedTensor& q = *quantized_;
  // From the start of the pair of blocks holding `begin` (a whole INT4 byte, a whole scale).
  const size_t align = feedback_alignment(q.dtype, q.block_size);
  const size_t start = begin - begin % align;
  const size_t len = end - start;
  if (scratch.size() < len) scratch.resize(len);
  const size_t first_block = q.block_size ? start / q.block_size : 0;
  const auto n = static_cast<int64_t>(len);
  dequantize_into(q.dtype, q.block_size,
                  std::span<const float>(q.scales).subspan(first_block, num_blocks(q.dtype, q.block_size, n)),
                  std::span<const uint8_t>(q.payload)
                      .subspan(payload_bytes(q.dtype, static_cast<int64_t>(start)), payload_bytes(q.dtype, n)),
                  std::span<float>(scratch.data(), len));
  return {scratch.data() + (begin - start), end - begin};
}

DeltaTensors::DeltaTensors(Delta&& delta) {
  if (!delta.quantized.empty())
    quantized = std::move(delta.quantized);
  else
    dense = std::move(delta.tensors);
}

size_t DeltaTensors::bytes() const {
  size_t total = 0;
  for (const auto& t : dense) total += t.values.size() * sizeof(float);
  for (const auto& q : quantized) total += q.payload.size() + q.scales.size() * sizeof(float);
  return total;
}

DeltaView::DeltaView(const DeltaTensors& tensors) : dense_(tensors.dense), quantized_(tensors.quantized) {}

DeltaView::DeltaView(const Delta& delta) : dense_(delta.tensors), quantized_(delta.quantized) {}

const std::vector<int64_t>& DeltaView::shape(size_t t) const {
  return quantized_.empty() ? dense_[t].shape : quantized_[t].shape;
}

size_t DeltaView::values(size_t t) const {
  return quantized_.empty() ? dense_[t].values.size() : checked_values(quantized_[t]);
}

TensorReader DeltaView::tensor(size_t t) const {
  return quantized_.empty() ? TensorReader(dense_[t].values) : TensorReader(quantized_[t]);
}

}  // namespace diloco
