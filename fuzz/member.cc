// decode_member on the membership topic's announcements. An accepted one must survive
// encode_member and decoding again bit for bit.
#include "core/codec/messages.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return message_target(data, size, Layout::Optional, "Member", decode_member, encode_member,
                        [](const Member& m, const DecodeLimits&) {
                          expect(m.owned_fragments.size() == m.fragment_versions.size(),
                                 "a member accepted with unpaired versions");
                        });
}
