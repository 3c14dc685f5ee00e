// parse_run_config (the TOML config loader) and validate_run_config. A config that passes both
// must survive run_config_json (diloco-learner --print-config): setting each key it lists through
// apply_override, as scripts do, gives the same config again.
#include <cmath>
#include <cstdio>
#include <string>

#include "core/config/config_json.h"
#include "core/config/run_config.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

namespace {

// A JSON value as a TOML value.
std::string toml_value(const nlohmann::json& v) {
  if (v.is_string()) {
    std::string out = "\"";
    for (const unsigned char ch : v.get<std::string>()) {
      if (ch == '"' || ch == '\\') {
        out += '\\';
        out += static_cast<char>(ch);
      } else if (ch < 0x20 || ch == 0x7f) {
        char escaped[8];
        std::snprintf(escaped, sizeof escaped, "\\u%04x", ch);
        out += escaped;
      } else {
        out += static_cast<char>(ch);
      }
    }
    return out + "\"";
  }
  if (v.is_array()) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + toml_value(v[i]);
    return out + "]";
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isnan(d)) return "nan";
    if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  }
  return v.dump();  // integers, booleans, finite floats (the shortest text that reads back the same)
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto config = accepted([&] {
    RunConfig c = parse_run_config(text, "fuzz.toml");
    validate_run_config(c);
    return c;
  });
  if (!config) return 0;
  const nlohmann::json json = run_config_json(*config);
  RunConfig again;
  for (const auto& [section, keys] : json.items())
    for (const auto& [key, value] : keys.items()) {
      const std::string assignment = section + "." + key + "=" + toml_value(value);
      must_accept([&] { apply_override(again, assignment); return 0; }, ("override " + assignment).c_str());
    }
  must_accept([&] { validate_run_config(again); return 0; }, "the config set again through overrides");
  if (run_config_json(again) != json)
    finding("the config set again through its JSON's overrides differs: " + json.dump() + " vs " +
            run_config_json(again).dump());
  return 0;
}
