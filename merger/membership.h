// Which learners are live, judged on the broker's clock: the members topic stamps every record
// with its append time (broker_config/topics.def), and "now" is the newest stamp read there (the
// merger's own announcements keep it current). A learner whose own clock is off is therefore
// neither dead nor immortal, and a learner that leaves (a tombstone) is gone at once.
//
// Pure bookkeeping: the caller polls and decodes the members topic and passes each record in.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/codec/messages.h"
#include "merger/fragment_merger.h"

namespace diloco {

class Membership {
 public:
  explicit Membership(double liveness_seconds);

  // One record of the members topic: its key, its broker stamp, and the member it announces
  // (empty: a tombstone, the instance left). Returns the learner's step time when the record is
  // a learner's heartbeat within the liveness window (the grace window learns from it).
  std::optional<float> observe(const std::string& key, int64_t stamp_ms, const std::optional<Member>& member);

  // Learners heard from within liveness_seconds of the newest stamp, by instance id.
  std::vector<std::string> live_learners() const;
  // Those of them that train `fragment`: whose newest heartbeat lists it (a learner of some
  // fragments lists those alone; a heartbeat that lists none counts for every fragment).
  std::vector<std::string> live_learners(uint32_t fragment) const;
  // The shape of an inner step the learner declared in its newest announcement that declares
  // one (kept after it leaves: its last deltas may still come). Empty: none read yet.
  std::optional<DeclaredBatch> declared(const std::string& learner) const;
  int64_t now_us() const { return now_us_; }

 private:
  int64_t window_us_;
  int64_t now_us_ = 0;                     // the newest stamp read
  std::map<std::string, int64_t> heard_;  // learner id -> stamp of its latest heartbeat
  std::map<std::string, std::vector<uint32_t>> trains_;  // learner id -> the fragments its latest heartbeat lists
  std::map<std::string, DeclaredBatch> declared_;
};

}  // namespace diloco
