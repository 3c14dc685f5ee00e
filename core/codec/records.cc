// Messages without tensors: MergeRecord, Member, Rejected, RoundOpen. Decoding checks the frame, the schema
// version and the run id (MergeRecord also the fingerprint, the fragment range when a layout is
// given, and that weights and hyper-parameters are finite); enum values outside the schema are
// BadFlatbuffer, like any other buffer the schema cannot describe.
#include <cmath>
#include <utility>

#include "core/codec/messages.h"
#include "core/codec/tensor_wire.h"
#include "schemas/member_generated.h"
#include "schemas/merge_record_generated.h"
#include "schemas/rejected_generated.h"
#include "schemas/round_open_generated.h"

namespace diloco {

using namespace tensor_wire;

namespace {

constexpr size_t kMaxPayloadHead = 256;

template <typename Enum>
Enum checked_enum(uint8_t raw, Enum last, const char* field) {
  if (raw > static_cast<uint8_t>(last))
    reject(RejectReason::BadFlatbuffer,
           detail::concat(field, ": unknown value ", static_cast<int>(raw)));
  return static_cast<Enum>(raw);
}

void check_finite(double v, const char* field) {
  if (!std::isfinite(v)) reject(RejectReason::NonFinite, detail::concat(field, " is ", v));
}

flatbuffers::Offset<wire::DeltaRef> add_delta_ref(flatbuffers::FlatBufferBuilder& fbb,
                                                  const DeltaRef& d) {
  const auto position = add_position(fbb, d.position);
  const auto learner_id = fbb.CreateString(d.learner_id);
  return wire::CreateDeltaRef(fbb, position, learner_id, d.seq, d.base_version, d.staleness,
                              d.inner_steps, d.tokens, d.weight);
}

DeltaRef read_delta_ref(const wire::DeltaRef* d, const char* field) {
  if (!d) reject(RejectReason::MissingField, std::string(field) + " is missing");
  DeltaRef out;
  out.position = read_position(d->position(), "position");
  out.learner_id = required(d->learner_id(), "learner_id");
  out.seq = d->seq();
  out.base_version = d->base_version();
  out.staleness = d->staleness();
  out.inner_steps = d->inner_steps();
  out.tokens = d->tokens();
  out.weight = d->weight();
  check_finite(out.weight, "weight");
  return out;
}

}  // namespace

const char* drop_reason_name(DropReason r) {
  switch (r) {
    case DropReason::None: return "none";
    case DropReason::Superseded: return "superseded";
    case DropReason::TooStale: return "too_stale";
    case DropReason::Invalid: return "invalid";
    case DropReason::PendingAtStop: return "pending_at_stop";
  }
  return "unknown";
}

namespace {
constexpr std::pair<OuterOptimizerKind, const char*> kOuterOptimizers[] = {
    {OuterOptimizerKind::Nesterov, "nesterov"},
    {OuterOptimizerKind::Sgd, "sgd"},
    {OuterOptimizerKind::DelayedNesterov, "dn"},
    {OuterOptimizerKind::Cgad, "cgad"}};
}  // namespace

const char* outer_optimizer_name(OuterOptimizerKind kind) {
  for (const auto& [k, name] : kOuterOptimizers)
    if (k == kind) return name;
  return "unknown";
}

std::optional<OuterOptimizerKind> parse_outer_optimizer(std::string_view name) {
  for (const auto& [k, n] : kOuterOptimizers)
    if (name == n) return k;
  return std::nullopt;
}

std::string outer_optimizer_names() {
  std::string out;
  for (const auto& [k, name] : kOuterOptimizers) out += (out.empty() ? "" : ", ") + std::string(name);
  return out;
}

bool has_outer_state(OuterOptimizerKind kind) {
  return kind == OuterOptimizerKind::DelayedNesterov || kind == OuterOptimizerKind::Cgad;
}

const char* role_name(Role r) {
  switch (r) {
    case Role::Learner: return "learner";
    case Role::Merger: return "merger";
    case Role::Evaluator: return "evaluator";
  }
  return "unknown";
}

// ---- MergeRecord ----------------------------------------------------------------------------

std::vector<uint8_t> encode_merge_record(const MergeRecord& msg, int zstd_level) {
  auto& fbb = builder();
  std::vector<flatbuffers::Offset<wire::DeltaRef>> inputs;
  inputs.reserve(msg.inputs.size());
  for (const auto& d : msg.inputs) inputs.push_back(add_delta_ref(fbb, d));
  const auto inputs_vector = fbb.CreateVector(inputs);
  std::vector<flatbuffers::Offset<wire::DroppedDelta>> dropped;
  dropped.reserve(msg.dropped.size());
  for (const auto& d : msg.dropped) {
    const auto ref = add_delta_ref(fbb, d.delta);
    const auto detail = fbb.CreateString(d.detail);
    dropped.push_back(
        wire::CreateDroppedDelta(fbb, ref, static_cast<wire::DropReason>(d.reason), detail));
  }
  const auto dropped_vector = fbb.CreateVector(dropped);
  const auto& h = msg.hyper;
  const auto hyper = wire::CreateOuterHyper(fbb, h.lr, h.momentum, h.staleness_alpha,
                                            h.max_staleness, h.quorum, h.dn_period,
                                            h.dn_activation, h.cgad_decay, h.cgad_cutoff,
                                            h.adam_beta2, h.adam_epsilon);
  const auto run_id = fbb.CreateString(msg.run_id);
  const auto merger = fbb.CreateString(msg.merger_instance);
  // Absent for an fp32 downlink, as in records written before the field existed.
  const auto downlink =
      msg.downlink.dtype == DType::F32
          ? flatbuffers::Offset<wire::Codec>()
          : add_codec(fbb, codec_of({.dtype = msg.downlink.dtype, .block_size = msg.downlink.block_size,
                                     .topk = msg.downlink.topk}));
  const auto root = wire::CreateMergeRecord(
      fbb, kSchemaVersion, run_id, msg.fingerprint, msg.fragment, msg.version, msg.prev_version,
      inputs_vector, dropped_vector, static_cast<wire::MergeRule>(msg.rule),
      static_cast<wire::OuterOptimizer>(msg.optimizer), hyper, msg.checksum, merger, msg.epoch,
      msg.merge_time_us, msg.share, msg.staleness_scale, downlink, msg.norm_block, msg.genesis);
  wire::FinishMergeRecordBuffer(fbb, root);
  return compress_finished(fbb, zstd_level);
}

MergeRecord decode_merge_record(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  const auto& m = open_root<wire::MergeRecord>(bytes, limits, wire::VerifyMergeRecordBuffer,
                                               "MergeRecord");
  check_fingerprint(m.fingerprint(), limits);
  if (limits.layout) fragment_specs(m.fragment(), limits);
  MergeRecord out;
  out.run_id = m.run_id()->str();
  out.fingerprint = m.fingerprint();
  out.fragment = m.fragment();
  out.version = m.version();
  out.prev_version = m.prev_version();
  check_counter(out.version, "version");
  check_counter(out.prev_version, "prev_version");
  if (m.inputs())
    for (const auto* d : *m.inputs()) out.inputs.push_back(read_delta_ref(d, "inputs"));
  if (m.dropped())
    for (const auto* d : *m.dropped()) {
      DroppedDelta dd;
      dd.delta = read_delta_ref(d->delta(), "dropped.delta");
      dd.reason = checked_enum(static_cast<uint8_t>(d->reason()), DropReason::PendingAtStop,
                               "dropped.reason");
      dd.detail = required(d->detail(), "dropped.detail");
      out.dropped.push_back(std::move(dd));
    }
  out.rule = checked_enum(static_cast<uint8_t>(m.rule()), MergeRule::WeightedAverage, "rule");
  out.optimizer =
      checked_enum(static_cast<uint8_t>(m.optimizer()), OuterOptimizerKind::Cgad, "optimizer");
  const auto* h = m.hyper();
  if (!h) reject(RejectReason::MissingField, "hyper is missing");
  out.hyper = {.lr = h->lr(),
               .momentum = h->momentum(),
               .staleness_alpha = h->staleness_alpha(),
               .max_staleness = h->max_staleness(),
               .quorum = h->quorum(),
               .dn_period = h->dn_period(),
               .dn_activation = h->dn_activation(),
               .cgad_decay = h->cgad_decay(),
               .cgad_cutoff = h->cgad_cutoff(),
               .adam_beta2 = h->adam_beta2(),
               .adam_epsilon = h->adam_epsilon()};
  for (const auto& [value, field] :
       {std::pair{out.hyper.lr, "hyper.lr"}, {out.hyper.momentum, "hyper.momentum"},
        {out.hyper.staleness_alpha, "hyper.staleness_alpha"},
        {out.hyper.dn_activation, "hyper.dn_activation"}, {out.hyper.cgad_decay, "hyper.cgad_decay"},
        {out.hyper.adam_beta2, "hyper.adam_beta2"}, {out.hyper.adam_epsilon, "hyper.adam_epsilon"}})
    check_finite(value, field);
  out.checksum = m.checksum();
  out.merger_instance = required(m.merger_instance(), "merger_instance");
  out.epoch = m.epoch();
  out.merge_time_us = m.merge_time_us();
  out.share = m.share();
  out.staleness_scale = m.staleness_scale();
  for (const auto& [value, field] :
       {std::pair{out.share, "share"}, {out.staleness_scale, "staleness_scale"}}) {
    check_finite(value, field);
    if (!(value > 0.0f && value <= 1.0f))
      reject(RejectReason::BadCounter, detail::concat(field, " ", value, " is not in (0, 1]"));
  }
  if (m.downlink()) {
    const WireCodec c = check_codec(m.downlink());
    out.downlink = {.dtype = c.dtype, .block_size = c.block_size, .topk = c.topk};
  }
  out.norm_block = m.norm_block();
  if (!valid_norm_block(out.norm_block))
    reject(RejectReason::BadCounter,
           detail::concat("norm_block ", out.norm_block, " is neither 0 nor a power of two in [", kMinNormBlock,
                          ", ", kMaxNormBlock, "]"));
  out.genesis = m.genesis();
  if (out.genesis && (out.version != 0 || out.prev_version != 0 || out.inputs.size() != 1))
    reject(RejectReason::BadCounter,
           detail::concat("a genesis record must make version 0 from one proposal, not version ", out.version,
                          " from ", out.inputs.size(), " inputs"));
  return out;
}

// ---- Member ---------------------------------------------------------------------------------

std::vector<uint8_t> encode_member(const Member& msg) {
  auto& fbb = builder();
  const auto run_id = fbb.CreateString(msg.run_id);
  const auto instance_id = fbb.CreateString(msg.instance_id);
  const auto region = fbb.CreateString(msg.region);
  const auto endpoint = fbb.CreateString(msg.endpoint);
  const auto owned = fbb.CreateVector(msg.owned_fragments);
  const auto versions = fbb.CreateVector(msg.fragment_versions);
  const auto checksums = fbb.CreateVector(msg.fragment_checksums);
  const auto root = wire::CreateMember(
      fbb, kSchemaVersion, run_id, instance_id, static_cast<wire::Role>(msg.role), region,
      endpoint, msg.epoch, owned, versions, msg.time_us, msg.step, msg.step_time_s,
      msg.tokens_per_s, msg.loss, msg.tokens, msg.bytes_sent, msg.bytes_received, checksums,
      msg.announce_interval_s, msg.incarnation, msg.leaving, msg.batch, msg.context);
  wire::FinishMemberBuffer(fbb, root);
  return compress_finished(fbb, 1);
}

Member decode_member(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  const auto& m = open_root<wire::Member>(bytes, limits, wire::VerifyMemberBuffer, "Member");
  Member out;
  out.run_id = m.run_id()->str();
  out.instance_id = required(m.instance_id(), "instance_id");
  out.role = checked_enum(static_cast<uint8_t>(m.role()), Role::Evaluator, "role");
  out.region = required(m.region(), "region");
  out.endpoint = required(m.endpoint(), "endpoint");
  out.epoch = m.epoch();
  out.owned_fragments = copy_vector(m.owned_fragments());
  out.fragment_versions = copy_vector(m.fragment_versions());
  if (out.owned_fragments.size() != out.fragment_versions.size())
    reject(RejectReason::BadFlatbuffer,
           detail::concat(out.owned_fragments.size(), " owned fragments but ",
                          out.fragment_versions.size(), " fragment versions"));
  out.fragment_checksums = copy_vector(m.fragment_checksums());
  if (!out.fragment_checksums.empty() && out.fragment_checksums.size() != out.owned_fragments.size())
    reject(RejectReason::BadFlatbuffer,
           detail::concat(out.owned_fragments.size(), " owned fragments but ",
                          out.fragment_checksums.size(), " fragment checksums"));
  out.time_us = m.time_us();
  out.step = m.step();
  out.step_time_s = m.step_time_s();
  out.tokens_per_s = m.tokens_per_s();
  out.loss = m.loss();
  out.tokens = m.tokens();
  out.bytes_sent = m.bytes_sent();
  out.bytes_received = m.bytes_received();
  out.announce_interval_s = m.announce_interval_s();
  if (!std::isfinite(out.announce_interval_s) || out.announce_interval_s < 0)
    reject(RejectReason::BadFlatbuffer, detail::concat("announce interval ", out.announce_interval_s, " s"));
  out.incarnation = m.incarnation();
  out.leaving = m.leaving();
  out.batch = m.batch();
  out.context = m.context();
  return out;
}

// ---- Rejected -------------------------------------------------------------------------------

std::vector<uint8_t> encode_rejected(const RejectedInput& msg) {
  auto& fbb = builder();
  const auto source = add_position(fbb, msg.source);
  const auto run_id = fbb.CreateString(msg.run_id);
  const auto reason = fbb.CreateString(msg.reason);
  const auto detail = fbb.CreateString(msg.detail);
  const auto rejected_by = fbb.CreateString(msg.rejected_by);
  const auto head = fbb.CreateVector(msg.payload_head.data(),
                                     std::min(msg.payload_head.size(), kMaxPayloadHead));
  const auto sender = fbb.CreateString(msg.sender);
  const auto root = wire::CreateRejected(fbb, kSchemaVersion, run_id, source, reason, detail,
                                         rejected_by, msg.time_us, msg.payload_size, head, sender);
  wire::FinishRejectedBuffer(fbb, root);
  return compress_finished(fbb, 1);
}

RejectedInput decode_rejected(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  const auto& m =
      open_root<wire::Rejected>(bytes, limits, wire::VerifyRejectedBuffer, "Rejected");
  RejectedInput out;
  out.run_id = m.run_id()->str();
  out.source = read_position(m.source(), "source");
  out.reason = required(m.reason(), "reason");
  out.detail = required(m.detail(), "detail");
  out.rejected_by = required(m.rejected_by(), "rejected_by");
  out.time_us = m.time_us();
  out.payload_size = m.payload_size();
  if (const auto* head = m.payload_head()) {
    if (head->size() > kMaxPayloadHead)
      reject(RejectReason::BadFlatbuffer,
             detail::concat("payload_head of ", head->size(), " bytes, at most ",
                            kMaxPayloadHead));
    out.payload_head = copy_vector(head);
  }
  if (const auto* sender = m.sender()) out.sender = sender->str();
  return out;
}

// ---- RoundOpen ------------------------------------------------------------------------------

std::vector<uint8_t> encode_round_open(const RoundOpen& msg) {
  auto& fbb = builder();
  const auto run_id = fbb.CreateString(msg.run_id);
  const auto merger = fbb.CreateString(msg.merger_instance);
  const auto root = wire::CreateRoundOpen(fbb, kSchemaVersion, run_id, msg.fingerprint, msg.fragment,
                                          msg.version, msg.pending, msg.grace_ms, merger, msg.epoch,
                                          msg.time_us);
  wire::FinishRoundOpenBuffer(fbb, root);
  return compress_finished(fbb, 1);
}

RoundOpen decode_round_open(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  const auto& m = open_root<wire::RoundOpen>(bytes, limits, wire::VerifyRoundOpenBuffer, "RoundOpen");
  check_fingerprint(m.fingerprint(), limits);
  if (limits.layout) fragment_specs(m.fragment(), limits);
  RoundOpen out;
  out.run_id = m.run_id()->str();
  out.fingerprint = m.fingerprint();
  out.fragment = m.fragment();
  out.version = m.version();
  check_counter(out.version, "version");
  out.pending = m.pending();
  out.grace_ms = m.grace_ms();
  out.merger_instance = required(m.merger_instance(), "merger_instance");
  out.epoch = m.epoch();
  out.time_us = m.time_us();
  return out;
}

}  // namespace diloco
