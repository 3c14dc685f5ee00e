// diloco-replay: inspects, rebuilds, verifies and re-merges a run from its Kafka logs. See
// tools/replay/replay.h and ARCHITECTURE.md sections 7 and 8.
#include <CLI/CLI.hpp>

#include <iostream>

#include "core/errors.h"
#include "core/process.h"
#include "tools/replay/replay.h"

using namespace diloco;

namespace {

// Exit codes: 0 done (verify: every checksum matches), 1 verify or audit found a problem, 2 the command
// could not run (usage, config, missing run/topic/version, no broker), 3 a bug.
constexpr int kMismatch = 1;
constexpr int kCannotRun = 2;
constexpr int kInternal = 3;

int print_verify(const VerifyReport& report) {
  std::cout << "verified " << report.fragments << " fragments: " << report.versions << " merge records and "
            << report.checkpoints << " checkpoints\n";
  for (const auto& m : report.mismatches) std::cout << "MISMATCH " << m << "\n";
  std::cout << (report.ok() ? "PASS" : "FAIL") << "\n";
  return report.ok() ? 0 : kMismatch;
}

}  // namespace

int main(int argc, char** argv) {
  return_large_buffers();
  CLI::App app{
      "diloco-replay: reads a run's logs (the delta topics, merges and state) read_committed, on a live run\n"
      "or a finished one. `list` and `show` tell which learner sent what and what became of it (merged into\n"
      "version v with weight w and staleness s, dropped and why, pending, or rejected by strict decoding);\n"
      "`dump` and `rebuild` write tensors as safetensors files; `verify` rebuilds every version and checks every\n"
      "checksum; `audit` checks that every delta was merged once or dropped with a reason; `remerge`\n"
      "re-runs the merge policy with other settings.\n"
      "Common options go before or after the command: diloco-replay -c configs/tiny.toml verify\n"
      "Exit codes: 0 done, 1 verify or audit found a problem, 2 the command could not run (usage, config, missing\n"
      "run, topic or version, no broker), 3 internal error.\n"};
  app.require_subcommand(1);
  app.fallthrough();

  ReplayOptions o;
  std::string bootstrap = default_bootstrap_servers();
  double timeout_s = 120, connect_timeout_s = 10;
  unsigned threads = 0;
  app.add_option("-c,--config", o.config_file, "the run config (TOML) the learners and mergers ran with, e.g. configs/tiny.toml")->required()->check(CLI::ExistingFile);
  app.add_option("-s,--set", o.overrides, "override a config value: section.key=value (repeatable), as for diloco-merger");
  app.add_option("--run", o.run_id, "run id (default: run.id of the config)");
  app.add_option("--bootstrap", bootstrap, "Kafka bootstrap servers (default: $DILOCO_BOOTSTRAP or 127.0.0.1:19092)")->capture_default_str();
  app.add_option("--regions", o.regions, "regions to read, comma-separated (default: every diloco.<run>.deltas.<region> topic)")->delimiter(',');
  app.add_option("--timeout", timeout_s, "seconds one read of a log may stall before giving up")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "threads that share each rebuilt merge's arithmetic (0: one per core); any number gives the same bits")->capture_default_str()->check(CLI::Range(0u, 256u));
  app.add_option("--connect-timeout", connect_timeout_s, "seconds to wait for the broker")->capture_default_str()->check(CLI::PositiveNumber);

  ListOptions list_o;
  std::string since, until;
  auto* list = app.add_subcommand("list", "deltas in a range, with what became of each");
  list->footer(
      "One line per delta: topic, partition, offset, learner, region, fragment, base version, seq, inner\n"
      "steps, tokens, L2 norm, wire bytes, codec dtype and fate: merged into version v (w: its share of\n"
      "the merge, s: staleness), dropped with its reason, pending (held at a merger's clean stop),\n"
      "rejected by a merger with its reason (the run's rejected topic, e.g. wrong_partition), rejected\n"
      "with the strict decoder's reason (learner and fragment then from its plain-text headers), or\n"
      "unaccounted: no record names it, which after a clean stop means a lost delta. --json also has\n"
      "the raw recorded weight.\n"
      "Example: diloco-replay -c configs/tiny.toml list --topic eu --since -10m --json\n");
  list->add_option("--topic", list_o.topics, "delta topic or region name (repeatable; default: every region)");
  list->add_option("--partition", list_o.partition, "only this partition");
  list->add_option("--from-offset", list_o.from_offset, "first offset (inclusive)");
  list->add_option("--to-offset", list_o.to_offset, "last offset (inclusive)");
  list->add_option("--since", since, "Kafka timestamp at or after: 2026-11-30T09:30:00Z (UTC), unix seconds, now, or -15m / -2h / -1d");
  list->add_option("--until", until, "Kafka timestamp at or before, same forms as --since");
  list->add_option("--fragment", list_o.fragment, "only deltas of this fragment");
  list->add_option("--learner", list_o.learner, "only deltas of this learner id");
  list->add_flag("--json", list_o.json, "JSON lines instead of a table (fate fields: fate, version, weight, share, staleness, reason, detail, record)");

  ShowOptions show_o;
  bool show_merge = false, show_state = false;
  auto* show_cmd = app.add_subcommand("show", "one delta, merge record or checkpoint in full as JSON");
  show_cmd->footer(
      "A delta (--topic T --partition P --offset O), a merge record (--merge --partition P --offset O)\n"
      "or a checkpoint (--state --partition P --offset O); tensors summarised: name, shape, L2 norm, min,\n"
      "max and the first values.\n");
  show_cmd->add_option("--topic", show_o.position.topic, "delta topic or region name");
  show_cmd->add_option("--partition", show_o.position.partition, "partition")->required();
  show_cmd->add_option("--offset", show_o.position.offset, "offset")->required();
  auto* merge_flag = show_cmd->add_flag("--merge", show_merge, "the merge record at this position of diloco.<run>.merges");
  show_cmd->add_flag("--state", show_state, "the checkpoint at this position of diloco.<run>.state")->excludes(merge_flag);
  show_cmd->add_option("--values", show_o.first_values, "first values shown per tensor")->capture_default_str();

  LogPosition dump_at;
  std::string dump_out;
  auto* dump = app.add_subcommand("dump", "a delta's decoded tensors to a safetensors file");
  dump->footer(
      "Writes the delta's dequantized fp32 tensors as a safetensors file keyed by the model's tensor names,\n"
      "with \"info\" in its metadata (JSON text: learner, fragment, seq, ...). Read it in Python with\n"
      "  decoupled_diloco.safetensors.load_file(FILE)   (or safetensors.numpy / safetensors.torch)\n");
  dump->add_option("--topic", dump_at.topic, "delta topic or region name")->required();
  dump->add_option("--partition", dump_at.partition, "partition")->required();
  dump->add_option("--offset", dump_at.offset, "offset")->required();
  dump->add_option("--out", dump_out, "file to write")->required();

  RebuildOptions rebuild_o;
  std::string rebuild_out;
  auto* rebuild_cmd = app.add_subcommand("rebuild", "the parameters at a version, to a safetensors file");
  rebuild_cmd->footer(
      "Rebuilt from the newest checkpoint at or below VERSION plus the merge records after it, with the\n"
      "merger's recovery code (every record's checksum is checked). Without --fragment, every fragment at\n"
      "min(VERSION, its latest): the whole model, keyed by the tensor names the learners registered, with\n"
      "\"info\" (JSON text: versions and checksums per fragment) in its metadata, and, for a run of the\n"
      "built-in model, \"model\" (its architecture: diloco-sample reads the file). With --fragment, that\n"
      "fragment's tensors. Read it with decoupled_diloco.safetensors.load_file(FILE), safetensors.torch, or\n"
      "decoupled_diloco.load_version() straight into a model's tensors.\n");
  rebuild_cmd->add_option("--version", rebuild_o.version, "the version")->required();
  rebuild_cmd->add_option("--fragment", rebuild_o.fragment, "only this fragment (the version must exist for it)");
  rebuild_cmd->add_option("--out", rebuild_out, "file to write")->required();

  auto* verify_cmd = app.add_subcommand("verify", "rebuilds every version and checks every checksum");
  verify_cmd->footer(
      "For every fragment, rebuilds every version from version 0 (the learner's proposal its genesis record\n"
      "names, or the earliest checkpoint when the proposal is gone), checking that version 0 is that\n"
      "proposal, every merge record's checksum and every later checkpoint against the rebuilt state; prints the\n"
      "first mismatch of each fragment with its topic[partition]@offset, progress on stderr. Exit 0 on\n"
      "pass, 1 on a mismatch, 2 when it cannot run.\n");

  bool audit_json = false;
  auto* audit_cmd = app.add_subcommand("audit", "checks that no delta was lost or merged twice and versions move forward");
  audit_cmd->footer(
      "Reads every delta, merge record and rejection of the run and checks the invariants of a run's logs:\n"
      "every delta merged into exactly one version, dropped for good with a reason, rejected by a merger,\n"
      "or recorded as pending at a clean stop (after a clean stop, anything else is a lost delta); no\n"
      "learner with two merged deltas on the same base of a fragment (progress counted twice); per\n"
      "fragment, every version one above the last; no merges partition left with an open transaction.\n"
      "Run `verify` too for the checksums. Exit 0 on pass, 1 on a problem, 2 when it cannot run.\n"
      "--json: {ok, deltas, merge_records, merged, dropped: {reason: n}, pending_at_stop, rejected,\n"
      "problems: [...], versions: {fragment: [{version, checksum, time_ms}]}}.\n");
  audit_cmd->add_flag("--json", audit_json, "one JSON document instead of text");

  RemergeOptions remerge_o;
  std::string rule, optimizer;
  float alpha = 0, lr = 0, momentum = 0;
  uint32_t quorum = 0;
  bool remerge_json = false;
  auto* remerge_cmd = app.add_subcommand("remerge", "re-runs the merge policy offline with other settings");
  remerge_cmd->footer(
      "Re-merges the recorded deltas in their recorded order from the earliest checkpoint. Settings not\n"
      "given are each merge record's own, so no options reproduce the run bit for bit. With the recorded\n"
      "quorum every merge takes the inputs its record names (weights recomputed with --alpha); with another\n"
      "--quorum K the deltas each record accounted for go, in send-time order, through the merger's\n"
      "pending set and merge once K learners are pending (base versions mapped onto the re-merged\n"
      "versions). Reports final versions and checksums per fragment; --out writes the re-merged model\n"
      "(safetensors, as rebuild writes it) for the run's own evaluation (diloco-eval FILE -c CONFIG for the\n"
      "built-in model). The deltas are the recorded ones:\n"
      "under another policy the learners would have sent others, so this shows what the policy does with\n"
      "the same inputs, not a new training run.\n");
  remerge_cmd->add_option("--rule", rule, "rda (radial-directional) or avg (weighted average)")->check(CLI::IsMember({"rda", "avg"}));
  remerge_cmd->add_option("--alpha", alpha, "staleness exponent: weight factor (1 + staleness)^-alpha");
  remerge_cmd->add_option("--quorum", quorum, "K: distinct learners per merge")->check(CLI::PositiveNumber);
  remerge_cmd->add_option("--outer-lr", lr, "outer learning rate");
  remerge_cmd->add_option("--momentum", momentum, "outer momentum");
  remerge_cmd->add_option("--optimizer", optimizer, outer_optimizer_names())
      ->check([](const std::string& name) {
        return parse_outer_optimizer(name) ? std::string() : "must be one of " + outer_optimizer_names();
      });
  remerge_cmd->add_option("--out", remerge_o.out, "write the re-merged model to this safetensors file");
  remerge_cmd->add_flag("--json", remerge_json, "one JSON document instead of text");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kCannotRun;
  }
  o.kafka.bootstrap_servers = bootstrap;
  o.kafka.client_id = "diloco-replay";
  o.kafka.connect_timeout_ms = static_cast<int>(connect_timeout_s * 1000);
  o.timeout_ms = static_cast<int>(timeout_s * 1000);
  o.threads = threads;
  try {
    if (!since.empty()) list_o.since_ms = parse_time_ms(since);
    if (!until.empty()) list_o.until_ms = parse_time_ms(until);
    if (show_cmd->parsed() && !show_merge && !show_state && show_o.position.topic.empty())
      throw InvalidInput("show: a delta needs --topic (or pass --merge / --state)");
    if (!rule.empty()) remerge_o.rule = rule == "avg" ? MergeRule::WeightedAverage : MergeRule::RadialDirectional;
    if (!optimizer.empty()) remerge_o.optimizer = parse_outer_optimizer(optimizer);
    if (remerge_cmd->count("--alpha")) remerge_o.staleness_alpha = alpha;
    if (remerge_cmd->count("--outer-lr")) remerge_o.lr = lr;
    if (remerge_cmd->count("--momentum")) remerge_o.momentum = momentum;
    if (remerge_cmd->count("--quorum")) remerge_o.quorum = quorum;

    ReplayRun run = open_run(o);
    if (list->parsed()) list_deltas(run, list_o, std::cout);
    if (show_cmd->parsed()) {
      show_o.what = show_merge ? ShowWhat::Merge : show_state ? ShowWhat::State : ShowWhat::Delta;
      show(run, show_o, std::cout);
    }
    if (dump->parsed()) dump_delta(run, dump_at, dump_out, std::cout);
    if (rebuild_cmd->parsed()) {
      rebuild_o.out = rebuild_out;
      rebuild(run, rebuild_o, std::cout);
    }
    if (verify_cmd->parsed()) return print_verify(verify(run, std::cerr));
    if (audit_cmd->parsed()) return print_audit(audit(run), audit_json, std::cout) == 0 ? 0 : kMismatch;
    if (remerge_cmd->parsed()) print_remerge(remerge(run, remerge_o, std::cerr), remerge_json, std::cout);
    return 0;
  } catch (const InternalError& e) {
    std::cerr << "diloco-replay: internal error: " << e.what() << "\n";
    return kInternal;
  } catch (const Error& e) {
    std::cerr << "diloco-replay: error: " << e.what() << "\n";
    return kCannotRun;
  } catch (const std::exception& e) {
    std::cerr << "diloco-replay: internal error: " << e.what() << "\n";
    return kInternal;
  }
}
