// The merger's state machine for one owned fragment (ARCHITECTURE.md section 6):
//
//   COLLECTING --(pending deltas from >= K distinct learners: poll)--> GRACE
//   GRACE --(grace deadline passed, or every live learner has a delta pending: poll)--> MERGING
//   MERGING --(take_merge_inputs, merge_step, commit; then merge_committed)--> PUBLISH
//   PUBLISH --(FragmentParams sent; then published)--> COLLECTING (a new round)
//   any state --(stop)--> STOPPED
//
// Pure bookkeeping: no I/O, no clock (every time is seconds passed in by the caller, from one
// monotonic clock), no threads; the caller serialises calls. A call that does not fit the
// current state is a bug in the caller and throws InternalError.
//
// Pending set rules (offer), checked in this order:
//   - tokens above inner_steps x the batch x context its learner announced  -> Invalid
//     (DeclaredBatch; fewer are fine: a step may train on shorter or fewer sequences)
//   - L2 norm above max_norm_ratio x the median of the fragment's recent accepted deltas
//                                                           -> Invalid (InputBounds)
//   - base_version > current version                       -> Invalid ("base from the future")
//   - base_version <= a base already merged from the learner -> Superseded ("base already merged
//     from this learner": a learner's deltas accumulate from its anchor until it adopts a new
//     version, so merging it again would count that progress twice)
//   - staleness > max_staleness                             -> TooStale
//   - weight 0 (e.g. a staleness discount that underflows)  -> Invalid
//   - at most one pending delta per learner: of two, the newer stays (the higher base, and on one
//     base the higher seq) and the other is Superseded. On the same base the newer one contains
//     the older one's progress; on a newer base (the older delta missed its merge and the
//     learner adopted a newer version since) the older one's progress is given up for the
//     one-delta-per-learner rule.
// Deltas may be offered in any state but STOPPED; those arriving while a merge is under way wait
// for the next round and are checked again against the new version when it is committed.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/codec/messages.h"
#include "merger/grace_window.h"
#include "merger/merge_step.h"

namespace diloco {

enum class MergerState : uint8_t { Collecting, Grace, Merging, Publish, Stopped };
const char* merger_state_name(MergerState);

// Checks of well-formed deltas against the run, beyond what the strict decoder can know.
struct InputBounds {
  double max_norm_ratio = 0;     // merger.max_norm_ratio; 0: no bound
  size_t norm_window = 16;       // the median is over this many recent accepted deltas
  size_t norm_min = 4;           // and the bound applies once there are this many
};

// What a learner announces of its inner steps in `members`: sequences per step and tokens per
// sequence. A delta of it may claim at most inner_steps x batch x context tokens, so token
// weighting counts the tokens learners really trained on, whatever their batch sizes.
struct DeclaredBatch {
  uint32_t batch = 0;
  uint32_t context = 0;
  uint64_t tokens_per_step() const { return uint64_t{batch} * context; }
};

// The DeltaRef of a decoded delta read at `position` (staleness and weight are filled in later).
DeltaRef delta_ref(const DeltaHeader& header, const LogPosition& position);

// What take_merge_inputs hands to merge_step and to the MergeRecord. It owns the inputs'
// tensors, so it is move-only: a copy would view the original's tensors.
struct MergePlan {
  MergePlan() = default;
  MergePlan(MergePlan&&) = default;
  MergePlan& operator=(MergePlan&&) = default;

  uint64_t version = 0;             // the version merged onto (the record's prev_version)
  std::vector<MergeInput> inputs;   // sorted by (topic, partition, offset); staleness and raw
                                    // weight filled in; tensors view `tensors`
  std::vector<DroppedDelta> dropped;  // every drop since the previous plan: the record's list
  std::vector<DeltaTensors> tensors;  // inputs[i].tensors views tensors[i]
};

class FragmentMerger {
 public:
  // A fragment at `version` (genesis, a checkpoint, or the end of a recovery), collecting from
  // `now` (a round starts with its first pending delta, so `now` only dates the merger's birth).
  // `merged_bases` is FragmentState.merged_bases of that version: the newest base merged from
  // each learner, kept in checkpoints and rebuilt from the records after them.
  // Uses hyper.quorum, max_staleness and staleness_alpha (InvalidInput if invalid).
  FragmentMerger(uint32_t fragment, uint64_t version, const OuterHyper& hyper, double now,
                 std::map<std::string, uint64_t> merged_bases = {}, InputBounds bounds = {});

  // Offers a decoded delta (decode_delta with DeltaValues::AsSent keeps an int4 delta at about
  // 0.53 bytes per value until its merge). Returns the delta dropped because of it, if any: the offered one or
  // the pending one it replaced. Drops are also kept for the next MergePlan. `declared`: what
  // the delta's learner announced of its inner steps (none yet: its tokens are not bounded here,
  // only by the decoder's limit).
  std::optional<DroppedDelta> offer(DeltaRef delta, DeltaTensors tensors, double now,
                                    std::optional<DeclaredBatch> declared = std::nullopt);

  // Advances COLLECTING -> GRACE -> MERGING as due and returns whether take_merge_inputs() is
  // allowed now (true in MERGING until the inputs are taken). `live_learners` is the set the
  // caller currently believes alive; "every live learner has a delta pending" ends the grace
  // early only when that set is not empty. The grace is computed once, on entering GRACE, from
  // `grace` and the quorum time: from the round's first pending delta to the quorum (the paper's
  // quorum_time; with quorum 1 it is 0, so the whole slack tau * step_time - sync_time is there).
  bool poll(double now, std::span<const std::string> live_learners, const GraceWindow& grace);

  // MERGING only, once per round: the pending deltas become this merge's inputs.
  MergePlan take_merge_inputs(double now);

  // MERGING, after take_merge_inputs and after the MergeRecord and state are durable:
  // `new_version` must be version() + 1. Moves to PUBLISH. Pending deltas that arrived meanwhile
  // are checked against the new version; returns those dropped now (also kept for the next plan).
  std::vector<DroppedDelta> merge_committed(uint64_t new_version);

  // MERGING, after take_merge_inputs, when the merge cannot be used (its result is not finite):
  // nothing was merged, so the merged bases are restored and a new round starts at `now`; the
  // caller records the inputs as Invalid drops (returned here, with their reason).
  std::vector<DroppedDelta> merge_abandoned(const std::string& reason, double now);

  // PUBLISH only, once the new version is sent: starts the next round at `now` and returns how
  // long the merge took since take_merge_inputs (feed it to GraceWindow::observe_sync_time).
  double published(double now);

  // A clean stop: returns every delta this merger holds that no committed MergeRecord accounts
  // for: drops not yet in a plan, then pending (and taken but uncommitted) deltas as
  // PendingAtStop. Moves to STOPPED, after which every call throws. In MERGING after
  // take_merge_inputs, the plan's own `dropped` list stays the caller's to record.
  std::vector<DroppedDelta> stop();

  MergerState state() const { return state_; }
  uint32_t fragment() const { return fragment_; }
  uint64_t version() const { return version_; }
  // When the grace window ends (GRACE only): how long the caller may sleep.
  std::optional<double> grace_deadline() const;
  // The current round's timing: its first pending delta and the moment it reached the quorum
  // (empty until they happen; kept through MERGING for the caller's metrics).
  std::optional<double> round_first_delta() const { return first_at_; }
  std::optional<double> quorum_reached() const { return quorum_at_; }
  // The grace window the current (or last) round was given on reaching its quorum, in seconds.
  double granted_grace() const { return granted_grace_; }
  size_t pending_learners() const { return pending_.size(); }
  // Positions of the held deltas the next committed MergeRecord must account for (pending, and
  // dropped since the last plan). A consumer offset committed with a merge must not pass the
  // lowest of these in its partition, or a crash would lose them.
  std::vector<LogPosition> uncommitted_positions() const;

 private:
  struct HeldDelta {
    DeltaRef ref;
    DeltaTensors tensors;  // INT8 and INT4 deltas as they travelled
  };

  // The reason `ref` cannot be pending at the current version (weighs it as a side effect).
  std::optional<DroppedDelta> check(DeltaRef& ref, std::optional<double> norm = std::nullopt) const;
  void start_round(double now);  // the round after a merge: what is pending opens it now
  DroppedDelta record_drop(DroppedDelta dropped);  // keeps it for the next plan
  void expect(MergerState state, const char* call) const;

  uint32_t fragment_;
  uint64_t version_;
  OuterHyper hyper_;
  MergerState state_ = MergerState::Collecting;
  std::map<std::string, HeldDelta> pending_;     // by learner id
  std::vector<DeltaRef> taken_;                  // the current merge's inputs, in merge order
  std::vector<DroppedDelta> dropped_;            // since the last plan
  std::map<std::string, uint64_t> merged_base_;  // learner id -> newest base merged from it
  std::map<std::string, uint64_t> merged_base_before_;  // before the current merge's inputs
  InputBounds bounds_;
  std::deque<double> norms_;  // L2 norms of the last accepted deltas
  std::optional<double> first_at_;   // when the current round's first delta became pending
  std::optional<double> quorum_at_;  // when the current round had K learners pending
  std::optional<double> deadline_;   // GRACE: end of the grace window
  double granted_grace_ = 0;
  double merge_started_ = 0;
};

}  // namespace diloco
