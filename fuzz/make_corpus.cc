// Writes the seed corpora of the fuzz targets (fuzz/corpus/<target>/): valid messages of every
// kind, encoded by the project's own encoders for the run of fuzz/fuzz.h, in the framings the
// targets read. scripts/fuzz --make-corpus runs it; the output is deterministic.
//   diloco-fuzz-corpus OUT_DIR SOURCE_DIR   (the configs come from SOURCE_DIR/configs)
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "core/codec/chunk.h"
#include "core/codec/learner_state.h"
#include "core/codec/messages.h"
#include "core/files/safetensors.h"
#include "core/fragments/partition.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

namespace {

std::filesystem::path out_dir;

void write(const std::string& target, const std::string& name, std::span<const uint8_t> bytes) {
  const auto dir = out_dir / target;
  std::filesystem::create_directories(dir);
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw IoError("cannot write " + (dir / name).string());
}

// A message in the framings of fuzz.h: as it travels (mode 0) and as its FlatBuffer (mode 1),
// each with kNoLayout added where `no_layout` says the target reads it that way too.
void message(const std::string& target, const std::string& name, const std::vector<uint8_t>& bytes,
             bool no_layout = false) {
  for (const uint8_t base : {uint8_t{0}, kCompressHere}) {
    write(target, name + (base ? ".flatbuffer" : ".zstd"), seed(bytes, base));
    if (no_layout && base) write(target, name + ".flatbuffer-no-layout", seed(bytes, base | kNoLayout));
  }
}

// A log of messages as the streamed-message targets read it: the mode byte, then each message as
// [2-byte length, little endian][bytes].
std::vector<uint8_t> logged(uint8_t mode, const std::vector<std::vector<uint8_t>>& messages) {
  std::vector<uint8_t> log{mode};
  for (const auto& m : messages) {
    log.push_back(static_cast<uint8_t>(m.size()));
    log.push_back(static_cast<uint8_t>(m.size() >> 8));
    log.insert(log.end(), m.begin(), m.end());
  }
  return log;
}

// Values of fragment p, deterministic, with a zero and a negative zero.
std::vector<DenseTensor> tensors(uint32_t p, float scale) {
  std::vector<DenseTensor> out;
  const auto& specs = layout().fragments[p];
  for (uint32_t k = 0; k < specs.size(); ++k) {
    DenseTensor t{k, specs[k].shape, std::vector<float>(static_cast<size_t>(specs[k].numel()))};
    for (size_t i = 0; i < t.values.size(); ++i)
      t.values[i] = scale * static_cast<float>(static_cast<int>((i * 37 + k * 11) % 19) - 9) / 9.0f;
    t.values[0] = 0.0f;
    if (t.values.size() > 1) t.values[1] = -0.0f;
    out.push_back(std::move(t));
  }
  return out;
}

// Quantized by top-k error feedback (from a zero residual), as a learner or a merger's downlink does.
std::vector<QuantizedTensor> topk_feedback(const std::vector<DenseTensor>& dense, const CodecOptions& codec) {
  std::vector<QuantizedTensor> out;
  for (const auto& t : dense) {
    ErrorFeedback feedback(static_cast<int64_t>(t.values.size()));
    out.push_back(feedback.push(t.index, t.shape, t.values, codec.dtype, codec.block_size, codec.topk));
  }
  return out;
}

DeltaHeader delta_header(uint32_t fragment) {
  return {.run_id = "run-1", .fingerprint = layout().fingerprint, .learner_id = "eu-0", .region = "eu",
          .fragment = fragment, .seq = 12, .base_version = 40, .inner_steps = 50, .tokens = 50 * 8192,
          .learner_step = 6000, .train_loss = 2.75f, .send_time_us = 1'700'000'000'000'000};
}

void deltas() {
  const CodecOptions f32{.dtype = DType::F32, .byte_shuffle = true};
  const CodecOptions bf16{.dtype = DType::BF16, .byte_shuffle = false};
  const CodecOptions int8{.dtype = DType::INT8, .block_size = 16, .topk = 4, .byte_shuffle = true};
  const CodecOptions int4{.dtype = DType::INT4, .block_size = 32, .byte_shuffle = false};
  message("delta", "f32-fragment0", encode_delta(delta_header(0), tensors(0, 1e-3f), f32));
  message("delta", "bf16-fragment1", encode_delta(delta_header(1), tensors(1, 1e-3f), bf16));
  message("delta", "int8-topk-fragment0", encode_delta(delta_header(0), tensors(0, 1e-3f), int8));
  message("delta", "int4-fragment0", encode_delta(delta_header(0), tensors(0, 1e-3f), int4));
  // Top-k with error feedback, as a learner sends it: the sparse form (core/codec/sparse.h).
  for (const auto& [dtype, name] : {std::pair{DType::INT4, "int4-sparse-fragment0"}, std::pair{DType::INT8, "int8-sparse-fragment0"}}) {
    const CodecOptions sparse{.dtype = dtype, .block_size = 16, .topk = 3, .byte_shuffle = false};
    message("delta", name, encode_delta(delta_header(0), topk_feedback(tensors(0, 1e-3f), sparse), sparse));
  }
}

void fragment_params() {
  FragmentParams snapshot{.run_id = "run-1", .fingerprint = layout().fingerprint, .fragment = 0, .version = 41,
                          .merger_instance = "merger-0", .epoch = 3, .tensors = tensors(0, 0.5f)};
  message("fragment_params", "snapshot-fragment0", encode_fragment_params(snapshot));
  FragmentParams update = snapshot;
  update.fragment = 1;
  update.update = true;
  update.base_version = 40;
  update.checksum = 0x0123456789abcdefull;
  const CodecOptions int8{.dtype = DType::INT8, .block_size = 2, .byte_shuffle = false};
  std::vector<QuantizedTensor> change;
  for (const auto& t : tensors(1, 1e-2f)) change.push_back(quantize(t.index, t.shape, t.values, DType::INT8, 2));
  message("fragment_params", "int8-update-fragment1", encode_fragment_update(update, change, int8));
  const CodecOptions sparse{.dtype = DType::INT4, .block_size = 8, .topk = 2, .byte_shuffle = false};
  message("fragment_params", "int4-sparse-update-fragment1",
          encode_fragment_update(update, topk_feedback(tensors(1, 1e-2f), sparse), sparse));
  // streamed_params: the snapshot in segments of 64 bytes of values with the update between two
  // of them (first byte 0: snapshots), as a publisher's messages reach a subscriber.
  std::vector<std::vector<uint8_t>> segments;
  for_each_fragment_params_segment(snapshot, snapshot.tensors, 64, 1,
                                   [&](uint32_t, uint32_t, std::span<const uint8_t> b) { segments.emplace_back(b.begin(), b.end()); });
  segments.insert(segments.begin() + 1, encode_fragment_update(update, change, int8));
  write("streamed_params", "snapshot-segments", logged(0, segments));

}

DeltaRef delta_ref(int64_t offset, const std::string& learner) {
  return {.position = {"diloco.run-1.deltas.eu", 2, offset}, .learner_id = learner, .seq = 12, .base_version = 40,
          .staleness = 1, .inner_steps = 50, .tokens = 409600, .weight = 0.5};
}

void merge_records() {
  MergeRecord r{.run_id = "run-1", .fingerprint = layout().fingerprint, .fragment = 1, .version = 41,
                .prev_version = 40, .inputs = {delta_ref(100, "eu-0"), delta_ref(101, "us-0")},
                .dropped = {{delta_ref(99, "us-1"), DropReason::TooStale, "staleness 9 above 8"}},
                .optimizer = OuterOptimizerKind::Cgad, .checksum = 77, .merger_instance = "merger-0", .epoch = 3,
                .merge_time_us = 1'700'000'000'000'000, .share = 0.5f, .staleness_scale = 0.75f,
                .downlink = {DType::INT4, 64, 8}, .norm_block = 1024};
  message("merge_record", "cgad-int4-downlink", encode_merge_record(r), true);
  MergeRecord genesis{.run_id = "run-1", .fingerprint = layout().fingerprint, .fragment = 0,
                      .inputs = {delta_ref(0, "eu-0")}, .merger_instance = "merger-0", .genesis = true};
  message("merge_record", "genesis", encode_merge_record(genesis), true);
}

void fragment_states() {
  FragmentState s{.run_id = "run-1", .fingerprint = layout().fingerprint, .fragment = 0, .version = 41,
                  .params = tensors(0, 0.5f), .momentum = tensors(0, 1e-2f), .outer_state = tensors(0, 1e-4f),
                  .consumed = {{"diloco.run-1.deltas.eu", 0, 120}, {"diloco.run-1.deltas.us", 1, 7}},
                  .last_merge = LogPosition{"diloco.run-1.merges", 0, 80},
                  .accounted = {{"eu-0", 12}, {"us-0", 9}}, .merged_bases = {{"eu-0", 40}},
                  .recent = {{"diloco.run-1.deltas.eu", 0, 121}}, .downlink_residual = tensors(0, 1e-5f),
                  .layout = shared_layout(), .optimizer = OuterOptimizerKind::Cgad, .optimizer_since = 30};
  message("fragment_state", "cgad-residual-fragment0", encode_fragment_state(s), true);
  FragmentState plain{.run_id = "run-1", .fingerprint = layout().fingerprint, .fragment = 1, .version = 3,
                      .params = tensors(1, 0.5f), .layout = shared_layout()};
  message("fragment_state", "sgd-fragment1", encode_fragment_state(plain), true);
  // state_segments: the first checkpoint streamed in segments of 96 bytes of values, as a log
  // read with the run's layout (first byte 0) and with the one segment 0 carries (1).
  std::vector<std::vector<uint8_t>> segments;
  for_each_fragment_state_segment(s, 96, 1, [&](uint32_t, uint32_t, std::span<const uint8_t> segment) {
    segments.emplace_back(segment.begin(), segment.end());
  });
  for (const uint8_t mode : {uint8_t{0}, uint8_t{1}})
    write("state_segments", mode ? "streamed-own-layout" : "streamed-run-layout", logged(mode, segments));
}

void genesis_proposals() {
  for (uint32_t p = 0; p < 2; ++p) {
    GenesisProposal g{.run_id = "run-1", .fingerprint = layout().fingerprint, .learner_id = "eu-0", .region = "eu",
                      .fragment = p, .seq = 1, .send_time_us = 1'700'000'000'000'000, .layout = shared_layout(),
                      .tensors = tensors(p, 0.02f)};
    message("genesis_proposal", "fragment" + std::to_string(p), encode_genesis_proposal(g), true);
  }
  // streamed_params: two learners' proposals of fragment 0 in segments of 64 bytes of values,
  // interleaved, read with the run's layout (first byte 1) and with the one segment 0 carries (3).
  std::vector<std::vector<uint8_t>> a, b, log;
  for (auto* into : {&a, &b}) {
    GenesisProposal g{.run_id = "run-1", .fingerprint = layout().fingerprint, .learner_id = into == &a ? "eu-0" : "us-0",
                      .region = "eu", .fragment = 0, .seq = 1, .send_time_us = 1'700'000'000'000'000,
                      .layout = shared_layout(), .tensors = tensors(0, 0.02f)};
    for_each_genesis_proposal_segment(g, 64, 1, [&](uint32_t, uint32_t, std::span<const uint8_t> segment) {
      into->emplace_back(segment.begin(), segment.end());
    });
  }
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    if (i < a.size()) log.push_back(a[i]);
    if (i < b.size()) log.push_back(b[i]);
  }
  write("streamed_params", "proposals-run-layout", logged(1, log));
  write("streamed_params", "proposals-own-layout", logged(3, log));
  // A layout at the edge of what a message may carry: one tensor of kMaxFragments rows over
  // kMaxFragments fragments, a one-row block in each (rebuilding it once took fragments x pieces
  // steps: a libFuzzer timeout).
  auto widest = std::make_shared<const FragmentLayout>(
      partition_tensors(std::vector<TensorSpec>{{"w", {int64_t{kMaxFragments}, 3}}}, kMaxFragments));
  GenesisProposal g{.run_id = "run-1", .fingerprint = widest->fingerprint, .learner_id = "eu-0", .region = "eu",
                    .fragment = 7, .seq = 1, .send_time_us = 1'700'000'000'000'000, .layout = widest,
                    .tensors = {DenseTensor{0, {1, 3}, {0.5f, -0.25f, 0.0f}}}};
  message("genesis_proposal", "max-fragments", encode_genesis_proposal(g), true);
}

void members() {
  Member learner{.run_id = "run-1", .instance_id = "eu-0", .role = Role::Learner, .region = "eu",
                 .endpoint = "tcp://10.0.0.1:5555", .epoch = 2, .time_us = 1'700'000'000'000'000, .step = 600,
                 .step_time_s = 0.25f, .tokens_per_s = 32768, .loss = 2.5f, .tokens = 1 << 20,
                 .bytes_sent = 123456, .bytes_received = 654321, .incarnation = 99};
  message("member", "learner", encode_member(learner));
  Member merger{.run_id = "run-1", .instance_id = "merger-0", .role = Role::Merger, .region = "eu",
                .endpoint = "tcp://10.0.0.2:5556", .epoch = 3, .owned_fragments = {0, 1},
                .fragment_versions = {41, 40}, .fragment_checksums = {77, 78}, .announce_interval_s = 1.5f,
                .leaving = true};
  message("member", "merger-leaving", encode_member(merger));
}

void rejected() {
  RejectedInput r{.run_id = "run-1", .source = {"diloco.run-1.deltas.eu", 1, 42}, .reason = "wrong_fingerprint",
                  .detail = "fingerprint 0x1, expected 0x2", .rejected_by = "merger-0",
                  .time_us = 1'700'000'000'000'000, .payload_size = 300, .payload_head = {0x28, 0xb5, 0x2f, 0xfd, 1, 2}};
  message("rejected", "wrong-fingerprint", encode_rejected(r));
}

void round_opens() {
  RoundOpen r{.run_id = "run-1", .fingerprint = layout().fingerprint, .fragment = 1, .version = 41, .pending = 2,
              .grace_ms = 150, .merger_instance = "merger-0", .epoch = 3, .time_us = 1'700'000'000'000'000};
  message("round_open", "fragment1", encode_round_open(r), true);
}

void chunks() {
  const auto delta = encode_delta(delta_header(0), tensors(0, 1e-3f), CodecOptions{.dtype = DType::INT8, .block_size = 16});
  const ChunkId id{.run_id = "run-1", .stream = "eu-0", .fragment = 0, .message = 12};
  const auto pieces = split_message(delta, id, 96);
  write("chunk", "first-of-" + std::to_string(pieces.size()), pieces.front());
  write("chunk", "last-of-" + std::to_string(pieces.size()), pieces.back());
  // chunk_assembly, a log: the pieces of one message with a record that is no piece between them.
  std::vector<uint8_t> log{0};
  auto add = [&](uint8_t partition, const std::vector<uint8_t>& value) {
    log.push_back(partition);
    log.push_back(static_cast<uint8_t>(value.size()));
    log.push_back(static_cast<uint8_t>(value.size() >> 8));
    log.insert(log.end(), value.begin(), value.end());
  };
  for (size_t k = 0; k < pieces.size(); ++k) {
    add(1, pieces[k]);
    if (k == 0) add(1, std::vector<uint8_t>(delta.begin(), delta.begin() + 24));
  }
  write("chunk_assembly", "log-whole-message", log);
  // chunk_assembly, a split: pieces of 64 bytes, every one once; then one with piece 1 left out.
  for (const uint16_t dropped : {uint16_t{0xffff}, uint16_t{1}}) {
    std::vector<uint8_t> split{1, 63, 0, static_cast<uint8_t>(dropped), static_cast<uint8_t>(dropped >> 8), 0xff, 0xff, 0xff, 0xff};
    split.insert(split.end(), delta.begin(), delta.end());
    write("chunk_assembly", dropped == 0xffff ? "split-whole" : "split-piece-1-missing", split);
  }
}

void learner_states() {
  SavedLearner s{.run_id = "run-1", .fingerprint = layout().fingerprint, .learner_id = "eu-0", .step = 600,
                 .tokens = 1 << 22};
  for (uint32_t p = 0; p < 2; ++p) {
    SavedFragment f{.fragment = p, .version = 40 + p, .checksum = 77, .anchor = tensors(p, 0.5f), .sent_on_base = p == 1,
                    .steps = 20, .tokens = 20 * 8192, .steps_at_cut = p == 1 ? 10u : 0u,
                    .tokens_at_cut = p == 1 ? 10 * 8192u : 0u, .seq = 12};
    for (const auto& t : tensors(p, 1e-3f)) {
      f.carried.push_back(t.values);
      if (f.sent_on_base) {
        f.last_cut.push_back(t.values);
        f.cut_point.push_back(t.values);
      }
    }
    s.fragments.push_back(std::move(f));
  }
  message("learner_state", "two-fragments", encode_learner_state(s));
}

void run_configs(const std::filesystem::path& source_dir) {
  for (const char* name : {"tiny.toml", "demo.toml", "bench.toml"}) {
    std::ifstream in(source_dir / "configs" / name, std::ios::binary);
    const std::string text{std::istreambuf_iterator<char>(in), {}};
    if (text.empty()) throw IoError("cannot read configs/" + std::string(name));
    write("run_config", name, {reinterpret_cast<const uint8_t*>(text.data()), text.size()});
  }
}

void safetensors() {
  const auto path = std::filesystem::temp_directory_path() / ("diloco-fuzz-corpus-" + std::to_string(::getpid()));
  std::vector<NamedTensor> named;
  for (const auto& t : tensors(0, 0.5f)) named.push_back({layout().fragments[0][t.index].name, t.shape, t.values});
  named.push_back({"empty", {0, 3}, {}});
  save_safetensors(path, named, {{"info", R"({"version": 41, "run": "run-1"})"}});
  std::ifstream in(path, std::ios::binary);
  const std::vector<uint8_t> bytes{std::istreambuf_iterator<char>(in), {}};
  std::filesystem::remove(path);
  write("safetensors", "fragment0-with-metadata", bytes);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s OUT_DIR SOURCE_DIR (writes OUT_DIR/<target>/*)\n", argv[0]);
    return 2;
  }
  out_dir = argv[1];
  try {
    deltas();
    fragment_params();
    merge_records();
    fragment_states();
    genesis_proposals();
    members();
    rejected();
    round_opens();
    chunks();
    learner_states();
    run_configs(argv[2]);
    safetensors();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_corpus: %s\n", e.what());
    return 1;
  }
  return 0;
}
