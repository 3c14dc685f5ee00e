#include "core/config/run_config.h"

#include "core/codec/messages.h"

#include <toml++/toml.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <tuple>

#include "core/errors.h"

namespace diloco {
namespace {

// Where TOML came from: a file (messages carry line numbers) or one command-line override.
struct Origin {
  std::string name;
  bool has_lines = true;
};

// One key being read, named "section.key" in messages.
struct Field {
  const Origin& origin;
  std::string name;
  const toml::node& node;

  [[noreturn]] void fail(std::string_view message) const {
    const bool has_line = origin.has_lines && node.source().begin.line > 0;
    throw InvalidInput(detail::concat(origin.name, has_line ? ":" : "",
                                      has_line ? std::to_string(node.source().begin.line) : "",
                                      ": ", name, ": ", message));
  }
  [[noreturn]] void wrong_type(std::string_view expected) const {
    fail(detail::concat("expected ", expected, ", got ", node.type()));
  }
};

void read(const Field& f, std::string& out) {
  if (!f.node.is_string()) f.wrong_type("a string");
  out = f.node.as_string()->get();
}

void read(const Field& f, int64_t& out) {
  if (!f.node.is_integer()) f.wrong_type("an integer");
  out = f.node.as_integer()->get();
}

void read(const Field& f, int& out) {
  int64_t v = 0;
  read(f, v);
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max())
    f.fail(detail::concat(v, " does not fit in a 32-bit integer"));
  out = static_cast<int>(v);
}

void read(const Field& f, uint32_t& out) {
  int64_t v = 0;
  read(f, v);
  if (v < 0 || v > std::numeric_limits<uint32_t>::max())
    f.fail(detail::concat("must be between 0 and ", std::numeric_limits<uint32_t>::max(),
                          ", got ", v));
  out = static_cast<uint32_t>(v);
}

void read(const Field& f, uint64_t& out) {
  int64_t v = 0;
  read(f, v);
  if (v < 0) f.fail(detail::concat("must not be negative, got ", v));
  out = static_cast<uint64_t>(v);
}

// Integers are accepted for floating-point fields: "lr = 1" means 1.0.
void read(const Field& f, double& out) {
  if (f.node.is_floating_point())
    out = f.node.as_floating_point()->get();
  else if (f.node.is_integer())
    out = static_cast<double>(f.node.as_integer()->get());
  else
    f.wrong_type("a number");
}

void read(const Field& f, bool& out) {
  if (!f.node.is_boolean()) f.wrong_type("a boolean (true or false)");
  out = f.node.as_boolean()->get();
}

void read(const Field& f, DType& out) {
  std::string s;
  read(f, s);
  try {
    out = parse_dtype(s);
  } catch (const InvalidInput& e) {
    f.fail(e.what());
  }
}

void read(const Field& f, DataSplit& out) {
  std::string s;
  read(f, s);
  try {
    out = parse_data_split(s);
  } catch (const InvalidInput& e) {
    f.fail(e.what());
  }
}

template <typename T>
void read(const Field& f, std::vector<T>& out) {
  if (!f.node.is_array()) f.wrong_type("an array, e.g. [1, 2]");
  out.clear();
  size_t i = 0;
  for (const toml::node& element : *f.node.as_array()) {
    T value{};
    read(Field{f.origin, detail::concat(f.name, "[", i++, "]"), element}, value);
    out.push_back(std::move(value));
  }
}

// One [section] of the file; each parse_* function below walks its keys.
struct Section {
  const Origin& origin;
  std::string_view name;
  const toml::table& table;

  Field field(const toml::key& key, const toml::node& node) const {
    return Field{origin, detail::concat(name, ".", key.str()), node};
  }
};

[[noreturn]] void unknown_key(const Field& f) { f.fail("unknown key"); }

void parse_run(const Section& s, RunConfig& c) {
  for (auto&& [key, node] : s.table) {
    const Field f = s.field(key, node);
    if (key == "id") read(f, c.run.id);
    else if (key == "seed") read(f, c.run.seed);
    else unknown_key(f);
  }
}

void parse_model(const Section& s, RunConfig& c) {
  for (auto&& [key, node] : s.table) {
    const Field f = s.field(key, node);
    if (key == "layers") read(f, c.model.layers);
    else if (key == "width") read(f, c.model.width);
    else if (key == "heads") read(f, c.model.heads);
    else if (key == "context") read(f, c.model.context);
    else unknown_key(f);
  }
}

void parse_train(const Section& s, RunConfig& c) {
  for (auto&& [key, node] : s.table) {
    const Field f = s.field(key, node);
    if (key == "batch") read(f, c.train.batch);
    else if (key == "lr") read(f, c.train.lr);
    else if (key == "weight_decay") read(f, c.train.weight_decay);
    else if (key == "warmup_steps") read(f, c.train.warmup_steps);
    else if (key == "total_steps") read(f, c.train.total_steps);
    else if (key == "eval_every") read(f, c.train.eval_every);
    else if (key == "eval_batches") read(f, c.train.eval_batches);
    else if (key == "grad_clip") read(f, c.train.grad_clip);
    else unknown_key(f);
  }
}

void parse_diloco(const Section& s, RunConfig& c) {
  for (auto&& [key, node] : s.table) {
    const Field f = s.field(key, node);
    if (key == "fragments") read(f, c.diloco.fragments);
    else if (key == "H") read(f, c.diloco.H);
    else if (key == "adopt") read(f, c.diloco.adopt);
    else if (key == "blend_alpha") read(f, c.diloco.blend_alpha);
    else if (key == "stagger") read(f, c.diloco.stagger);
    else if (key == "cut_on_arrival") read(f, c.diloco.cut_on_arrival);
    else if (key == "wait_steps") read(f, c.diloco.wait_steps);
    else if (key == "wait_timeout_seconds") read(f, c.diloco.wait_timeout_seconds);
    else unknown_key(f);
  }
}

void parse_codec(const Section& s, RunConfig& c) {
  for (auto&& [key, node] : s.table) {
    const Field f = s.field(key, node);
    if (key == "dtype") read(f, c.codec.dtype);
    else if (key == "block_size") read(f, c.codec.block_size);
    else if (key == "topk") read(f, c.codec.topk);
    else if (key == "byte_shuffle") read(f, c.codec.byte_shuffle);
    else if (key == "zstd_level") read(f, c.codec.zstd_level);
    else if (key == "downlink_dtype") read(f, c.codec.downlink_dtype);
    else if (key == "downlink_block_size") read(f, c.codec.downlink_block_size);
    else if (key == "downlink_topk") read(f, c.codec.downlink_topk);
    else if (key == "chunk_bytes") read(f, c.codec.chunk_bytes);
    else if (key == "segment_bytes") read(f, c.codec.segment_bytes);
    else unknown_key(f);
  }
}

void parse_data(const Section& s, RunConfig& c) {
  for (auto&& [key, node] : s.table) {
    const Field f = s.field(key, node);
    if (key == "path") read(f, c.data.path);
    else if (key == "split") read(f, c.data.split);
    else if (key == "heldout_fraction") read(f, c.data.heldout_fraction);
    else unknown_key(f);
  }
}

struct SectionParser {
  std::string_view name;
  void (*parse)(const Section&, RunConfig&);
};

void parse_merger(const Section& s, RunConfig& c) {
  for (auto&& [key, node] : s.table) {
    const Field f = s.field(key, node);
    auto& m = c.merger;
    if (key == "quorum") read(f, m.quorum);
    else if (key == "grace_gamma") read(f, m.grace_gamma);
    else if (key == "grace_tau") read(f, m.grace_tau);
    else if (key == "grace_cap_steps") read(f, m.grace_cap_steps);
    else if (key == "grace_cap_seconds") read(f, m.grace_cap_seconds);
    else if (key == "staleness_alpha") read(f, m.staleness_alpha);
    else if (key == "max_staleness") read(f, m.max_staleness);
    else if (key == "max_norm_ratio") read(f, m.max_norm_ratio);
    else if (key == "outer_lr") read(f, m.outer_lr);
    else if (key == "outer_momentum") read(f, m.outer_momentum);
    else if (key == "momentum_warmup") read(f, m.momentum_warmup);
    else if (key == "momentum_decay_from") read(f, m.momentum_decay_from);
    else if (key == "momentum_decay_to") read(f, m.momentum_decay_to);
    else if (key == "momentum_final") read(f, m.momentum_final);
    else if (key == "share_scaling") read(f, m.share_scaling);
    else if (key == "rule") read(f, m.rule);
    else if (key == "optimizer") read(f, m.optimizer);
    else if (key == "dn_period") read(f, m.dn_period);
    else if (key == "dn_activation") read(f, m.dn_activation);
    else if (key == "cgad_decay") read(f, m.cgad_decay);
    else if (key == "cgad_cutoff") read(f, m.cgad_cutoff);
    else if (key == "adam_beta2") read(f, m.adam_beta2);
    else if (key == "adam_epsilon") read(f, m.adam_epsilon);
    else if (key == "checkpoint_every") read(f, m.checkpoint_every);
    else if (key == "liveness_seconds") read(f, m.liveness_seconds);
    else if (key == "members_lookback_seconds") read(f, m.members_lookback_seconds);
    else if (key == "republish_seconds") read(f, m.republish_seconds);
    else if (key == "transaction_seconds") read(f, m.transaction_seconds);
    else if (key == "min_write_mb_per_s") read(f, m.min_write_mb_per_s);
    else unknown_key(f);
  }
}

void parse_cluster(const Section& s, RunConfig& c) {
  for (auto&& [key, node] : s.table) {
    const Field f = s.field(key, node);
    auto& k = c.cluster;
    if (key == "learners") read(f, k.learners);
    else if (key == "regions") read(f, k.regions);
    else if (key == "mergers") read(f, k.mergers);
    else if (key == "speed_factors") read(f, k.speed_factors);
    else if (key == "eval_interval") read(f, k.eval_interval);
    else if (key == "schedule_by_speed") read(f, k.schedule_by_speed);
    else unknown_key(f);
  }
}

void parse_security(const Section& s, RunConfig& c) {
  for (auto&& [key, node] : s.table) {
    const Field f = s.field(key, node);
    auto& k = c.security;
    if (key == "merger_public_key") read(f, k.merger_public_key);
    else if (key == "merger_secret_key") read(f, k.merger_secret_key);
    else if (key == "allowed_learners") read(f, k.allowed_learners);
    else if (key == "learner_key") read(f, k.learner_key);
    else if (key == "kafka_protocol") read(f, k.kafka_protocol);
    else if (key == "kafka_ca") read(f, k.kafka_ca);
    else if (key == "kafka_certificate") read(f, k.kafka_certificate);
    else if (key == "kafka_credentials") read(f, k.kafka_credentials);
    else if (key == "kafka_mechanism") read(f, k.kafka_mechanism);
    else unknown_key(f);
  }
}

constexpr SectionParser kSections[] = {
    {"run", parse_run},       {"model", parse_model}, {"train", parse_train},
    {"diloco", parse_diloco}, {"codec", parse_codec}, {"data", parse_data}, {"merger", parse_merger},
    {"cluster", parse_cluster}, {"security", parse_security},
};

void apply_table(const toml::table& root, const Origin& origin, RunConfig& config) {
  for (auto&& [name, node] : root) {
    const Field f{origin, std::string(name.str()), node};
    const SectionParser* parser = nullptr;
    for (const auto& candidate : kSections)
      if (candidate.name == name.str()) parser = &candidate;
    if (parser == nullptr) {
      std::string known;
      for (const auto& candidate : kSections)
        known += detail::concat(known.empty() ? "" : ", ", "[", candidate.name, "]");
      f.fail(detail::concat("unknown section (known: ", known, ")"));
    }
    if (!node.is_table()) f.fail("must be a section ([" + f.name + "]), not a value");
    parser->parse(Section{origin, name.str(), *node.as_table()}, config);
  }
}

toml::table parse_toml(std::string_view text, const Origin& origin) {
  try {
    return toml::parse(text, origin.name);
  } catch (const toml::parse_error& e) {
    const auto& at = e.source().begin;
    throw InvalidInput(detail::concat(origin.name, ":", at.line, ":", at.column, ": ",
                                      e.description()));
  }
}

void check(bool ok, const RunConfig& c, std::string_view what) {
  if (!ok) throw InvalidInput(detail::concat(c.source, ": ", what));
}

}  // namespace

DataSplit parse_data_split(std::string_view s) {
  if (s == "iid") return DataSplit::iid;
  if (s == "region") return DataSplit::region;
  throw InvalidInput(detail::concat("unknown data split '", s, "' (expected iid or region)"));
}

const char* data_split_name(DataSplit split) {
  switch (split) {
    case DataSplit::iid:
      return "iid";
    case DataSplit::region:
      return "region";
  }
  throw InternalError("unknown DataSplit value");
}

RunConfig parse_run_config(std::string_view toml_text, std::string_view origin_name) {
  const Origin origin{std::string(origin_name)};
  RunConfig config;
  config.source = origin.name;
  apply_table(parse_toml(toml_text, origin), origin, config);
  return config;
}

void apply_override(RunConfig& config, std::string_view assignment) {
  const Origin origin{detail::concat("override '", assignment, "'"), false};
  const auto eq = assignment.find('=');
  const auto dot = assignment.find('.');
  if (eq == std::string_view::npos || dot == std::string_view::npos || dot > eq ||
      assignment.find('\n') != std::string_view::npos)
    throw InvalidInput(origin.name + ": expected section.key=value");
  const std::string section(assignment.substr(0, dot));
  const std::string key(assignment.substr(dot + 1, eq - dot - 1));
  const std::string value(assignment.substr(eq + 1));

  const std::string header = "[" + section + "]\n" + key + " = ";
  std::string quoted = "\"";
  for (char ch : value) {
    if (ch == '"' || ch == '\\') quoted += '\\';
    quoted += ch;
  }
  quoted += '"';
  toml::table parsed;
  try {
    parsed = toml::parse(header + value);
  } catch (const toml::parse_error&) {
    parsed = parse_toml(header + quoted, origin);
  }
  apply_table(parsed, origin, config);
  config.source += detail::concat(" + ", assignment);
}

RunConfig load_run_config(const std::filesystem::path& file,
                          std::span<const std::string> overrides) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw IoError(detail::concat("cannot read run config ", file.string()));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw IoError(detail::concat("error reading run config ", file.string()));

  RunConfig config = parse_run_config(text.str(), file.string());
  for (const auto& o : overrides) apply_override(config, o);
  validate_run_config(config);
  return config;
}

void validate_run_config(const RunConfig& c) {
  check(!c.run.id.empty(), c, "run.id must not be empty");
  check(c.run.id.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                   "0123456789_-") == std::string::npos,
        c, "run.id may only use letters, digits, '_' and '-' (it is part of topic names)");

  check(c.model.layers >= 1, c, "model.layers must be at least 1");
  check(c.model.width >= 1, c, "model.width must be at least 1");
  check(c.model.heads >= 1, c, "model.heads must be at least 1");
  check(c.model.width % c.model.heads == 0, c,
        detail::concat("model.width (", c.model.width, ") must be a multiple of model.heads (",
                       c.model.heads, ")"));
  check(c.model.context >= 1, c, "model.context must be at least 1");

  check(c.train.batch >= 1, c, "train.batch must be at least 1");
  check(c.train.lr > 0, c, "train.lr must be positive");
  check(c.train.weight_decay >= 0, c, "train.weight_decay must not be negative");
  check(c.train.warmup_steps >= 0, c, "train.warmup_steps must not be negative");
  check(c.train.total_steps >= 1, c, "train.total_steps must be at least 1");
  check(c.train.warmup_steps <= c.train.total_steps, c,
        detail::concat("train.warmup_steps (", c.train.warmup_steps,
                       ") must not exceed train.total_steps (", c.train.total_steps, ")"));
  check(c.train.eval_every >= 0, c, "train.eval_every must not be negative (0 disables eval)");
  check(c.train.eval_batches >= 1, c, "train.eval_batches must be at least 1");
  check(c.train.grad_clip >= 0, c, "train.grad_clip must not be negative (0 disables it)");

  check(c.diloco.fragments >= 1, c, "diloco.fragments must be at least 1");
  check(c.diloco.H >= 1 && c.diloco.H % c.diloco.fragments == 0, c,
        detail::concat("diloco.H (", c.diloco.H, ") must be a positive multiple of ",
                       "diloco.fragments (", c.diloco.fragments, ")"));
  check(c.diloco.blend_alpha >= 0 && c.diloco.blend_alpha < 1, c,
        "diloco.blend_alpha must be in [0, 1) (0 overwrites with the received parameters)");
  check(c.diloco.adopt == "overwrite" || c.diloco.adopt == "rebase", c,
        "diloco.adopt must be \"overwrite\" or \"rebase\", not \"" + c.diloco.adopt + "\"");
  check(c.diloco.adopt == "overwrite" || c.diloco.blend_alpha == 0, c,
        "diloco.blend_alpha mixes on overwrite: set it to 0 with diloco.adopt = \"rebase\"");
  check(c.diloco.cut_on_arrival >= 0 && c.diloco.cut_on_arrival <= 1, c,
        detail::concat("diloco.cut_on_arrival (", c.diloco.cut_on_arrival,
                       ") must be in [0, 1]: a share of H (0 disables the cut before an overwrite)"));
  check(c.diloco.wait_steps >= -1, c,
        detail::concat("diloco.wait_steps (", c.diloco.wait_steps,
                       ") must be -1 (never wait) or at least 0 (steps run before waiting for the merge)"));
  check(c.diloco.wait_timeout_seconds > 0, c, "diloco.wait_timeout_seconds must be positive");

  check(c.codec.block_size >= 1, c, "codec.block_size must be at least 1");
  check(c.codec.downlink_block_size >= 1 && c.codec.downlink_block_size <= (1u << 20), c,
        "codec.downlink_block_size must be between 1 and 1048576");
  for (const auto& [topk, dtype, block, key] :
       {std::tuple{c.codec.topk, c.codec.dtype, c.codec.block_size, "codec.topk"},
        std::tuple{c.codec.downlink_topk, c.codec.downlink_dtype, c.codec.downlink_block_size, "codec.downlink_topk"}}) {
    try {
      check_topk(dtype, block, topk, key);
    } catch (const InvalidInput& e) {
      throw InvalidInput(detail::concat(c.source, ": ", e.what()));
    }
  }
  check(c.codec.chunk_bytes >= 4096 && c.codec.chunk_bytes <= (1ull << 30), c,
        "codec.chunk_bytes must be between 4096 and 1073741824 (1 GiB)");
  check(c.codec.segment_bytes >= 4096 && c.codec.segment_bytes <= (1ull << 30), c,
        "codec.segment_bytes must be between 4096 and 1073741824 (1 GiB: a segment must stay below the 2 GiB "
        "a FlatBuffer can address)");
  check(c.codec.zstd_level >= 1 && c.codec.zstd_level <= 22, c,
        "codec.zstd_level must be between 1 and 22");

  const auto& m = c.merger;
  check(m.quorum >= 1, c, "merger.quorum must be at least 1");
  check(m.transaction_seconds >= 1 && m.transaction_seconds <= 900, c,
        "merger.transaction_seconds must be between 1 and 900 (the broker's transaction.max.timeout.ms)");
  check(m.min_write_mb_per_s > 0 && std::isfinite(m.min_write_mb_per_s), c,
        "merger.min_write_mb_per_s must be positive (the slowest write rate to the broker to allow for)");
  check(m.max_norm_ratio == 0 || m.max_norm_ratio >= 1, c,
        "merger.max_norm_ratio must be 0 (no bound) or at least 1, not " + std::to_string(m.max_norm_ratio));
  check(m.grace_gamma >= 0 && m.grace_tau >= 0 && m.grace_cap_steps >= 0 && m.grace_cap_seconds >= 0, c,
        "merger.grace_gamma, grace_tau, grace_cap_steps and grace_cap_seconds must not be negative");
  check(m.staleness_alpha >= 0, c, "merger.staleness_alpha must not be negative");
  check(m.max_staleness >= -1, c, "merger.max_staleness must be -1 (no limit) or at least 0");
  check(m.outer_lr > 0, c, "merger.outer_lr must be positive");
  check(m.outer_momentum >= 0 && m.outer_momentum < 1, c, "merger.outer_momentum must be in [0, 1)");
  check(m.rule == "rda" || m.rule == "avg", c, "merger.rule must be \"rda\" or \"avg\", not \"" + m.rule + "\"");
  check(parse_outer_optimizer(m.optimizer).has_value(), c,
        "merger.optimizer must be one of " + outer_optimizer_names() + ", not \"" + m.optimizer + "\"");
  check(m.dn_period >= 1, c, "merger.dn_period must be at least 1");
  check(m.momentum_final >= 0 && m.momentum_final < 1, c, "merger.momentum_final must be in [0, 1)");
  check(m.momentum_decay_to == 0 || m.momentum_decay_to > m.momentum_decay_from, c,
        detail::concat("merger.momentum_decay_to (", m.momentum_decay_to, ") must be 0 (no decay) or after "
                       "merger.momentum_decay_from (", m.momentum_decay_from, ")"));
  check((m.momentum_warmup == 0 && m.momentum_decay_to == 0) || m.optimizer == "nesterov" || m.optimizer == "dn", c,
        "merger.momentum_warmup and momentum_decay_* schedule the momentum of optimizer \"nesterov\" or \"dn\", not \"" +
            m.optimizer + "\" (sgd has none; cgad's beta1 has a bias correction that assumes it constant)");
  check(m.dn_activation >= 0 && m.dn_activation <= 1, c, "merger.dn_activation must be in [0, 1]");
  check(m.cgad_decay >= 0 && std::isfinite(m.cgad_decay), c, "merger.cgad_decay must not be negative");
  check(m.cgad_cutoff >= 1, c, "merger.cgad_cutoff must be at least 1");
  check(m.adam_beta2 >= 0 && m.adam_beta2 < 1, c, "merger.adam_beta2 must be in [0, 1)");
  check(m.adam_epsilon > 0 && std::isfinite(m.adam_epsilon), c, "merger.adam_epsilon must be positive");
  check(m.checkpoint_every >= 1, c, "merger.checkpoint_every must be at least 1");
  check(m.liveness_seconds > 0, c, "merger.liveness_seconds must be positive");
  check(m.members_lookback_seconds >= m.liveness_seconds, c,
        "merger.members_lookback_seconds must be at least merger.liveness_seconds (a live learner's heartbeat "
        "must be in the tail read)");
  check(m.republish_seconds >= 0, c, "merger.republish_seconds must be 0 (off) or positive");

  const auto& k = c.cluster;
  check(k.learners >= 1, c, "cluster.learners must be at least 1");
  check(k.mergers >= 1, c, "cluster.mergers must be at least 1");
  check(!k.regions.empty(), c, "cluster.regions must name at least one region");
  for (const auto& r : k.regions)
    check(!r.empty() && r.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") ==
                            std::string::npos,
          c, "cluster.regions: \"" + r + "\" may only use letters, digits, '_' and '-' (it is part of a topic name)");
  for (double f : k.speed_factors)
    check(f >= 1.0 && f <= 1000.0, c, detail::concat("cluster.speed_factors: ", f, " must be in [1, 1000] (2 = half speed)"));
  check(k.eval_interval > 0, c, "cluster.eval_interval must be positive");

  const auto& sec = c.security;
  check(sec.merger_secret_key.empty() || !sec.allowed_learners.empty(), c,
        "security.merger_secret_key needs security.allowed_learners (a directory of the learners' .key files): "
        "CURVE without an allow-list would accept any learner");
  check(sec.learner_key.empty() || !sec.merger_public_key.empty(), c,
        "security.learner_key needs security.merger_public_key (the key the mergers prove)");
  check(sec.kafka_protocol == "plaintext" || sec.kafka_protocol == "ssl" || sec.kafka_protocol == "sasl_ssl", c,
        "security.kafka_protocol must be \"plaintext\", \"ssl\" or \"sasl_ssl\", not \"" + sec.kafka_protocol + "\"");
  check(sec.kafka_mechanism == "SCRAM-SHA-512" || sec.kafka_mechanism == "SCRAM-SHA-256", c,
        "security.kafka_mechanism must be \"SCRAM-SHA-512\" or \"SCRAM-SHA-256\", not \"" + sec.kafka_mechanism + "\"");
  check(sec.kafka_protocol != "sasl_ssl" || !sec.kafka_credentials.empty(), c,
        "security.kafka_protocol = \"sasl_ssl\" needs security.kafka_credentials (a file of this process's "
        "username= and password=, mode 0600)");
  check(sec.kafka_protocol == "sasl_ssl" || sec.kafka_credentials.empty(), c,
        "security.kafka_credentials is set but security.kafka_protocol is \"" + sec.kafka_protocol +
            "\": the password would not be used; set kafka_protocol = \"sasl_ssl\"");
  check(sec.kafka_protocol != "plaintext" || sec.kafka_certificate.empty(), c,
        "security.kafka_certificate is set but security.kafka_protocol is \"plaintext\": set kafka_protocol = \"ssl\" "
        "to present it");
  check(sec.kafka_protocol != "plaintext" || sec.kafka_ca.empty(), c,
        "security.kafka_ca is set but security.kafka_protocol is \"plaintext\": set kafka_protocol = \"ssl\" "
        "(or \"sasl_ssl\") to use TLS");

  check(!c.data.path.empty(), c, "data.path must not be empty");
  check(c.data.heldout_fraction > 0 && c.data.heldout_fraction <= 0.5, c,
        "data.heldout_fraction must be in (0, 0.5]");
}

}  // namespace diloco
