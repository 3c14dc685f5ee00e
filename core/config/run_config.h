// The run config: one TOML file (configs/*.toml) plus "section.key=value" overrides from the
// command line. Every field has a default, so a file only says what differs. Unknown sections and
// keys are errors naming the key and the file: a typo must never silently leave a default in place.
//
// Adding a section (e.g. [kafka], [merger]): add its struct and a member to RunConfig, write one
// parse function that walks the section's keys (see run_config.cc), list it in kSections there,
// and check its ranges in validate_run_config.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>
#include <string_view>

#include "core/codec/quantize.h"

namespace diloco {

struct RunSection {
  std::string id = "dev";  // names the Kafka topics (diloco.<id>.*) and goes into every message
  uint64_t seed = 1;       // model initialisation and data sampling
};

// The vocabulary is not configurable: it is the fixed character set of core/data/corpus.h
// (printable ASCII plus newline), so the model's shape never depends on the corpus file.
struct ModelConfig {
  int64_t layers = 2;
  int64_t width = 64;    // model dimension; a multiple of heads
  int64_t heads = 4;
  int64_t context = 64;  // characters per training sequence
};

struct TrainConfig {
  int64_t batch = 16;           // sequences per inner step
  double lr = 3e-3;             // peak inner (AdamW) learning rate
  double weight_decay = 0.1;    // on matrices and embeddings only
  int64_t warmup_steps = 50;    // linear warmup, then cosine decay to 10% of lr at total_steps
  int64_t total_steps = 2000;
  int64_t eval_every = 100;     // inner steps between held-out evaluations; 0 disables them
  int64_t eval_batches = 8;     // batches per held-out evaluation
  double grad_clip = 1.0;       // max global gradient norm; 0 disables clipping
};

struct DilocoConfig {
  uint32_t fragments = 4;    // P
  uint32_t H = 100;          // inner steps between two syncs of one fragment; a multiple of P
  // How a learner takes a received version of a fragment: "overwrite" (the paper; with
  // blend_alpha > 0, Streaming DiLoCo's mixing) or "rebase": received plus the local progress not
  // yet in it (the steps since its last cut, or since its base if it cut nothing on it), which
  // its next delta then carries, so adoption never throws training away.
  std::string adopt = "rebase";
  // With adopt = "overwrite": theta = alpha * theta_local + (1 - alpha) * received; 0 overwrites.
  double blend_alpha = 0.0;
  // false: every learner cuts fragment p at steps (p+1)*H/P + k*H of its own step count, so one
  // fragment's deltas from several learners meet in one merge. true: learner m is shifted by m*H/M.
  bool stagger = false;
  // When a version of p arrives that does not contain this learner's progress on p (no delta of p
  // sent on the current base), or a merger's RoundOpen notice says p's quorum is in, and the
  // learner has done at least cut_on_arrival * H steps on p, it cuts that delta at once (before
  // adopting); p's next cut is H steps later. In [0, 1]; 0 disables it.
  double cut_on_arrival = 0.5;
  // -1: never wait (Decoupled DiLoCo). k >= 0: after sending a delta of p on base b, run at most k
  // more inner steps, then wait until a version of p above b arrives (0 with merger.quorum equal
  // to the number of learners is synchronous DiLoCo).
  int64_t wait_steps = -1;
  double wait_timeout_seconds = 300;  // a wait longer than this is given up (wait_timeout event)
};

struct CodecConfig {
  DType dtype = DType::INT4;  // of outer gradients on the wire
  uint32_t block_size = 64;   // values per quantization scale (int8/int4)
  // Top-k with error feedback: only the topk values of largest magnitude of each block travel, the
  // rest stays in the learner's residual until it is large enough (0: every value; int8/int4
  // only, below block_size). The wire format does not change: the zeros cost zstd almost nothing.
  uint32_t topk = 0;
  bool byte_shuffle = true;
  int zstd_level = 3;
  // How new global versions travel from mergers to learners: fp32 snapshots, or updates (the
  // change from the previous version) quantized this way with error feedback at the merger; the
  // global parameters are defined as what a learner reconstructs, so checksums stay exact.
  DType downlink_dtype = DType::INT4;
  uint32_t downlink_block_size = 64;
  uint32_t downlink_topk = 0;  // the same top-k for updates, the rest kept by the merger's residual
  // A message larger than this travels as pieces of at most this many bytes, all-or-nothing
  // (core/codec/chunk.h); it must fit one Kafka record with the chunk framing (checked at start).
  uint64_t chunk_bytes = 4ull << 20;
  // A checkpoint, snapshot or proposal of version 0 holding more than this many bytes of values
  // (4 bytes a value; a checkpoint counts params, momentum and the other buffers) travels
  // streamed: in segments of at most this many, each decoded into place by its reader
  // (core/codec/messages.h), so no reader holds it encoded whole and no FlatBuffer passes 2 GiB.
  // On Kafka each segment travels as chunk_bytes pieces, on ZeroMQ as one message.
  uint64_t segment_bytes = 256ull << 20;
};

enum class DataSplit {
  iid,     // every learner strides over all training text
  region,  // each region trains on its own books (non-iid)
};
DataSplit parse_data_split(std::string_view);  // "iid" | "region"; throws InvalidInput
const char* data_split_name(DataSplit);

struct DataConfig {
  std::string path = "data/kjv.txt";  // written by scripts/bootstrap; relative to the working dir
  DataSplit split = DataSplit::iid;
  double heldout_fraction = 0.05;     // share of chapters held out for evaluation
};

// The merger's policy (ARCHITECTURE.md section 6); the paper's defaults.
struct MergerConfig {
  uint32_t quorum = 1;               // K: distinct learners needed before a fragment may merge
  double grace_gamma = 0.5;          // share of the overlap slack spent waiting for more learners
  double grace_tau = 4;              // overlap in inner steps
  double grace_cap_steps = 2;        // grace never exceeds this many learner step times
  double grace_cap_seconds = 30;     // nor this many seconds
  double staleness_alpha = 0;        // weight factor (1 + staleness)^-alpha; 0 is the paper
  int64_t max_staleness = -1;        // drop deltas staler than this; -1: no limit
  // Drop a delta whose L2 norm is above this many times the median of the fragment's recent
  // accepted deltas (the last 16, once there are 4); 0: no bound.
  double max_norm_ratio = 100;
  // Tuned for both modes (bench/quality --tune, tiny, M = 2: the best of 20 points for Decoupled,
  // within 0.001 of the best for synchronous DiLoCo; 0.7 and 0.9, the earlier defaults, lost by
  // 0.09 and 0.20 nats). Sparse configs/demo.toml sets its own (outer SGD).
  double outer_lr = 1.0;
  double outer_momentum = 0.5;
  // The outer momentum's schedule (merger/outer_optimizer.h, scheduled_momentum; nesterov and dn):
  // warmed up linearly from 0 over the first momentum_warmup merges (0: none), and decayed
  // linearly to momentum_final from version momentum_decay_from to momentum_decay_to (0: none).
  uint32_t momentum_warmup = 0;
  uint32_t momentum_decay_from = 0;
  uint32_t momentum_decay_to = 0;
  double momentum_final = 0.5;
  // Scale each merge's outer update by its share of a round (learners merged / live learners of the fragment),
  // so that a round of single-learner merges (quorum 1) adds up to one outer step.
  bool share_scaling = true;
  std::string rule = "rda";          // rda (radial-directional) | avg (weighted average)
  std::string optimizer = "nesterov";  // nesterov | sgd | dn | cgad (merger/outer_optimizer.h)
  // dn (Delayed Nesterov): fold the momentum every dn_period merges (N; by version), applying
  // dn_activation (c) of it in between; outer_lr is the per-merge lr.
  uint32_t dn_period = 2;
  double dn_activation = 0;
  // cgad: scale each merge by exp(-cgad_decay * staleness), gated by a cosine down to 0 at
  // staleness cgad_cutoff, then Adam (beta1 outer_momentum, beta2 adam_beta2, adam_epsilon).
  double cgad_decay = 0.1;
  uint32_t cgad_cutoff = 16;
  double adam_beta2 = 0.99;
  double adam_epsilon = 1e-8;
  uint32_t checkpoint_every = 10;    // write a FragmentState every this many versions
  double liveness_seconds = 15;      // a learner is live if it sent a heartbeat this recently
  // How far back a process starting (or recovering) reads `members`: every live process
  // announces itself more often than this, so older records only describe processes that left.
  // At least liveness_seconds. (A learner looking for its own last announcement, to resume,
  // reads further back: learner/runtime.cc.)
  double members_lookback_seconds = 120;
  // Also re-broadcast every owned fragment this often (0: never, the default). Subscribers that
  // connect or miss a version ask for it (core/zmq/params_channel.h), so this is only a fallback.
  double republish_seconds = 0;
  // A merge's (or a clean stop's) Kafka transaction may stay open for transaction_seconds plus the
  // time to write its bytes at min_write_mb_per_s (the largest: every fragment's checkpoint), up to
  // the broker's 900 s. Longer, and the broker aborts it; a killed merger's open transaction holds
  // back its successor's recovery that long.
  double transaction_seconds = 10;
  double min_write_mb_per_s = 4;
};

// The shape of a local cluster (read by scripts/run-local; every process validates it).
struct ClusterConfig {
  uint32_t learners = 3;
  std::vector<std::string> regions = {"eu", "us"};  // learner i goes to regions[i % size]
  uint32_t mergers = 1;
  std::vector<double> speed_factors;  // learner i is slowed by speed_factors[i] (missing: 1.0)
  double eval_interval = 15;          // seconds between evaluations of the global model
  // Each learner's learning-rate schedule (train.total_steps, train.warmup_steps) divided by its
  // speed factor, so that every learner's schedule ends at the same wall clock (scripts/run-local).
  bool schedule_by_speed = false;
};

// Authenticated parameters (core/zmq/curve.h): ZeroMQ CURVE with an allow-list of learner keys;
// and how Kafka clients reach a secured broker (core/kafka/security.h).
// Key files come from diloco-keys; paths are relative to the working directory. Empty: off (the
// parameters travel in the clear, as on a trusted network). A merger needs merger_secret_key and
// allowed_learners; a learner merger_public_key and learner_key.
struct SecurityConfig {
  std::string merger_public_key;  // NAME.key (or NAME.key_secret) of the mergers' key pair
  std::string merger_secret_key;  // NAME.key_secret of the mergers' key pair (mergers only)
  std::string allowed_learners;   // a directory of the allowed learners' NAME.key files (mergers)
  std::string learner_key;        // this learner's NAME.key_secret (learners)
  // Kafka (core/kafka/security.h): "plaintext", "ssl" (TLS; with kafka_certificate the broker
  // knows the client as the principal its certificate names: scripts/broker --secure) or
  // "sasl_ssl" (TLS + SASL/SCRAM, the principal from kafka_credentials: brokers of others).
  std::string kafka_protocol = "plaintext";
  std::string kafka_ca;           // PEM of the CA that signed the brokers' certificates (empty: the system's)
  std::string kafka_certificate;  // this process's key and certificate, one PEM file of mode 0600 (DIR/tls/NAME.pem)
  std::string kafka_credentials;  // this process's NAME.credentials (username=, password=)
  std::string kafka_mechanism = "SCRAM-SHA-512";
  bool curve() const { return !merger_public_key.empty() || !merger_secret_key.empty(); }
};

struct RunConfig {
  std::string source = "defaults";  // the file (and overrides) it came from, for error messages
  RunSection run;
  ModelConfig model;
  TrainConfig train;
  DilocoConfig diloco;
  CodecConfig codec;
  DataConfig data;
  MergerConfig merger;
  ClusterConfig cluster;
  SecurityConfig security;
};

// Parses the file, applies the overrides in order, then validates. Throws IoError if the file
// cannot be read, InvalidInput for syntax errors, unknown sections or keys, wrong types and
// out-of-range values.
RunConfig load_run_config(const std::filesystem::path& file,
                          std::span<const std::string> overrides = {});

// Parses TOML text (`origin` names it in error messages); does not validate.
RunConfig parse_run_config(std::string_view toml_text, std::string_view origin);

// Sets one field from "section.key=value". The value is read as a TOML value (3e-4, true, "x");
// if it is not valid TOML it is taken as a bare string, so data.split=region works unquoted.
// Checks the field's type but not the cross-field constraints: call validate_run_config after.
void apply_override(RunConfig& config, std::string_view assignment);

// Ranges and constraints between fields (width % heads == 0, H % fragments == 0, ...).
void validate_run_config(const RunConfig& config);

}  // namespace diloco
