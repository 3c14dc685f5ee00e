// FragmentStateAssembler (core/codec/messages.h), which reads a streamed checkpoint's segments
// into place: a log of messages, each [2-byte length, little endian][bytes], fed in order, read
// with the run's layout (first byte even) or with the one segment 0 carries (odd). Whatever comes
// out must hold the fragment's tensors whole with the checksum it declares, and must stream again
// (segments of the size the first byte picks) and come back bit for bit.
#include "core/codec/messages.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  const DecodeLimits& limits = fuzz::limits((mode & 1) == 0);
  FragmentStateAssembler assembler(limits);
  for_each_logged(data + 1, size - 1, [&](std::span<const uint8_t> bytes) {
    std::optional<FragmentState> state;
    try {
      state = assembler.add(bytes);
    } catch (const Rejection&) {
      expect(!assembler.pending(), "a rejection left a checkpoint begun");
      return;
    }
    if (!state) {
      expect(assembler.pending(), "a segment taken without a checkpoint begun");
      return;
    }
    expect(!assembler.pending(), "a checkpoint handed on while still begun");
    expect(state->checksum == checksum_fp32(state->params), "a checkpoint accepted with another checksum");
    expect_carried_layout(*state, limits);
    const FragmentState again_in = with_run_layout(*state);
    FragmentStateAssembler again(limits);
    std::optional<FragmentState> back;
    const uint64_t segment_bytes = 16 + (mode >> 1) * 16;
    for_each_fragment_state_segment(again_in, segment_bytes, 1,
                                    [&](uint32_t, uint32_t, std::span<const uint8_t> segment) {
                                      back = must_accept([&] { return again.add(segment); }, "a re-streamed checkpoint");
                                    });
    expect(back.has_value(), "a re-streamed checkpoint did not come back");
    expect(back->version == state->version && back->params.size() == state->params.size(),
           "a re-streamed checkpoint came back another");
    for (size_t k = 0; k < state->params.size(); ++k)
      expect(same_bits(back->params[k].values, state->params[k].values), "a re-streamed checkpoint changed its values");
  });
  return 0;
}
