#include "merger/grace_window.h"

#include <algorithm>
#include <cmath>

#include "core/errors.h"

namespace diloco {

namespace {

// The first observation starts the average (no bias towards an arbitrary initial value).
void update_average(double& average, bool& started, double observation, double smoothing) {
  average = started ? average + smoothing * (observation - average) : observation;
  started = true;
}

}  // namespace

void validate_grace_window(const GraceWindowOptions& o) {
  auto non_negative = [](double v, const char* name) {
    if (!(v >= 0))
      throw InvalidInput(detail::concat("grace window ", name, " ", v, " is not >= 0"));
  };
  non_negative(o.gamma, "gamma");
  non_negative(o.tau, "tau");
  non_negative(o.cap_step_times, "cap_step_times");
  non_negative(o.cap_seconds, "cap_seconds");
  if (!(o.smoothing > 0 && o.smoothing <= 1))
    throw InvalidInput(detail::concat("grace window smoothing ", o.smoothing, " is not in (0, 1]"));
}

double grace_seconds(const GraceWindowOptions& o, double step_time, double quorum_time,
                     double sync_time) {
  const double slack = std::max(0.0, o.tau * step_time - quorum_time - sync_time);
  return std::min({o.gamma * slack, o.cap_step_times * step_time, o.cap_seconds});
}

GraceWindow::GraceWindow(const GraceWindowOptions& options) : options_(options) {
  validate_grace_window(options_);
}

bool GraceWindow::observe_step_time(double seconds) {
  if (!std::isfinite(seconds) || seconds <= 0) return false;
  update_average(step_time_, has_step_time_, seconds, options_.smoothing);
  return true;
}

bool GraceWindow::observe_sync_time(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return false;
  update_average(sync_time_, has_sync_time_, seconds, options_.smoothing);
  return true;
}

double GraceWindow::grace(double quorum_time) const {
  if (!has_step_time_) return 0;
  return grace_seconds(options_, step_time_, quorum_time, sync_time_);
}

}  // namespace diloco
