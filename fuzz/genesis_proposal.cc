// decode_genesis_proposal on a learner's proposal of version 0, with the reader's layout and with
// the one the proposal carries. An accepted proposal must survive encode_genesis_proposal and
// decoding again bit for bit.
#include "core/codec/messages.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return message_target(
      data, size, Layout::Optional, "GenesisProposal", decode_genesis_proposal,
      [](const GenesisProposal& p) { return encode_genesis_proposal(with_run_layout(p)); },
      [](const GenesisProposal& p, const DecodeLimits& limits) {
        expect_carried_layout(p, limits);
        expect(p.checksum == checksum_fp32(p.tensors), "a proposal accepted with another checksum");
      });
}
