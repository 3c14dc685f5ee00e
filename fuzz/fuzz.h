// What the fuzz targets of fuzz/ share (docs/testing.md, "Fuzzing the decoders"): the layout and
// limits a decoder is given, how an input reaches it, and what counts as a finding.
//
// A decoder may refuse its input with InvalidInput (a Rejection is one): that is the expected
// outcome for bad bytes. Any other exception, a crash, a leak or undefined behaviour is a finding,
// and so is an accepted message that does not survive being encoded and decoded again.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <typeinfo>
#include <vector>

#include "core/codec/messages.h"
#include "core/errors.h"

namespace diloco::fuzz {

// The run the targets decode for: run id "run-1", a 4-tensor model in 2 fragments (a 4x33 matrix,
// tensors of 7 and 15 values: odd counts for INT4's last nibble, and a 2x2 head), whose layout
// and fingerprint partition_tensors derives as every process of a run does.
const FragmentLayout& layout();
// The same layout as the shared pointer that encoders of FragmentState and GenesisProposal take.
std::shared_ptr<const FragmentLayout> shared_layout();
// The limits a process of that run decodes with (run_decode_limits of the default config: 64 MiB
// compressed and decompressed); without the layout when `with_layout` is false (a reader that
// learns the layout from a checkpoint or a proposal, or does not need one).
const DecodeLimits& limits(bool with_layout = true);

// How a message target reads its input: the first byte is a mode, the rest the message. Mode
// bit 0 set: the rest is a FlatBuffer, zstd-compressed here before decoding (so mutations reach
// the FlatBuffer itself rather than dying in zstd's checksum); clear: the rest goes to the decoder
// as it is (the framing: size limit, zstd header, bounded decompression). Bit 1 set: decode
// without the layout, where the decoder allows that. make_corpus writes seeds of both kinds.
inline constexpr uint8_t kCompressHere = 1;
inline constexpr uint8_t kNoLayout = 2;
struct Framed {
  uint8_t mode = 0;
  std::vector<uint8_t> bytes;  // what the decoder gets
  const DecodeLimits& limits() const { return fuzz::limits((mode & kNoLayout) == 0); }
};
Framed frame(const uint8_t* data, size_t size);
// The seed of `message` (an encoded, compressed message) in that framing.
std::vector<uint8_t> seed(std::span<const uint8_t> message, uint8_t mode);

// A finding: prints what went wrong and aborts (libFuzzer saves the input as crash-*).
[[noreturn]] void finding(const std::string& what);
// A failed check is a finding (a message built only then: `what` is a literal).
inline void expect(bool ok, const char* what) {
  if (!ok) finding(what);
}

// decode() if it accepts the input, nullopt if it refuses it with InvalidInput; any other
// exception is a finding.
template <typename F>
auto accepted(F&& decode) -> std::optional<decltype(decode())> {
  try {
    return decode();
  } catch (const InvalidInput&) {
    return std::nullopt;
  } catch (const std::exception& e) {
    finding(std::string("unexpected exception ") + typeid(e).name() + ": " + e.what());
  }
}

// The same, for a message this process just encoded from an accepted one: it must be accepted.
template <typename F>
auto must_accept(F&& decode, const char* what) -> decltype(decode()) {
  try {
    return decode();
  } catch (const std::exception& e) {
    finding(std::string(what) + ": the re-encoded message is refused: " + e.what());
  }
}

// The round trip of an accepted message m: encode(m) must decode again, and encoding that gives
// the same bytes (every field the encoder writes survived, bit for bit).
template <typename M, typename Encode, typename Decode>
void round_trip(const M& m, Encode&& encode, Decode&& decode, const char* what) {
  const std::vector<uint8_t> first = encode(m);
  const M again = must_accept([&] { return decode(first); }, what);
  const std::vector<uint8_t> second = encode(again);
  if (first != second) finding(std::string(what) + ": decoding and encoding again changes the message");
}

// The usual message target: the framed input decoded by `decode` (with the layout always, or as
// the mode byte says where the decoder may go without); an accepted message checked by
// check(message, limits) and put through round_trip with `encode`.
enum class Layout { Required, Optional };
template <typename M, typename Encode, typename Check>
int message_target(const uint8_t* data, size_t size, Layout layout, const char* what,
                   M (*decode)(std::span<const uint8_t>, const DecodeLimits&), Encode&& encode, Check&& check) {
  const Framed in = frame(data, size);
  const DecodeLimits& limits = layout == Layout::Required ? fuzz::limits() : in.limits();
  const auto m = accepted([&] { return decode(in.bytes, limits); });
  if (!m) return 0;
  check(*m, limits);
  round_trip(*m, encode, [&](const std::vector<uint8_t>& b) { return decode(b, limits); }, what);
  return 0;
}
inline constexpr auto kNoCheck = [](const auto&, const DecodeLimits&) {};

// Messages that carry the run's layout (FragmentState, GenesisProposal): decoded, they keep it
// only when the reader had none; encoded, they need it (the run's, which the fingerprint matched).
template <typename M>
void expect_carried_layout(const M& m, const DecodeLimits& limits) {
  expect((m.layout != nullptr) == (limits.layout == nullptr), "the carried layout kept when the reader had one, or lost");
}
template <typename M>
M with_run_layout(M m) {
  if (!m.layout) m.layout = shared_layout();
  return m;
}

inline bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// A log of messages, each [2-byte length, little endian][bytes] (a length past the end takes
// what is left), handed to `take` in order: the input of the targets that read streamed messages.
template <typename Take>
void for_each_logged(const uint8_t* data, size_t size, Take&& take) {
  size_t at = 0;
  while (at + 2 <= size) {
    const size_t length = std::min<size_t>(data[at] | (data[at + 1] << 8), size - at - 2);
    take(std::span<const uint8_t>(data + at + 2, length));
    at += 2 + length;
  }
}

}  // namespace diloco::fuzz
