// Included first in every unit and integration test file (as a precompiled header, see
// tests/CMakeLists.txt). These binaries link no libtorch; the model tests have their own prelude
// (tests/model/prelude.h).
#pragma once

#include <catch2/catch.hpp>

#include <ostream>

#include "core/codec/messages.h"
#include "core/fragments/layout.h"

// Catch prints a vector element by element when the element type has an operator<<.
namespace diloco {
inline std::ostream& operator<<(std::ostream& out, const TensorSpec& t) {
  out << t.name << "[";
  for (size_t i = 0; i < t.shape.size(); ++i) out << (i ? "x" : "") << t.shape[i];
  return out << "]";
}
inline std::ostream& operator<<(std::ostream& out, const LogPosition& p) {
  return out << p.topic << "[" << p.partition << "]@" << p.offset;
}
}  // namespace diloco
