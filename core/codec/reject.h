// Typed reasons for rejecting an input message. Every strict-decoding failure throws a Rejection
// naming one of these; callers count them, write them to the `rejected` topic and move on.
#pragma once

#include <string>

#include "core/errors.h"

namespace diloco {

enum class RejectReason {
  TooLarge,              // compressed message above the configured limit
  NotZstd,               // not a zstd frame
  SizeUnknown,           // zstd frame does not declare its decompressed size
  DecompressedTooLarge,  // declared decompressed size above the limit
  CorruptFrame,          // zstd failed, or the decompressed size differs from the declared one
  BadFlatbuffer,         // FlatBuffers verifier failed, or wrong file identifier
  UnknownSchemaVersion,
  WrongRunId,
  WrongFingerprint,
  FragmentOutOfRange,
  TensorCountMismatch,   // tensor count differs from the layout (or is absurd)
  ShapeMismatch,         // tensor index or shape differs from the layout
  BadCodec,              // unknown dtype, bad block size, payload or scale count inconsistent
  NonFinite,             // NaN or Inf in values or scales
  BadCounter,            // counters out of range (zero seq, steps without tokens, ...)
  MissingField,
  ChunkMissing,          // a chunked message whose pieces did not all arrive
  ChunkDuplicate,        // a piece that arrived twice (the first one is kept)
  ChunkMismatch,         // a piece that disagrees with its message, or pieces that reassemble wrong
  BadLayout,             // a model layout that is invalid or does not give the message's fingerprint
};

const char* reject_reason_name(RejectReason);  // snake_case, e.g. "wrong_fingerprint"

struct Rejection : InvalidInput {
  Rejection(RejectReason r, const std::string& detail)
      : InvalidInput(std::string(reject_reason_name(r)) + ": " + detail), reason(r) {}
  RejectReason reason;
};

}  // namespace diloco
