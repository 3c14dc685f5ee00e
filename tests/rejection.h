// What a strict decoder makes of some bytes, for the tests of hostile and malformed input: the
// name of the reason it rejected them with (reject_reason_name, e.g. "wrong_fingerprint"), or
// "accepted". Any other exception escapes and fails the test.
#pragma once

#include <functional>
#include <string>

#include "core/codec/reject.h"

namespace diloco::testing {

inline std::string rejection(const std::function<void()>& decode) {
  try {
    decode();
  } catch (const Rejection& r) {
    return reject_reason_name(r.reason);
  }
  return "accepted";
}

}  // namespace diloco::testing

// CHECK_REJECTS(decode_delta(bytes, limits), WrongFingerprint): the expression is rejected with
// RejectReason::WrongFingerprint.
#define CHECK_REJECTS(expr, reason)                                   \
  CHECK(::diloco::testing::rejection([&] { (void)(expr); }) == \
        std::string(::diloco::reject_reason_name(::diloco::RejectReason::reason)))
