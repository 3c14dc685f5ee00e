// Included first in every test file (as a precompiled header, see tests/CMakeLists.txt).
// libtorch brings glog, whose CHECK macro would replace Catch's CHECK in any test that includes a
// torch header after catch.hpp: failures would abort instead of being reported. Including torch
// first and dropping glog's CHECK lets Catch define its own.
#pragma once

#include <torch/torch.h>
#undef CHECK
#include <catch2/catch.hpp>

#include <ostream>

#include "core/codec/messages.h"
#include "core/fragments/layout.h"

// glog's stl_logging.h (pulled in by torch) declares operator<< for every std::vector, so Catch
// believes vectors of our types are printable; give the element types a printer.
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
