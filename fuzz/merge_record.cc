// decode_merge_record on the merges log's records, with and without the layout. An accepted record
// must survive encode_merge_record and decoding again bit for bit.
#include "core/codec/messages.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return message_target(
      data, size, Layout::Optional, "MergeRecord", decode_merge_record,
      [](const MergeRecord& r) { return encode_merge_record(r); },
      [](const MergeRecord& r, const DecodeLimits&) {
        expect(valid_norm_block(r.norm_block), "a record accepted with an invalid norm_block");
      });
}
