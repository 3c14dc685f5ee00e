// decode_round_open on a merger's advisory round announcements, with and without the layout. An
// accepted one must survive encode_round_open and decoding again bit for bit.
#include "core/codec/messages.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return message_target(data, size, Layout::Optional, "RoundOpen", decode_round_open, encode_round_open, kNoCheck);
}
