#include "core/codec/learner_state.h"

#include "core/codec/tensor_wire.h"
#include "core/errors.h"
#include "schemas/learner_state_generated.h"

namespace diloco {

using namespace tensor_wire;

namespace {

constexpr WireCodec kSavedCodec{.dtype = DType::F32, .block_size = 0, .byte_shuffle = false};

// Flat per-tensor vectors as Tensors shaped like the fragment's (empty list: nothing saved).
std::vector<DenseTensor> as_tensors(const std::vector<std::vector<float>>& values, const std::vector<DenseTensor>& like) {
  std::vector<DenseTensor> out;
  for (size_t t = 0; t < values.size(); ++t) out.push_back(DenseTensor{static_cast<uint32_t>(t), like.at(t).shape, values[t]});
  return out;
}

std::vector<std::vector<float>> as_values(std::vector<DenseTensor> tensors) {
  std::vector<std::vector<float>> out;
  for (auto& t : tensors) out.push_back(std::move(t.values));
  return out;
}

}  // namespace

std::vector<uint8_t> encode_learner_state(const SavedLearner& state) {
  flatbuffers::FlatBufferBuilder fbb(1 << 20);
  std::vector<flatbuffers::Offset<wire::FragmentProgress>> fragments;
  for (const auto& f : state.fragments) {
    const auto anchor = add_dense(fbb, f.anchor, kSavedCodec);
    const auto carried = add_dense(fbb, as_tensors(f.carried, f.anchor), kSavedCodec);
    const auto last_cut = add_dense(fbb, as_tensors(f.last_cut, f.anchor), kSavedCodec);
    const auto cut_point = add_dense(fbb, as_tensors(f.cut_point, f.anchor), kSavedCodec);
    fragments.push_back(wire::CreateFragmentProgress(fbb, f.fragment, f.version, f.checksum, anchor, carried, last_cut,
                                                     f.sent_on_base, f.steps, f.tokens, cut_point, f.steps_at_cut,
                                                     f.tokens_at_cut, f.seq));
  }
  const auto fragment_vector = fbb.CreateVector(fragments);
  const auto run_id = fbb.CreateString(state.run_id);
  const auto learner_id = fbb.CreateString(state.learner_id);
  const auto root = wire::CreateLearnerState(fbb, kSchemaVersion, run_id, state.fingerprint, learner_id, state.step,
                                             state.tokens, fragment_vector);
  wire::FinishLearnerStateBuffer(fbb, root);
  return compress_finished(fbb, 1);
}

SavedLearner decode_learner_state(std::span<const uint8_t> bytes, const DecodeLimits& limits) {
  DILOCO_ENFORCE(limits.layout != nullptr, "decoding a saved learner state needs the model's layout");
  const auto& m = open_root<wire::LearnerState>(bytes, limits, wire::VerifyLearnerStateBuffer, "LearnerState");
  check_fingerprint(m.fingerprint(), limits);
  SavedLearner out;
  out.run_id = m.run_id()->str();
  out.fingerprint = m.fingerprint();
  out.learner_id = required(m.learner_id(), "learner_id");
  out.step = m.step();
  out.tokens = m.tokens();
  check_counter(out.step, "step");
  const uint32_t n = limits.layout->num_fragments();
  // Every fragment the learner takes part in (all of them, or RuntimeOptions::fragments): which
  // ones the learner that loads it checks.
  if (!m.fragments() || m.fragments()->size() == 0 || m.fragments()->size() > n)
    reject(RejectReason::TensorCountMismatch,
           detail::concat("a saved learner state of ", m.fragments() ? m.fragments()->size() : 0,
                          " fragments, the layout has ", n));
  std::vector<bool> seen(n, false);
  for (const auto* f : *m.fragments()) {
    const auto& specs = fragment_specs(f->fragment(), limits);
    if (seen[f->fragment()]) reject(RejectReason::BadCounter, detail::concat("fragment ", f->fragment(), " saved twice"));
    seen[f->fragment()] = true;
    SavedFragment s{.fragment = f->fragment(), .version = f->version(), .checksum = f->checksum(),
                    .sent_on_base = f->sent_on_base(), .steps = f->steps(), .tokens = f->tokens(),
                    .steps_at_cut = f->steps_at_cut(), .tokens_at_cut = f->tokens_at_cut(), .seq = f->seq()};
    check_counter(s.version, "version");
    check_counter(s.seq, "seq");
    decode_tensors(f->anchor(), specs, kSavedCodec, "anchor", s.anchor);
    auto optional = [&](const TensorVector* list, const char* field, bool required_here) {
      std::vector<DenseTensor> tensors;
      if (list && list->size() != 0)
        decode_tensors(list, specs, kSavedCodec, field, tensors);
      else if (required_here)
        reject(RejectReason::MissingField, detail::concat("fragment ", s.fragment, ": ", field, " is missing"));
      return as_values(std::move(tensors));
    };
    s.carried = optional(f->carried(), "carried", true);
    s.last_cut = optional(f->last_cut(), "last_cut", s.sent_on_base);
    s.cut_point = optional(f->cut_point(), "cut_point", s.sent_on_base);
    out.fragments.push_back(std::move(s));
  }
  return out;
}

}  // namespace diloco
