// The adaptive grace window (Decoupled DiLoCo): once the quorum of a fragment is in, wait for
// more learners only inside the slack the overlap leaves. A learner needs the merged fragment
// about tau inner steps after it sent its delta; the quorum already used quorum_time of that and
// the merge itself (merge + commit + publish) will use sync_time, so
//   grace = gamma * max(0, tau * step_time - quorum_time - sync_time),
// capped at cap_step_times step times and at cap_seconds. step_time and sync_time are
// exponential moving averages of the learners' reported step times and of this merger's own
// merge durations. Times are seconds as plain numbers: the caller owns the clock.
#pragma once

#include <limits>

namespace diloco {

struct GraceWindowOptions {
  double gamma = 0.5;           // share of the slack spent waiting (the paper does not publish it)
  double tau = 2;               // overlap, in inner steps (the paper's schedule uses 2)
  double cap_step_times = 1;    // "capped at about one step"
  double cap_seconds = std::numeric_limits<double>::infinity();  // a hard bound as well
  double smoothing = 0.2;       // weight of a new observation in both moving averages
};

// Throws InvalidInput unless gamma, tau and both caps are >= 0 (not NaN) and smoothing is in
// (0, 1].
void validate_grace_window(const GraceWindowOptions& options);

// The formula above, for given times (seconds).
double grace_seconds(const GraceWindowOptions& options, double step_time, double quorum_time,
                     double sync_time);

class GraceWindow {
 public:
  explicit GraceWindow(const GraceWindowOptions& options = {});

  // A learner's reported inner step time (a heartbeat's step_time_s). Observations that are not
  // finite or not positive carry no information and are ignored (returns false).
  bool observe_step_time(double seconds);
  // How long one merge of this merger took, from taking the inputs to publishing. Ignored
  // (returns false) unless finite and >= 0.
  bool observe_sync_time(double seconds);

  // Current grace for a round whose quorum took `quorum_time` seconds. 0 until a step time has
  // been observed: without it there is no slack to estimate, so the merger merges at quorum
  // (the paper's K = 1 behaviour). sync_time counts as 0 until observed.
  double grace(double quorum_time) const;

  double step_time() const { return step_time_; }  // 0 until observed
  double sync_time() const { return sync_time_; }  // 0 until observed

 private:
  GraceWindowOptions options_;
  double step_time_ = 0;
  double sync_time_ = 0;
  bool has_step_time_ = false;
  bool has_sync_time_ = false;
};

}  // namespace diloco
