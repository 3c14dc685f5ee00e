// decode_delta (fp32 and as sent) and peek_delta_header on a learner's delta. An accepted delta
// must: have the same header through peek_delta_header; dequantize, as sent, to the fp32 values;
// and survive encode_delta and decoding again bit for bit.
#include "core/codec/messages.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

namespace {

bool same_header(const DeltaHeader& a, const DeltaHeader& b) {
  return a.run_id == b.run_id && a.fingerprint == b.fingerprint && a.learner_id == b.learner_id &&
         a.region == b.region && a.fragment == b.fragment && a.seq == b.seq && a.base_version == b.base_version &&
         a.inner_steps == b.inner_steps && a.tokens == b.tokens && a.learner_step == b.learner_step &&
         std::memcmp(&a.train_loss, &b.train_loss, sizeof(float)) == 0 && a.send_time_us == b.send_time_us;
}

CodecOptions options_of(const Delta& d) {
  return {.dtype = d.dtype, .block_size = d.block_size == 0 ? 128 : d.block_size, .topk = d.topk,
          .byte_shuffle = d.byte_shuffle};
}

// Quantized tensors with topk > 0 are sent sparse: a dense delta that only declared its topk
// goes back dense (its blocks may hold more values).
CodecOptions quantized_options_of(const Delta& d) {
  CodecOptions o = options_of(d);
  if (!d.sparse) o.topk = 0;
  return o;
}

// The delta as it travelled: INT8/INT4 tensors as sent, F32/BF16 ones as decoded (exact in their dtype).
std::vector<uint8_t> encode(const Delta& d) {
  if (d.tensors.empty() && !d.quantized.empty()) return encode_delta(d.header, d.quantized, quantized_options_of(d));
  return encode_delta(d.header, d.tensors, options_of(d));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Framed in = frame(data, size);
  const DecodeLimits& limits = fuzz::limits();  // decode_delta always needs the layout
  const auto header = accepted([&] { return peek_delta_header(in.bytes, limits); });
  const auto dense = accepted([&] { return decode_delta(in.bytes, limits, DeltaValues::Dense); });
  const auto as_sent = accepted([&] { return decode_delta(in.bytes, limits, DeltaValues::AsSent); });
  expect(dense.has_value() == as_sent.has_value(), "decode_delta accepts as fp32 but not as sent, or the reverse");
  if (!dense) return 0;
  expect(header.has_value(), "decode_delta accepts a delta whose header peek_delta_header refuses");
  expect(same_header(*header, dense->header), "peek_delta_header and decode_delta read different headers");
  expect(same_header(as_sent->header, dense->header), "decode_delta as sent reads another header");
  if (!as_sent->quantized.empty()) {
    expect(as_sent->quantized.size() == dense->tensors.size(), "as sent: another tensor count");
    for (size_t t = 0; t < dense->tensors.size(); ++t) {
      std::vector<float> values(dense->tensors[t].values.size());
      dequantize(as_sent->quantized[t], values);
      expect(same_bits(values, dense->tensors[t].values), "a tensor as sent dequantizes to other values");
    }
  }
  // The reused-memory overload into a delta that held another one gives the same.
  Delta reused = *as_sent;
  must_accept([&] { decode_delta(in.bytes, limits, reused, DeltaValues::Dense); return 0; }, "Delta into a reused one");
  expect(encode(reused) == encode(*dense), "decode_delta into a reused Delta gives another delta");
  round_trip(*as_sent, encode, [&](const std::vector<uint8_t>& b) { return decode_delta(b, limits, DeltaValues::AsSent); },
             "Delta");
  return 0;
}
