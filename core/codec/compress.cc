// zstd framing. Contexts are thread_local so that encoding a message does not allocate zstd state
// each time; frames carry their content size (bounded decompression needs it) and a content
// checksum, so a flipped bit anywhere in a frame is a rejection, not a silently different delta.
#include "core/codec/compress.h"

#include <zstd.h>

#include <string>

#include "core/codec/reject.h"

namespace diloco {
namespace {

// Outputs up to this size reuse the thread's buffer; larger ones get a buffer of their own.
constexpr size_t kReusedOutputBytes = size_t{16} << 20;

struct CompressContext {
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  std::vector<uint8_t> out;  // reused: compressing into it costs no page faults after warm-up
  ~CompressContext() { ZSTD_freeCCtx(cctx); }
};

struct DecompressContext {
  ZSTD_DCtx* dctx = ZSTD_createDCtx();
  ~DecompressContext() { ZSTD_freeDCtx(dctx); }
};

CompressContext& compress_context() {
  thread_local CompressContext ctx;
  DILOCO_ENFORCE(ctx.cctx != nullptr, "ZSTD_createCCtx failed");
  return ctx;
}

ZSTD_DCtx* decompress_context() {
  thread_local DecompressContext ctx;
  DILOCO_ENFORCE(ctx.dctx != nullptr, "ZSTD_createDCtx failed");
  return ctx.dctx;
}

void check_zstd(size_t rc, const char* what) {
  if (ZSTD_isError(rc)) throw InternalError(std::string(what) + ": " + ZSTD_getErrorName(rc));
}

}  // namespace

std::vector<uint8_t> zstd_compress(std::span<const uint8_t> in, int level) {
  auto& ctx = compress_context();
  // ZSTD_compress2 rather than ZSTD_compressCCtx: the latter cannot switch the checksum on.
  check_zstd(ZSTD_CCtx_reset(ctx.cctx, ZSTD_reset_session_and_parameters), "ZSTD_CCtx_reset");
  check_zstd(ZSTD_CCtx_setParameter(ctx.cctx, ZSTD_c_compressionLevel, level), "zstd level");
  check_zstd(ZSTD_CCtx_setParameter(ctx.cctx, ZSTD_c_checksumFlag, 1), "zstd checksum flag");
  check_zstd(ZSTD_CCtx_setParameter(ctx.cctx, ZSTD_c_contentSizeFlag, 1), "zstd content size");
  const size_t bound = ZSTD_compressBound(in.size());
  if (bound > kReusedOutputBytes) {
    // A large message (a checkpoint) is compressed straight into its own buffer: no copy, and
    // the thread keeps no buffer of that size afterwards.
    std::vector<uint8_t> out(bound);
    const size_t n = ZSTD_compress2(ctx.cctx, out.data(), out.size(), in.data(), in.size());
    check_zstd(n, "ZSTD_compress2");
    out.resize(n);
    return out;
  }
  if (ctx.out.size() < bound) ctx.out.resize(bound);
  const size_t n = ZSTD_compress2(ctx.cctx, ctx.out.data(), ctx.out.size(), in.data(), in.size());
  check_zstd(n, "ZSTD_compress2");
  return std::vector<uint8_t>(ctx.out.begin(), ctx.out.begin() + static_cast<std::ptrdiff_t>(n));
}

void zstd_decompress_bounded_into(std::span<const uint8_t> in, uint64_t max_bytes,
                                  std::vector<uint8_t>& out) {
  // The declared size is checked before anything is allocated or decompressed.
  const unsigned long long declared = ZSTD_getFrameContentSize(in.data(), in.size());
  if (declared == ZSTD_CONTENTSIZE_ERROR)
    throw Rejection(RejectReason::NotZstd,
                    "no zstd frame header in " + std::to_string(in.size()) + " bytes");
  if (declared == ZSTD_CONTENTSIZE_UNKNOWN)
    throw Rejection(RejectReason::SizeUnknown, "zstd frame does not declare its content size");
  if (declared > max_bytes)
    throw Rejection(RejectReason::DecompressedTooLarge,
                    "declared " + std::to_string(declared) + " bytes, limit " +
                        std::to_string(max_bytes));
  const size_t size = static_cast<size_t>(declared);
  out.resize(size);
  uint8_t empty = 0;  // zstd wants a valid pointer even for an empty destination
  const size_t n = ZSTD_decompressDCtx(decompress_context(), size ? out.data() : &empty, size,
                                       in.data(), in.size());
  if (ZSTD_isError(n))
    throw Rejection(RejectReason::CorruptFrame, std::string("zstd: ") + ZSTD_getErrorName(n));
  if (n != size)
    throw Rejection(RejectReason::CorruptFrame, "decompressed " + std::to_string(n) +
                                                    " bytes, frame declared " +
                                                    std::to_string(size));
}

std::vector<uint8_t> zstd_decompress_bounded(std::span<const uint8_t> in, uint64_t max_bytes) {
  std::vector<uint8_t> out;
  zstd_decompress_bounded_into(in, max_bytes, out);
  return out;
}

}  // namespace diloco
