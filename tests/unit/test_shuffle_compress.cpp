// Byte shuffle and bounded zstd framing (core/codec/shuffle.h, core/codec/compress.h).
#include <catch2/catch.hpp>

#include <zstd.h>

#include <functional>
#include <random>
#include <vector>

#include "core/codec/compress.h"
#include "core/codec/reject.h"
#include "core/codec/shuffle.h"
#include "core/errors.h"
#include "tests/rejection.h"

using namespace diloco;
using testing::rejection;

namespace {

std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// The definition, one byte at a time.
std::vector<uint8_t> reference_shuffle(const std::vector<uint8_t>& in, size_t elem) {
  std::vector<uint8_t> out(in);
  const size_t n = in.size() / elem;
  for (size_t i = 0; i < n; ++i)
    for (size_t k = 0; k < elem; ++k) out[k * n + i] = in[i * elem + k];
  return out;
}

std::string name(RejectReason r) { return reject_reason_name(r); }

}  // namespace

TEST_CASE("byte shuffle of a small example, by hand", "[codec][shuffle]") {
  const std::vector<uint8_t> in = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  std::vector<uint8_t> out(in.size());
  byte_shuffle(in, out, 4);  // 3 elements + 1 trailing byte
  CHECK(out == std::vector<uint8_t>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11, 12});
  byte_shuffle(in, out, 2);  // 6 elements + 1 trailing byte
  CHECK(out == std::vector<uint8_t>{0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11, 12});
  byte_shuffle(in, out, 1);
  CHECK(out == in);
  std::vector<uint8_t> back(in.size());
  byte_shuffle(in, out, 4);
  byte_unshuffle(out, back, 4);
  CHECK(back == in);
}

TEST_CASE("byte shuffle matches the definition and unshuffle inverts it", "[codec][shuffle]") {
  const size_t elem = GENERATE(size_t{1}, size_t{2}, size_t{4});
  const size_t size = GENERATE(size_t{0}, size_t{1}, size_t{3}, size_t{7}, size_t{63},
                               size_t{64}, size_t{255}, size_t{256}, size_t{259}, size_t{1027},
                               size_t{4 * 64 * 3 + 5}, size_t{1000003});
  INFO("elem " << elem << ", " << size << " bytes");
  const auto in = random_bytes(size, size * 31 + elem);
  std::vector<uint8_t> shuffled(size), back(size);
  byte_shuffle(in, shuffled, elem);
  CHECK(shuffled == reference_shuffle(in, elem));
  byte_unshuffle(shuffled, back, elem);
  CHECK(back == in);
}

TEST_CASE("byte shuffle rejects bad arguments", "[codec][shuffle]") {
  std::vector<uint8_t> in(16), out(16), small(15);
  CHECK_THROWS_AS(byte_shuffle(in, out, 3), InvalidInput);
  CHECK_THROWS_AS(byte_shuffle(in, out, 8), InvalidInput);
  CHECK_THROWS_AS(byte_unshuffle(in, small, 4), InvalidInput);
  CHECK_THROWS_AS(byte_shuffle(in, std::span<uint8_t>(in), 4), InternalError);
}

TEST_CASE("zstd round trip", "[codec][zstd]") {
  const int level = GENERATE(1, 3, 19);
  const size_t size = GENERATE(size_t{0}, size_t{1}, size_t{1000}, size_t{1 << 20});
  auto in = random_bytes(size, size);
  for (size_t i = 0; i < size / 2; ++i) in[i] = 0;  // half compressible
  const auto frame = zstd_compress(in, level);
  CHECK(ZSTD_getFrameContentSize(frame.data(), frame.size()) == size);
  CHECK(zstd_decompress_bounded(frame, size) == in);
  std::vector<uint8_t> reused(7, 7);
  zstd_decompress_bounded_into(frame, size, reused);
  CHECK(reused == in);
}

TEST_CASE("zstd decompression is bounded and strict", "[codec][zstd]") {
  const auto in = random_bytes(5000, 1);
  const auto frame = zstd_compress(in, 1);

  SECTION("above the limit: rejected before decompressing") {
    CHECK(rejection([&] { zstd_decompress_bounded(frame, 4999); }) ==
          name(RejectReason::DecompressedTooLarge));
  }
  SECTION("a frame header declaring 4 GiB, crafted by hand") {
    // magic 0xFD2FB528 (little endian), descriptor 0xE0 = 8-byte content size + single segment,
    // then the size 2^32; no block follows, nothing but the header is needed.
    const std::vector<uint8_t> bomb = {0x28, 0xB5, 0x2F, 0xFD, 0xE0, 0x00, 0x00,
                                       0x00, 0x00, 0x01, 0x00, 0x00, 0x00};
    REQUIRE(ZSTD_getFrameContentSize(bomb.data(), bomb.size()) == (1ull << 32));
    CHECK(rejection([&] { zstd_decompress_bounded(bomb, 256ull << 20); }) ==
          name(RejectReason::DecompressedTooLarge));
  }
  SECTION("a streamed frame without a content size") {
    ZSTD_CCtx* cctx = ZSTD_createCCtx();
    std::vector<uint8_t> out(ZSTD_compressBound(in.size()) + 64);
    ZSTD_outBuffer ob{out.data(), out.size(), 0};
    ZSTD_inBuffer ib{in.data(), in.size(), 0};
    ZSTD_compressStream2(cctx, &ob, &ib, ZSTD_e_continue);  // no pledged size
    ZSTD_inBuffer rest{nullptr, 0, 0};
    REQUIRE(ZSTD_compressStream2(cctx, &ob, &rest, ZSTD_e_end) == 0);
    ZSTD_freeCCtx(cctx);
    out.resize(ob.pos);
    REQUIRE(ZSTD_getFrameContentSize(out.data(), out.size()) == ZSTD_CONTENTSIZE_UNKNOWN);
    CHECK(rejection([&] { zstd_decompress_bounded(out, 1 << 20); }) ==
          name(RejectReason::SizeUnknown));
  }
  SECTION("not zstd at all") {
    CHECK(rejection([&] { zstd_decompress_bounded(in, 1 << 20); }) == name(RejectReason::NotZstd));
    CHECK(rejection([&] { zstd_decompress_bounded({}, 1 << 20); }) == name(RejectReason::NotZstd));
  }
  SECTION("truncated") {
    const std::span<const uint8_t> cut(frame.data(), frame.size() - 1);
    CHECK(rejection([&] { zstd_decompress_bounded(cut, 1 << 20); }) ==
          name(RejectReason::CorruptFrame));
    const std::span<const uint8_t> header_only(frame.data(), 3);
    CHECK(rejection([&] { zstd_decompress_bounded(header_only, 1 << 20); }) ==
          name(RejectReason::NotZstd));
  }
  SECTION("trailing bytes after the frame") {
    auto longer = frame;
    longer.push_back(0);
    CHECK(rejection([&] { zstd_decompress_bounded(longer, 1 << 20); }) ==
          name(RejectReason::CorruptFrame));
  }
  SECTION("a content size that lies") {
    // A small frame: descriptor with single segment and a 2-byte content size (5000 - 256).
    auto liar = zstd_compress(random_bytes(5000, 2), 1);
    REQUIRE(liar[4] == 0x64);  // FCS flag 1 (2 bytes), single segment, checksum, no dictionary
    REQUIRE(liar[5] + 256 * liar[6] + 256 == 5000);
    liar[5] += 1;
    CHECK(rejection([&] { zstd_decompress_bounded(liar, 1 << 20); }) ==
          name(RejectReason::CorruptFrame));
  }
  SECTION("a flipped bit never yields different bytes (content checksum)") {
    const auto original = random_bytes(300, 3);
    const auto small = zstd_compress(original, 1);
    for (size_t byte = 0; byte < small.size(); ++byte)
      for (int bit = 0; bit < 8; ++bit) {
        auto flipped = small;
        flipped[byte] ^= static_cast<uint8_t>(1u << bit);
        INFO("byte " << byte << " bit " << bit);
        std::vector<uint8_t> out;
        const std::string outcome =
            rejection([&] { out = zstd_decompress_bounded(flipped, 1 << 20); });
        if (byte == 4 && bit == 4) {
          // The frame descriptor's unused bit: the zstd format says decoders ignore it.
          CHECK(out == original);
        } else {
          CHECK(outcome != "accepted");  // raw block: every other bit matters
        }
      }
  }
}
