// list, show and dump: what each learner sent and what became of it.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <ctime>
#include <iomanip>
#include <iostream>
#include <set>
#include <sstream>

#include "core/errors.h"
#include "core/kafka/chunk_assembler.h"
#include "core/kafka/log_reader.h"
#include "tools/replay/replay.h"
#include "tools/replay/run_logs.h"
#include "core/files/safetensors.h"

namespace diloco {

namespace {

// ---- ranges ---------------------------------------------------------------------------------

std::string resolve_topic(const ReplayRun& run, const std::string& name) {
  for (const auto& t : run.delta_topics)
    if (t == name || t == run.topics.deltas(name)) return t;
  std::string known;
  for (const auto& t : run.delta_topics) known += " " + t;
  throw InvalidInput("topic " + name + " is not a delta topic or region of run " + run.config.run.id +
                     " (its delta topics:" + known + ")");
}

std::vector<OffsetRange> list_ranges(const ReplayRun& run, const ListOptions& o) {
  std::vector<std::string> topics;
  for (const auto& t : o.topics) topics.push_back(resolve_topic(run, t));
  if (topics.empty()) topics = run.delta_topics;
  std::vector<int32_t> partitions;
  if (o.partition) {
    if (*o.partition < 0 || *o.partition >= run.partitions)
      throw InvalidInput("--partition " + std::to_string(*o.partition) + ": the run's topics have partitions 0.." +
                         std::to_string(run.partitions - 1));
    partitions.push_back(*o.partition);
  } else if (o.fragment) {
    partitions.push_back(run.partition_of(*o.fragment));
  } else {
    for (int32_t p = 0; p < run.partitions; ++p) partitions.push_back(p);
  }
  LogReader& reader = *run.reader;
  // The first offset at or after `ms`, or `high` when there is none.
  auto at_time = [&](const std::string& topic, int32_t partition, int64_t ms, int64_t high) {
    return reader.offset_at_time(topic, partition, ms, run.timeout_ms).value_or(high);
  };
  std::vector<OffsetRange> out;
  for (const auto& topic : topics)
    for (int32_t partition : partitions) {
      auto [low, high] = reader.watermarks(topic, partition, run.timeout_ms);
      OffsetRange r{topic, partition, low, high};
      if (o.from_offset) r.begin = std::max(r.begin, *o.from_offset);
      if (o.to_offset) r.end = std::min(r.end, *o.to_offset + 1);
      if (o.since_ms) r.begin = std::max(r.begin, at_time(topic, partition, *o.since_ms, high));
      if (o.until_ms) r.end = std::min(r.end, at_time(topic, partition, *o.until_ms + 1, high));
      out.push_back(r);
    }
  return out;
}

// ---- one delta as a row ---------------------------------------------------------------------

std::string header_value(const ConsumedMessage& m, const std::string& key) {
  for (const auto& [k, v] : m.headers)
    if (k == key) return v;
  return "";
}

// The row of a delta: decoded fields, or (rejected) what its plain-text headers claim.
nlohmann::json delta_row(const ReplayRun& run, const ConsumedMessage& m, const std::map<Position, DeltaFate>& fates) {
  nlohmann::json row{{"topic", m.topic}, {"partition", m.partition}, {"offset", m.offset},
                     {"timestamp_ms", m.timestamp_ms}, {"wire_bytes", m.value.size()}};
  try {
    Delta d = decode_delta(m.value, run.limits());
    const DeltaHeader& h = d.header;
    row.update({{"learner", h.learner_id}, {"region", h.region}, {"fragment", h.fragment},
                {"base_version", h.base_version}, {"seq", h.seq}, {"inner_steps", h.inner_steps},
                {"tokens", h.tokens}, {"l2_norm", l2_norm(d.tensors)}, {"dtype", dtype_name(d.dtype)}});
    auto fate = fates.find({m.topic, m.partition, m.offset});
    row.update(fate_json(fate == fates.end() ? DeltaFate{} : fate->second));
  } catch (const Rejection& e) {
    for (const char* key : {"learner", "region"})
      if (auto v = header_value(m, key); !v.empty()) row[key] = v;
    for (const char* key : {"fragment", "seq", "base_version"}) {
      auto v = header_value(m, key);
      uint64_t n = 0;
      if (!v.empty() && std::from_chars(v.data(), v.data() + v.size(), n).ec == std::errc{}) row[key] = n;
    }
    row.update(rejection_json(e));
  }
  return row;
}

bool selected(const nlohmann::json& row, const ListOptions& o) {
  if (o.fragment && row.value("fragment", uint64_t{UINT64_MAX}) != *o.fragment) return false;
  if (!o.learner.empty() && row.value("learner", std::string{}) != o.learner) return false;
  return true;
}

std::string fate_text(const nlohmann::json& row) {
  const std::string fate = row["fate"];
  std::ostringstream out;
  out << fate;
  if (fate == "merged")
    out << " v" << row["version"].get<uint64_t>() << " w=" << std::setprecision(3) << row["share"].get<double>()
        << " s=" << row["staleness"].get<uint64_t>();
  else if (fate == "dropped" || fate == "pending" || fate == "rejected")
    out << " " << row["reason"].get<std::string>() << ": " << row["detail"].get<std::string>();
  return out.str();
}

void print_row(const nlohmann::json& row, std::ostream& out) {
  auto text = [&](const char* key) -> std::string {
    if (!row.contains(key)) return "-";
    if (row[key].is_string()) return row[key].get<std::string>();
    if (row[key].is_number_float()) {
      std::ostringstream s;
      s << std::setprecision(4) << row[key].get<double>();
      return s.str();
    }
    return row[key].dump();
  };
  out << std::left << std::setw(36) << text("topic") << std::right << std::setw(3) << text("partition")
      << std::setw(8) << text("offset") << "  " << std::left << std::setw(10) << text("learner") << std::setw(8)
      << text("region") << std::right << std::setw(5) << text("fragment") << std::setw(6) << text("base_version")
      << std::setw(15) << text("seq") << std::setw(6) << text("inner_steps") << std::setw(9) << text("tokens")
      << std::setw(10) << text("l2_norm") << std::setw(9) << text("wire_bytes") << "  " << std::left << std::setw(5)
      << text("dtype") << " " << fate_text(row) << "\n";
}

void print_table_header(std::ostream& out) {
  out << std::left << std::setw(36) << "TOPIC" << std::right << std::setw(3) << "P" << std::setw(8) << "OFFSET" << "  "
      << std::left << std::setw(10) << "LEARNER" << std::setw(8) << "REGION" << std::right << std::setw(5) << "FRAG"
      << std::setw(6) << "BASE" << std::setw(15) << "SEQ" << std::setw(6) << "STEPS" << std::setw(9) << "TOKENS"
      << std::setw(10) << "L2" << std::setw(9) << "BYTES" << "  " << std::left << std::setw(5) << "DTYPE"
      << " FATE\n";
}

nlohmann::json merge_record_json(const MergeRecord& r) {
  auto ref_json = [](const DeltaRef& d) {
    nlohmann::json j = position_json(d.position);
    j.update({{"learner", d.learner_id}, {"seq", d.seq}, {"base_version", d.base_version},
              {"staleness", d.staleness}, {"inner_steps", d.inner_steps}, {"tokens", d.tokens}, {"weight", d.weight}});
    return j;
  };
  nlohmann::json inputs = nlohmann::json::array(), dropped = nlohmann::json::array();
  for (const auto& in : r.inputs) inputs.push_back(ref_json(in));
  for (const auto& d : r.dropped) {
    auto j = ref_json(d.delta);
    j.update({{"reason", drop_reason_name(d.reason)}, {"detail", d.detail}});
    dropped.push_back(j);
  }
  return {{"run_id", r.run_id}, {"fingerprint", r.fingerprint}, {"fragment", r.fragment},
          {"version", r.version}, {"prev_version", r.prev_version}, {"merge", is_merge(r)},
          {"rule", merge_rule_name(r.rule)}, {"optimizer", outer_optimizer_name(r.optimizer)},
          {"hyper", {{"lr", r.hyper.lr}, {"momentum", r.hyper.momentum}, {"staleness_alpha", r.hyper.staleness_alpha},
                     {"max_staleness", r.hyper.max_staleness}, {"quorum", r.hyper.quorum},
                     {"dn_period", r.hyper.dn_period}, {"dn_activation", r.hyper.dn_activation},
                     {"cgad_decay", r.hyper.cgad_decay}, {"cgad_cutoff", r.hyper.cgad_cutoff},
                     {"adam_beta2", r.hyper.adam_beta2}, {"adam_epsilon", r.hyper.adam_epsilon}}},
          {"share", r.share}, {"staleness_scale", r.staleness_scale},
          {"checksum", r.checksum}, {"merger_instance", r.merger_instance}, {"epoch", r.epoch},
          {"merge_time_us", r.merge_time_us}, {"inputs", inputs}, {"dropped", dropped}};
}

nlohmann::json state_json(const FragmentState& s, const FragmentLayout& layout, int first_values) {
  nlohmann::json consumed = nlohmann::json::array();
  for (const auto& c : s.consumed) consumed.push_back(position_json(c));
  nlohmann::json recent = nlohmann::json::array();
  for (const auto& r : s.recent) recent.push_back(position_json(r));
  return {{"run_id", s.run_id}, {"fingerprint", s.fingerprint}, {"fragment", s.fragment},
          {"version", s.version}, {"checksum", s.checksum}, {"momentum_checksum", checksum_fp32(s.momentum)},
          {"outer_state_checksum", checksum_fp32(s.outer_state)},
          {"downlink_residual_checksum", checksum_fp32(s.downlink_residual)},
          {"last_merge", s.last_merge ? position_json(*s.last_merge) : nlohmann::json()},
          {"consumed", consumed}, {"accounted", s.accounted},
          {"merged_bases", s.merged_bases}, {"recent", recent},
          {"params", tensor_summaries(s.params, layout.fragments.at(s.fragment), first_values)},
          {"momentum_l2_norm", l2_norm(s.momentum)}};
}

nlohmann::json delta_json(const ReplayRun& run, const ConsumedMessage& m, int first_values) {
  nlohmann::json out{{"topic", m.topic}, {"partition", m.partition}, {"offset", m.offset},
                     {"timestamp_ms", m.timestamp_ms}, {"key", m.key}, {"wire_bytes", m.value.size()}};
  nlohmann::json headers = nlohmann::json::object();
  for (const auto& [k, v] : m.headers) headers[k] = v;
  out["headers"] = headers;
  Delta d;
  try {
    d = decode_delta(m.value, run.limits());
  } catch (const Rejection& e) {
    std::ostringstream head;
    for (size_t i = 0; i < std::min<size_t>(m.value.size(), 32); ++i)
      head << std::hex << std::setw(2) << std::setfill('0') << static_cast<int>(m.value[i]);
    out.update(rejection_json(e));
    out["head_hex"] = head.str();
    return out;
  }
  const DeltaHeader& h = d.header;
  out.update({{"run_id", h.run_id}, {"fingerprint", h.fingerprint}, {"learner", h.learner_id}, {"region", h.region},
              {"fragment", h.fragment}, {"seq", h.seq}, {"base_version", h.base_version},
              {"inner_steps", h.inner_steps}, {"tokens", h.tokens}, {"learner_step", h.learner_step},
              {"train_loss", h.train_loss}, {"send_time_us", h.send_time_us},
              {"codec", {{"dtype", dtype_name(d.dtype)}, {"block_size", d.block_size}, {"topk", d.topk},
                         {"sparse", d.sparse}, {"byte_shuffle", d.byte_shuffle}}},
              {"l2_norm", l2_norm(d.tensors)}});
  auto fates = delta_fates(run, {m.partition}, [](const LogPosition&, const std::string&) {});
  auto fate = fates.find({m.topic, m.partition, m.offset});
  out.update(fate_json(fate == fates.end() ? DeltaFate{} : fate->second));
  out["tensors"] = tensor_summaries(d.tensors, run.layout->fragments.at(h.fragment), first_values);
  return out;
}

}  // namespace

const char* merge_rule_name(MergeRule rule) { return rule == MergeRule::WeightedAverage ? "avg" : "rda"; }

int64_t parse_time_ms(const std::string& text) {
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch()).count();
  if (text == "now") return now_ms;
  const char* begin = text.data();
  const char* end = begin + text.size();
  int64_t n = 0;
  if (!text.empty() && text[0] == '-') {
    auto [rest, ec] = std::from_chars(begin + 1, end, n);
    static const std::map<std::string, int64_t> kUnits{{"s", 1000}, {"m", 60000}, {"h", 3600000}, {"d", 86400000}};
    auto unit = kUnits.find(std::string(rest, end));
    if (ec == std::errc{} && unit != kUnits.end()) return now_ms - n * unit->second;
  } else if (auto [rest, ec] = std::from_chars(begin, end, n); ec == std::errc{} && rest == end) {
    return n * 1000;
  } else {
    std::tm tm{};
    std::istringstream in(text);
    in >> std::get_time(&tm, "%Y-%m-%dT%H:%M:%S");
    if (!in.fail() && (in.peek() == EOF || (in.get() == 'Z' && in.peek() == EOF)))
      return static_cast<int64_t>(timegm(&tm)) * 1000;
  }
  throw InvalidInput("time " + text + " is not 2026-11-30T09:30:00Z (UTC), unix seconds, now, or -90s / -15m / -2h / -1d");
}

void list_deltas(const ReplayRun& run, const ListOptions& o, std::ostream& out) {
  auto ranges = list_ranges(run, o);
  std::set<int32_t> partitions;
  for (const auto& r : ranges) partitions.insert(r.partition);
  auto fates = delta_fates(run, {partitions.begin(), partitions.end()}, [](const LogPosition& p, const std::string& why) {
    std::cerr << "diloco-replay: skipping the merge record at " << describe(p) << ": " << why << "\n";
  });
  if (!o.json) print_table_header(out);
  auto emit = [&](const nlohmann::json& row) {
    if (!selected(row, o)) return;
    if (o.json)
      out << row.dump() << "\n";
    else
      print_row(row, out);
  };
  // Chunked deltas are listed whole, at their first piece; pieces that make no whole message
  // (lost, repeated or foreign pieces, or the tail of a message begun before the listed range)
  // are listed as rejected rows with the reason.
  auto problem_rows = [&](const std::vector<ChunkProblem>& problems) {
    for (const auto& p : problems) {
      nlohmann::json row{{"topic", p.position.topic}, {"partition", p.position.partition},
                         {"offset", p.position.offset}, {"wire_bytes", p.payload_size}};
      row.update(rejection_json(Rejection(p.reason, p.detail)));
      emit(row);
    }
  };
  ChunkAssembler chunks(run.limits());
  run.reader->read_ranges(
      ranges,
      [&](const ConsumedMessage& piece) {
        auto result = chunks.add(piece);
        problem_rows(result.problems);
        if (!result.message) return;
        const ConsumedMessage& m = *result.message;
        if ((o.since_ms && m.timestamp_ms < *o.since_ms) || (o.until_ms && m.timestamp_ms > *o.until_ms)) return;
        emit(delta_row(run, m, fates));
      },
      run.timeout_ms);
  problem_rows(chunks.finish());
}

void show(const ReplayRun& run, const ShowOptions& o, std::ostream& out) {
  LogPosition position = o.position;
  if (o.what == ShowWhat::Delta) position.topic = resolve_topic(run, position.topic);
  if (o.what == ShowWhat::Merge) position.topic = run.topics.merges();
  if (o.what == ShowWhat::State) position.topic = run.topics.state();
  ConsumedMessage m = fetch_one(run, position);
  nlohmann::json doc;
  try {
    if (o.what == ShowWhat::Delta) {
      doc = delta_json(run, m, o.first_values);
    } else if (o.what == ShowWhat::Merge) {
      doc = merge_record_json(decode_merge_record(m.value, run.limits()));
    } else {
      doc = state_json(decode_fragment_state(m.value, run.limits()), *run.layout, o.first_values);
    }
  } catch (const Rejection& e) {
    throw InvalidInput("the message at " + describe(position) + " is rejected: " + e.what());
  }
  doc["position"] = position_json(position);
  out << doc.dump(2) << "\n";
}

void dump_delta(const ReplayRun& run, LogPosition position, const std::filesystem::path& path, std::ostream& log) {
  position.topic = resolve_topic(run, position.topic);
  ConsumedMessage m = fetch_one(run, position);
  Delta d;
  try {
    d = decode_delta(m.value, run.limits());
  } catch (const Rejection& e) {
    throw InvalidInput("the delta at " + describe(position) + " is rejected, nothing to dump: " + e.what());
  }
  const DeltaHeader& h = d.header;
  nlohmann::json info{{"kind", "delta"}, {"run_id", h.run_id}, {"position", position_json(position)},
                      {"learner", h.learner_id}, {"region", h.region}, {"fragment", h.fragment}, {"seq", h.seq},
                      {"base_version", h.base_version}, {"inner_steps", h.inner_steps}, {"tokens", h.tokens},
                      {"dtype", dtype_name(d.dtype)}};
  std::vector<NamedTensor> tensors;
  const auto& specs = run.layout->fragments.at(h.fragment);
  for (const auto& t : d.tensors) tensors.push_back(NamedTensor{specs.at(t.index).name, t.shape, t.values});
  save_safetensors(path, tensors, {{"info", info.dump()}});
  log << "wrote " << d.tensors.size() << " tensors of the delta at " << describe(position) << " (learner "
      << h.learner_id << ", fragment " << h.fragment << ", seq " << h.seq << ") to " << path.string() << "\n";
}

}  // namespace diloco
