// decode_fragment_state on a merger's checkpoint, with the reader's layout and with the one the
// checkpoint carries. An accepted checkpoint must survive encode_fragment_state and decoding again
// bit for bit.
#include "core/codec/messages.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return message_target(
      data, size, Layout::Optional, "FragmentState",
      +[](std::span<const uint8_t> bytes, const DecodeLimits& limits) { return decode_fragment_state(bytes, limits); },
      [](const FragmentState& s) { return encode_fragment_state(with_run_layout(s)); },
      [](const FragmentState& s, const DecodeLimits& limits) {
        expect_carried_layout(s, limits);
        expect(s.checksum == checksum_fp32(s.params), "a checkpoint accepted with another checksum");
      });
}
