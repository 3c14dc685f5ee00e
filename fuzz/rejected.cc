// decode_rejected on the rejected topic's records. An accepted one must survive encode_rejected
// and decoding again bit for bit.
#include "core/codec/messages.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return message_target(data, size, Layout::Optional, "Rejected", decode_rejected, encode_rejected, kNoCheck);
}
