// Included first in every file of the model tests (the built-in libtorch model, its corpus, inner
// optimizer and model file; a precompiled header, see tests/CMakeLists.txt). libtorch brings
// glog, whose CHECK macro would replace Catch's CHECK in any test that includes a torch header
// after catch.hpp: failures would abort instead of being reported. Including torch first and
// dropping glog's CHECK lets Catch define its own.
#pragma once

#include <torch/torch.h>
#undef CHECK

#include "tests/test_prelude.h"
