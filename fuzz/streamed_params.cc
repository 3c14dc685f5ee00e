// FragmentParamsAssembler and GenesisProposalAssembler (core/codec/messages.h), which read
// streamed snapshots and proposals into place: a log of messages, each [2-byte length, little
// endian][bytes], fed in order. The first byte picks the reader: even, snapshots (with the run's
// layout); odd, proposals (with the run's layout when bit 1 is clear, else the one segment 0
// carries). Whatever comes out must hold its fragment's tensors whole with the checksum it
// declares (an update's names its result, checked when applied) and must stream again (segments
// of the size the first byte picks) and come back bit for bit.
#include "core/codec/messages.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

namespace {

void expect_same(const std::vector<DenseTensor>& a, const std::vector<DenseTensor>& b, const char* what) {
  expect(a.size() == b.size(), what);
  for (size_t k = 0; k < a.size() && k < b.size(); ++k) expect(same_bits(a[k].values, b[k].values), what);
}

void snapshots(const uint8_t* data, size_t size, uint64_t segment_bytes) {
  const DecodeLimits& limits = fuzz::limits(true);
  FragmentParamsAssembler assembler(limits);
  for_each_logged(data, size, [&](std::span<const uint8_t> bytes) {
    std::optional<FragmentParams> params;
    const size_t before = assembler.pending();
    try {
      params = assembler.add(bytes);
    } catch (const Rejection&) {
      expect(assembler.pending() <= before, "a rejection left a new snapshot begun");
      return;
    }
    if (!params) {
      expect(assembler.pending() >= 1, "a segment taken without a snapshot begun");
      return;
    }
    if (params->update) return;  // whole, as decode_fragment_params gives it (its own target)
    expect(params->checksum == checksum_fp32(params->tensors), "a snapshot accepted with another checksum");
    FragmentParamsAssembler again(limits);
    std::optional<FragmentParams> back;
    for_each_fragment_params_segment(*params, params->tensors, segment_bytes, 1,
                                     [&](uint32_t, uint32_t, std::span<const uint8_t> segment) {
                                       back = must_accept([&] { return again.add(segment); }, "a re-streamed snapshot");
                                     });
    expect(back.has_value() && back->version == params->version, "a re-streamed snapshot did not come back");
    if (back) expect_same(back->tensors, params->tensors, "a re-streamed snapshot changed its values");
  });
}

void proposals(const uint8_t* data, size_t size, bool run_layout, uint64_t segment_bytes) {
  const DecodeLimits& limits = fuzz::limits(run_layout);
  GenesisProposalAssembler assembler(limits, 4);
  for_each_logged(data, size, [&](std::span<const uint8_t> bytes) {
    std::optional<GenesisProposal> proposal;
    try {
      proposal = assembler.add(bytes);
    } catch (const Rejection&) {
      return;
    }
    expect(assembler.pending() <= 4, "more proposals begun than the bound");
    if (!proposal) return;
    expect(proposal->checksum == checksum_fp32(proposal->tensors), "a proposal accepted with another checksum");
    expect(proposal->layout != nullptr || limits.layout != nullptr, "a proposal without a layout");
    GenesisProposal again_in = *proposal;
    if (!again_in.layout) again_in.layout = std::make_shared<const FragmentLayout>(*limits.layout);
    GenesisProposalAssembler again(limits);
    std::optional<GenesisProposal> back;
    for_each_genesis_proposal_segment(again_in, segment_bytes, 1,
                                      [&](uint32_t, uint32_t, std::span<const uint8_t> segment) {
                                        back = must_accept([&] { return again.add(segment); }, "a re-streamed proposal");
                                      });
    expect(back.has_value() && back->seq == proposal->seq, "a re-streamed proposal did not come back");
    if (back) expect_same(back->tensors, proposal->tensors, "a re-streamed proposal changed its values");
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  const uint64_t segment_bytes = 16 + (mode >> 2) * 16;
  if ((mode & 1) == 0)
    snapshots(data + 1, size - 1, segment_bytes);
  else
    proposals(data + 1, size - 1, (mode & 2) == 0, segment_bytes);
  return 0;
}
