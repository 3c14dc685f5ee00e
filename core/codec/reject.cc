#include "core/codec/reject.h"

namespace diloco {

const char* reject_reason_name(RejectReason r) {
  switch (r) {
    case RejectReason::TooLarge: return "too_large";
    case RejectReason::NotZstd: return "not_zstd";
    case RejectReason::SizeUnknown: return "size_unknown";
    case RejectReason::DecompressedTooLarge: return "decompressed_too_large";
    case RejectReason::CorruptFrame: return "corrupt_frame";
    case RejectReason::BadFlatbuffer: return "bad_flatbuffer";
    case RejectReason::UnknownSchemaVersion: return "unknown_schema_version";
    case RejectReason::WrongRunId: return "wrong_run_id";
    case RejectReason::WrongFingerprint: return "wrong_fingerprint";
    case RejectReason::FragmentOutOfRange: return "fragment_out_of_range";
    case RejectReason::TensorCountMismatch: return "tensor_count_mismatch";
    case RejectReason::ShapeMismatch: return "shape_mismatch";
    case RejectReason::BadCodec: return "bad_codec";
    case RejectReason::NonFinite: return "non_finite";
    case RejectReason::BadCounter: return "bad_counter";
    case RejectReason::MissingField: return "missing_field";
    case RejectReason::ChunkMissing: return "chunk_missing";
    case RejectReason::ChunkDuplicate: return "chunk_duplicate";
    case RejectReason::ChunkMismatch: return "chunk_mismatch";
    case RejectReason::BadLayout: return "bad_layout";
  }
  return "unknown";
}

}  // namespace diloco
