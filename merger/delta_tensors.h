// A delta's tensors as the merger holds and reads them. An INT8 or INT4 delta stays as it
// travelled (int4 in blocks of 128 values: 0.53 bytes per value, where fp32 takes 4), and a merge
// dequantizes only the range of a tensor it is working on, into a buffer of that range's size.
// Pending deltas, and the inputs recovery and replay gather for a merge, then take about the
// bytes that travelled instead of 8x as much.
//
// Dequantizing a range gives exactly the values decode_delta writes for it, so a merge of held
// tensors has the bits of a merge of the same deltas decoded to fp32.
#pragma once

#include <span>
#include <vector>

#include "core/codec/messages.h"

namespace diloco {

// One tensor of a delta, read range by range: fp32 values (a view), or a quantized tensor's
// blocks dequantized as they are read. Views only: the tensor must outlive the reader.
class TensorReader {
 public:
  TensorReader() = default;
  TensorReader(std::span<const float> values) : values_(values), size_(values.size()) {}  // NOLINT
  explicit TensorReader(const QuantizedTensor& q);

  size_t size() const { return size_; }
  // Values [begin, end) (begin <= end <= size()): a view of the fp32 values, or that range
  // dequantized into `scratch` (grown as needed). Valid until `scratch` changes.
  std::span<const float> read(size_t begin, size_t end, std::vector<float>& scratch) const;

 private:
  std::span<const float> values_;
  const QuantizedTensor* quantized_ = nullptr;
  size_t size_ = 0;
};

// A delta's tensors, owned, in layout order: one of the two lists is filled.
struct DeltaTensors {
  std::vector<DenseTensor> dense;          // fp32 (F32 and BF16 deltas, and hand-made ones)
  std::vector<QuantizedTensor> quantized;  // INT8 and INT4 deltas, as they travelled

  DeltaTensors() = default;
  DeltaTensors(std::vector<DenseTensor> tensors) : dense(std::move(tensors)) {}          // NOLINT
  DeltaTensors(std::vector<QuantizedTensor> tensors) : quantized(std::move(tensors)) {}  // NOLINT
  // Whichever of a decoded delta's lists holds its tensors (decode_delta's DeltaValues).
  explicit DeltaTensors(Delta&& delta);

  // Bytes of values, scales and payloads: what holding the delta costs.
  size_t bytes() const;
};

// A view of a delta's tensors in layout order, dense or quantized; the tensors must outlive it.
class DeltaView {
 public:
  DeltaView() = default;
  DeltaView(std::span<const DenseTensor> dense) : dense_(dense) {}                   // NOLINT
  DeltaView(const std::vector<DenseTensor>& dense) : dense_(dense) {}                 // NOLINT
  DeltaView(std::span<const QuantizedTensor> quantized) : quantized_(quantized) {}   // NOLINT
  DeltaView(const std::vector<QuantizedTensor>& quantized) : quantized_(quantized) {}  // NOLINT
  DeltaView(const DeltaTensors& tensors);                                            // NOLINT
  DeltaView(const Delta& delta);                                                     // NOLINT

  size_t size() const { return quantized_.empty() ? dense_.size() : quantized_.size(); }
  const std::vector<int64_t>& shape(size_t t) const;
  // The number of values tensor t holds (what its payload or value list says).
  size_t values(size_t t) const;
  TensorReader tensor(size_t t) const;

 private:
  std::span<const DenseTensor> dense_;
  std::span<const QuantizedTensor> quantized_;
};

}  // namespace diloco
