#include "core/config/config_json.h"

namespace diloco {

nlohmann::json run_config_json(const RunConfig& c) {
  const auto& m = c.merger;
  return {
      {"run", {{"id", c.run.id}, {"seed", c.run.seed}}},
      {"model", {{"layers", c.model.layers}, {"width", c.model.width}, {"heads", c.model.heads},
                 {"context", c.model.context}}},
      {"train", {{"batch", c.train.batch}, {"lr", c.train.lr}, {"weight_decay", c.train.weight_decay},
                 {"warmup_steps", c.train.warmup_steps}, {"total_steps", c.train.total_steps},
                 {"eval_every", c.train.eval_every}, {"eval_batches", c.train.eval_batches},
                 {"grad_clip", c.train.grad_clip}}},
      {"diloco", {{"fragments", c.diloco.fragments}, {"H", c.diloco.H}, {"adopt", c.diloco.adopt},
                  {"blend_alpha", c.diloco.blend_alpha}, {"stagger", c.diloco.stagger},
                  {"cut_on_arrival", c.diloco.cut_on_arrival}, {"wait_steps", c.diloco.wait_steps},
                  {"wait_timeout_seconds", c.diloco.wait_timeout_seconds}}},
      {"codec", {{"dtype", dtype_name(c.codec.dtype)}, {"block_size", c.codec.block_size}, {"topk", c.codec.topk},
                 {"byte_shuffle", c.codec.byte_shuffle}, {"zstd_level", c.codec.zstd_level},
                 {"downlink_dtype", dtype_name(c.codec.downlink_dtype)},
                 {"downlink_block_size", c.codec.downlink_block_size},
                 {"downlink_topk", c.codec.downlink_topk}, {"chunk_bytes", c.codec.chunk_bytes},
                 {"segment_bytes", c.codec.segment_bytes}}},
      {"data", {{"path", c.data.path}, {"split", data_split_name(c.data.split)},
                {"heldout_fraction", c.data.heldout_fraction}}},
      {"merger", {{"quorum", m.quorum}, {"grace_gamma", m.grace_gamma}, {"grace_tau", m.grace_tau},
                  {"grace_cap_steps", m.grace_cap_steps}, {"grace_cap_seconds", m.grace_cap_seconds},
                  {"staleness_alpha", m.staleness_alpha}, {"max_staleness", m.max_staleness},
                  {"max_norm_ratio", m.max_norm_ratio}, {"outer_lr", m.outer_lr},
                  {"outer_momentum", m.outer_momentum}, {"momentum_warmup", m.momentum_warmup},
                  {"momentum_decay_from", m.momentum_decay_from}, {"momentum_decay_to", m.momentum_decay_to},
                  {"momentum_final", m.momentum_final}, {"share_scaling", m.share_scaling}, {"rule", m.rule},
                  {"optimizer", m.optimizer}, {"dn_period", m.dn_period}, {"dn_activation", m.dn_activation},
                  {"cgad_decay", m.cgad_decay}, {"cgad_cutoff", m.cgad_cutoff}, {"adam_beta2", m.adam_beta2},
                  {"adam_epsilon", m.adam_epsilon}, {"checkpoint_every", m.checkpoint_every},
                  {"liveness_seconds", m.liveness_seconds},
                  {"members_lookback_seconds", m.members_lookback_seconds}, {"republish_seconds", m.republish_seconds},
                  {"transaction_seconds", m.transaction_seconds}, {"min_write_mb_per_s", m.min_write_mb_per_s}}},
      {"cluster", {{"learners", c.cluster.learners}, {"regions", c.cluster.regions}, {"mergers", c.cluster.mergers},
                   {"speed_factors", c.cluster.speed_factors}, {"eval_interval", c.cluster.eval_interval},
                   {"schedule_by_speed", c.cluster.schedule_by_speed}}},
      {"security", {{"merger_public_key", c.security.merger_public_key},
                    {"merger_secret_key", c.security.merger_secret_key},
                    {"allowed_learners", c.security.allowed_learners}, {"learner_key", c.security.learner_key},
                    {"kafka_protocol", c.security.kafka_protocol}, {"kafka_ca", c.security.kafka_ca},
                    {"kafka_certificate", c.security.kafka_certificate},
                    {"kafka_credentials", c.security.kafka_credentials},
                    {"kafka_mechanism", c.security.kafka_mechanism}}},
  };
}

}  // namespace diloco
