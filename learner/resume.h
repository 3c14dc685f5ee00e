// Where a learner (re)starting joins a running run, from the members topic (every process's
// newest announcement, stamped by the broker). A learner killed and restarted under the same id
// must not start over at step 0: its fragment schedule would be out of phase with its peers', so
// its deltas would not meet theirs in a merge, and in a synchronous mode (diloco.wait_steps >= 0)
// the peers would wait for a delta of the fragment they cut last while it waits for another one:
// a deadlock until diloco.wait_timeout_seconds. Its learning-rate schedule would warm up again too.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>

#include "core/codec/messages.h"

namespace diloco {

// One record of the members topic: its key (the instance id), broker timestamp, and the decoded
// announcement (none: a tombstone, the instance left).
struct MemberRecord {
  std::string key;
  int64_t stamp_ms = 0;
  std::optional<Member> member;
};

struct ResumePoint {
  // The step to continue from. A learner that announced itself before (a restart) continues at
  // the step it announced last; in a synchronous mode (align_to_peers) at one below the slowest
  // live peer learner instead, so that its next inner step reaches the step at which the waiting
  // peers cut last and the fragment they wait on is cut next. A learner new to the run starts at
  // 0 (a late start does not skip steps of its budget).
  uint64_t step = 0;
  // Per fragment, the newest version a live merger announced: wait for these before training.
  std::map<uint32_t, uint64_t> versions;
  size_t live_peers = 0;
  bool restarted = false;  // the topic holds an earlier announcement of this learner
};

// `records` in log order; a record counts as live when its stamp is within `liveness_ms` of the
// newest stamp of all records (the broker's "now"). Only learners count as peers (not evaluators).
ResumePoint resume_point(const std::string& self, std::span<const MemberRecord> records, int64_t liveness_ms,
                         bool align_to_peers);

}  // namespace diloco
