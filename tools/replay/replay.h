// diloco-replay: reads a run's durable logs (the delta topics, `merges` and `state`) offline to
// inspect what each learner sent and what became of it, rebuild any version of any fragment,
// verify every checksum, and re-run the merge policy with other settings (ARCHITECTURE.md
// sections 7 and 8). Rebuilding goes through the merger's own recovery code (merger/recovery.h),
// so replay and a recovering merger can never disagree.
//
// Every read is read_committed and ends at the end of each log as of the call, so the commands
// work on a live run as on a finished one.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <iosfwd>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/config/run_config.h"
#include "core/kafka/options.h"
#include "core/kafka/topics.h"
#include "core/files/safetensors.h"
#include "merger/recovery.h"

namespace diloco {

// ---- the run --------------------------------------------------------------------------------

struct ReplayOptions {
  std::filesystem::path config_file;   // the run config the learners and mergers ran with
  std::vector<std::string> overrides;  // "section.key=value", as --set of the other binaries
  std::string run_id;                  // non-empty: overrides run.id
  KafkaOptions kafka;
  std::vector<std::string> regions;    // empty: every diloco.<run>.deltas.<region> topic
  int timeout_ms = 120000;             // bound of one read of a log to its end
  unsigned threads = 0;                // share each rebuilt merge's arithmetic (0: one per core)
};

// A run opened for reading: its config, model layout (from its checkpoints: to decode and
// rebuild), and topics.
struct ReplayRun {
  RunConfig config;
  std::shared_ptr<const FragmentLayout> layout;
  KafkaOptions kafka;
  RunTopics topics;
  std::vector<std::string> delta_topics;  // one per region, sorted
  int partitions = 1;                     // NP of every topic but members and rejected
  int timeout_ms = 120000;
  std::shared_ptr<WorkPool> pool;  // shares the arithmetic of every merge rebuilt (same bits)
  std::shared_ptr<LogReader> reader;  // every read of the logs, through one consumer (required)

  DecodeLimits limits() const;
  LogContext context() const;  // views this run: keep the run alive while it is used
  int32_t partition_of(uint32_t fragment) const;
  std::vector<uint32_t> fragments_of(int32_t partition) const;
};

// Loads the config, waits for the broker (Unavailable after kafka.connect_timeout_ms), checks
// that the run's topics exist with the same partition count and reads the run's model layout
// from its checkpoints. Throws InvalidInput naming the missing topic, or a run without version 0,
// and a way out.
ReplayRun open_run(const ReplayOptions& options);

using Position = std::tuple<std::string, int32_t, int64_t>;  // topic, partition, offset
Position position_key(const LogPosition& p);

// Told about each message that fails strict decoding (its position, the reason) and is skipped.
using OnRejected = std::function<void(const LogPosition&, const std::string&)>;

// ---- what became of each delta (from the merge records) -------------------------------------

struct DeltaFate {
  enum class Kind { Unaccounted, Merged, Dropped, Pending, Rejected };
  Kind kind = Kind::Unaccounted;
  uint64_t version = 0;    // Merged: the version it went into
  double weight = 0;       // Merged: raw weight, as recorded
  double share = 0;        // Merged: its share of that merge (weights normalised to sum 1)
  uint64_t staleness = 0;  // Merged and Dropped
  DropReason reason = DropReason::None;  // Dropped, Pending (PendingAtStop)
  std::string rejected_reason;             // Rejected: the merger's reason (`rejected` topic)
  std::string rejected_by;                 // Rejected: the merger instance
  std::string detail;
  LogPosition record;      // the merge record that says so (Rejected: the `rejected` entry)
};
const char* fate_kind_name(DeltaFate::Kind kind);

// Fates of the deltas named by the merge records of the given partitions of `merges` (a delta in
// delta partition i is accounted for in merges partition i). A later record overrides an earlier
// "pending at stop". Deltas a merger rejected before any record could name them (wrong partition,
// failed strict decoding) are read from the run's `rejected` topic. Undecodable records are
// reported to `rejected` and skipped.
std::map<Position, DeltaFate> delta_fates(const ReplayRun& run, const std::vector<int32_t>& partitions,
                                          const OnRejected& rejected);

// ---- list, show, dump -----------------------------------------------------------------------

struct ListOptions {
  std::vector<std::string> topics;  // delta topics or region names; empty: every region
  std::optional<int32_t> partition;
  std::optional<int64_t> from_offset, to_offset;  // inclusive
  std::optional<int64_t> since_ms, until_ms;      // Kafka timestamps, unix milliseconds
  std::optional<uint32_t> fragment;
  std::string learner;                            // empty: every learner
  bool json = false;                              // JSON lines instead of a table
};

// Prints one line per delta in the range with its fate. A delta that fails strict decoding is
// listed as rejected with its reason; it never stops the listing.
void list_deltas(const ReplayRun& run, const ListOptions& options, std::ostream& out);

// "2026-11-30T09:30:00Z" (UTC), unix seconds, "now", or "-90s" / "-15m" / "-2h" / "-1d" before
// now; returns unix milliseconds. Throws InvalidInput for anything else.
int64_t parse_time_ms(const std::string& text);

enum class ShowWhat { Delta, Merge, State };
struct ShowOptions {
  ShowWhat what = ShowWhat::Delta;
  LogPosition position;  // Delta: a delta topic or region name; implied for Merge and State
  int first_values = 8;  // per tensor
};
// Prints the message at the position as one JSON document (tensors summarised).
void show(const ReplayRun& run, const ShowOptions& options, std::ostream& out);

// Writes a delta's decoded (dequantized fp32) tensors to `out` as a safetensors file
// (core/files/safetensors.h), keyed by their names in the model. The topic may be a region name.
void dump_delta(const ReplayRun& run, LogPosition position, const std::filesystem::path& out, std::ostream& log);

// ---- rebuild, verify ------------------------------------------------------------------------

struct RebuildOptions {
  uint64_t version = 0;
  std::optional<uint32_t> fragment;  // none: every fragment, each at min(version, its latest)
  std::filesystem::path out;
};
// Rebuilds and writes the parameters as a safetensors file of the tensors by name: one
// fragment's, or every fragment's (the whole model; for a run of the built-in model the file also
// names its architecture, so diloco-sample reads it). Prints one line per fragment. Throws
// InvalidInput when the version does not exist.
void rebuild(const ReplayRun& run, const RebuildOptions& options, std::ostream& out);

// Every fragment's state at min(version, its newest), rebuilt as rebuild() does (UINT64_MAX: the
// newest of each). Throws InvalidInput when a fragment has no version 0 yet.
std::vector<FragmentState> rebuild_states(const ReplayRun& run, uint64_t version);

struct VerifyReport {
  size_t fragments = 0;    // with a version 0 (those without one have nothing to verify)
  size_t versions = 0;     // merge records applied and checked
  size_t checkpoints = 0;  // checkpoints compared with the rebuilt state
  std::vector<std::string> mismatches;  // the first of each fragment, naming its position
  bool ok() const { return mismatches.empty(); }
};
// Rebuilds every version of every fragment from version 0 (the proposal its genesis record names,
// or its earliest checkpoint when the proposal is gone), checking that version 0 is the proposal's
// values, every merge record's checksum and every later checkpoint against the rebuilt state.
// Progress goes to `progress`.
VerifyReport verify(const ReplayRun& run, std::ostream& progress);

// ---- audit ---------------------------------------------------------------------------------

// A run checked from its logs alone (invariants 1 and 2 of ARCHITECTURE.md section 8, as far as
// the logs show them).
struct AuditedVersion {
  uint64_t version = 0;
  uint64_t checksum = 0;
  int64_t time_ms = 0;  // the record's Kafka timestamp
};
struct RunAudit {
  std::set<Position> deltas;             // every delta in the region topics
  std::set<Position> proposals;          // every proposal of version 0 in the genesis topic
  size_t genesis = 0;                    // genesis records (one per fragment that has version 0)
  std::map<Position, int> final_count;   // merged or dropped for good
  std::map<Position, int> merged_count;
  std::set<Position> pending_at_stop;
  std::set<Position> rejected;           // named by the `rejected` topic
  std::map<std::string, size_t> dropped;  // by reason
  // (fragment, learner, base version) -> merged deltas
  std::map<std::tuple<uint32_t, std::string, uint64_t>, int> merged_on_base;
  std::map<uint32_t, std::vector<AuditedVersion>> versions;  // per fragment, in log order (merges only)
  size_t merges = 0;
  size_t announcements = 0;  // distinct (fragment, version, checksum) announced in `members`
  std::vector<std::string> problems;
  bool ok() const { return problems.empty(); }
};
// Reads every delta, proposal, merge record and rejection and checks: every delta is accounted for
// exactly once (merged into one version, dropped for good with a reason, or rejected by a merger)
// or recorded as pending at a clean stop; every proposal of version 0 is either named by its
// fragment's one genesis record or rejected; no delta is merged twice; no learner has two merged deltas
// on the same base of a fragment (its progress would count twice); per fragment, versions start
// at a genesis record and only move forward by one; every version a merger or learner announced
// in `members` is in the merge log, with the checksum announced (none was announced before its
// record committed). A merges partition whose transaction stays open (a killed merger's, until
// the broker aborts it) is a problem too. Waits up to the run's timeout for open transactions.
RunAudit audit(const ReplayRun& run);
// A summary and one line per problem, or (json) one JSON document with the counts, the problems
// and every version's checksum and record time. Returns 0 when the audit passed, else 1.
int print_audit(const RunAudit& audit, bool json, std::ostream& out);

// ---- remerge --------------------------------------------------------------------------------

// Settings left empty are taken from each merge record, i.e. as the run merged.
struct RemergeOptions {
  std::optional<MergeRule> rule;
  std::optional<OuterOptimizerKind> optimizer;
  std::optional<float> staleness_alpha, lr, momentum;
  std::optional<uint32_t> quorum;
  // Non-empty: the re-merged model is written there (safetensors, as rebuild writes it), to be
  // evaluated with the run's own model code (diloco-eval for the built-in one).
  std::filesystem::path out;
};

struct RemergedFragment {
  uint32_t fragment = 0;
  uint64_t original_version = 0, original_checksum = 0;  // the run's newest version
  uint64_t version = 0, checksum = 0;                    // after the re-merge
  uint64_t start_version = 0;  // the checkpoint (or genesis) both start from
  size_t merges = 0;           // re-merges made
  size_t unmerged = 0;         // deltas still pending at the end (a larger quorum not reached)
};

struct RemergeReport {
  bool regrouped = false;  // quorum changed: arrivals grouped anew instead of as recorded
  std::vector<RemergedFragment> fragments;
};

// Re-runs the merge policy over the recorded deltas in their recorded arrival order. With the
// recorded quorum each merge takes the inputs its record names (weights recomputed with the new
// staleness_alpha); with another quorum K the deltas each record accounts for (merged or dropped
// for good) are offered, in send-time order, to the merger's FragmentMerger, which merges as soon
// as K learners are pending. Delta base versions map to the re-merged version current when the
// original base version was made.
RemergeReport remerge(const ReplayRun& run, const RemergeOptions& options, std::ostream& progress);
void print_remerge(const RemergeReport& report, bool json, std::ostream& out);

const char* merge_rule_name(MergeRule rule);               // "rda" | "avg", as in the config

// The parameters of fragment states by name. With every fragment of the layout, the model's
// tensors whole, in model order (a tensor cut into blocks of rows is put together); otherwise
// each fragment's tensors as it holds them ("name[r0:r1]" for a block of rows). Takes the values
// out of `states`. Throws InvalidInput when a state does not match the layout.
std::vector<NamedTensor> named_tensors(const FragmentLayout& layout, std::vector<FragmentState>& states);

// Writes fragment states as one safetensors file of their tensors by name (named_tensors; for a
// run of the built-in model and every fragment, with its architecture).
void save_states(const ReplayRun& run, std::vector<FragmentState> states, const nlohmann::json& info,
                 const std::filesystem::path& path);

}  // namespace diloco
