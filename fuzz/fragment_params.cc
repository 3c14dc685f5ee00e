// decode_fragment_params on a merger's version of a fragment (a snapshot or an update). An
// accepted one must survive encoding again (a snapshot as encode_fragment_params writes it, an
// update with its dequantized change sent as fp32) bit for bit.
#include "core/codec/messages.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

namespace {

std::vector<uint8_t> encode(const FragmentParams& m) {
  if (!m.update) return encode_fragment_params(m);
  std::vector<QuantizedTensor> change;
  for (const auto& t : m.tensors) change.push_back(quantize(t.index, t.shape, t.values, DType::F32, 0));
  return encode_fragment_update(m, change, CodecOptions{.dtype = DType::F32, .byte_shuffle = true});
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Tensors need the layout.
  return message_target(data, size, Layout::Required, "FragmentParams", decode_fragment_params, encode,
                        [](const FragmentParams& m, const DecodeLimits&) {
                          expect(m.update || m.checksum == checksum_fp32(m.tensors),
                                 "a snapshot accepted with another checksum");
                        });
}
