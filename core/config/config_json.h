// The resolved run config as JSON: every field of every section, defaults included, under the
// names the TOML file uses (diloco-learner --print-config). Scripts read it instead of repeating
// the binaries' defaults.
#pragma once

#include <nlohmann/json.hpp>

#include "core/config/run_config.h"

namespace diloco {

// {"run": {"id": ..., "seed": ...}, "model": {...}, ..., "cluster": {...}}; enums as their
// config names (codec.dtype "int4", data.split "iid"). Every key set here is one that
// apply_override accepts, with a value it reads back to the same field.
nlohmann::json run_config_json(const RunConfig& config);

}  // namespace diloco
