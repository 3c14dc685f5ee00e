// run_config_json (diloco-learner --print-config): every field under its TOML name, so scripts
// take the binaries' defaults instead of repeating them.
#include <catch2/catch.hpp>

#include "core/config/config_json.h"

using namespace diloco;

namespace {

// A value of the JSON as a TOML literal for apply_override.
std::string toml_literal(const nlohmann::json& v) {
  if (v.is_array()) {
    std::string out = "[";
    for (const auto& x : v) out += (out.size() > 1 ? ", " : "") + toml_literal(x);
    return out + "]";
  }
  return v.dump();  // strings quoted with JSON escapes, numbers, true/false: valid TOML here
}

// Every field differs from its default, so a key printed from the wrong field cannot round-trip.
constexpr const char* kEveryField = R"(
[run]
id = "every-field"
seed = 7
[model]
layers = 3
width = 48
heads = 6
context = 40
[train]
batch = 5
lr = 1.5e-3
weight_decay = 0.25
warmup_steps = 11
total_steps = 345
eval_every = 17
eval_batches = 3
grad_clip = 0.5
[diloco]
fragments = 3
H = 12
adopt = "overwrite"
blend_alpha = 0.125
stagger = true
cut_on_arrival = 0.25
wait_steps = 2
wait_timeout_seconds = 12.5
[codec]
dtype = "int8"
block_size = 32
topk = 3
byte_shuffle = false
zstd_level = 5
downlink_dtype = "int8"
downlink_block_size = 32
downlink_topk = 5
chunk_bytes = 65536
segment_bytes = 1048576
[data]
path = "data/other.txt"
split = "region"
heldout_fraction = 0.2
[merger]
quorum = 2
grace_gamma = 0.75
grace_tau = 3.5
grace_cap_steps = 1.5
grace_cap_seconds = 9
staleness_alpha = 0.5
max_staleness = 6
max_norm_ratio = 50
outer_lr = 0.35
outer_momentum = 0.8
momentum_warmup = 5
momentum_decay_from = 20
momentum_decay_to = 30
momentum_final = 0.4
share_scaling = false
rule = "avg"
optimizer = "dn"
dn_period = 3
dn_activation = 0.3
cgad_decay = 0.2
cgad_cutoff = 9
adam_beta2 = 0.95
adam_epsilon = 1e-6
checkpoint_every = 4
liveness_seconds = 8
members_lookback_seconds = 40
republish_seconds = 2.5
transaction_seconds = 30
min_write_mb_per_s = 0.5
[cluster]
learners = 4
regions = ["a", "b", "c"]
mergers = 2
speed_factors = [1.0, 2.0]
eval_interval = 7
schedule_by_speed = true
[security]
merger_public_key = "keys/merger.key"
merger_secret_key = "keys/merger.key_secret"
allowed_learners = "keys/learners"
learner_key = "keys/l0.key_secret"
kafka_protocol = "sasl_ssl"
kafka_ca = "secure/ca.pem"
kafka_certificate = "secure/tls/l0.pem"
kafka_credentials = "secure/kafka/l0.credentials"
kafka_mechanism = "SCRAM-SHA-256"
)";

}  // namespace

TEST_CASE("run_config_json prints every field under its TOML name, and --set of each reads it back", "[config]") {
  const RunConfig every = parse_run_config(kEveryField, "every-field");
  const nlohmann::json printed = run_config_json(every);
  const nlohmann::json defaults = run_config_json(RunConfig{});
  size_t fields = 0;
  RunConfig rebuilt;
  for (const auto& [section, table] : printed.items())
    for (const auto& [key, value] : table.items()) {
      INFO(section << "." << key << " = " << value.dump());
      CHECK(value != defaults[section][key]);  // the test config sets every field
      apply_override(rebuilt, section + "." + key + "=" + toml_literal(value));
      ++fields;
    }
  CHECK(fields == 79);  // the keys the parser knows (core/config/run_config.cc)
  CHECK(run_config_json(rebuilt) == printed);
  CHECK(printed["train"]["batch"] == 5);
  CHECK(printed["codec"]["dtype"] == "int8");
  CHECK(printed["data"]["split"] == "region");
  CHECK(defaults["train"]["batch"] == RunConfig{}.train.batch);
}
