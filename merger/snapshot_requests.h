// Which subscriber gets a snapshot of which fragment, and when (the merger's side of the Clone
// pattern in core/zmq/params_channel.h). Subscribers ask for fragments they lack; this decides
// what to send in each turn of the merger's loop:
// - requests for one fragment are served at most once per `interval` per subscriber, and every
//   subscriber due for a fragment in one turn gets the same encoded message (one encoding);
// - the same version goes to the same subscriber again only `resend` after it was sent and once
//   it has left the publisher's queue, unless the subscriber reconnected: a large snapshot takes
//   longer to arrive and decode than the subscriber's retry interval, and answering every retry
//   would make it travel several times (such asks are "coalesced");
// - while the publisher holds `queue_bytes` or more of snapshots, the rest wait (they stay asked
//   for, "deferred"), so snapshots cannot fill the merger's memory;
// - at most `max_pending` requests are held: a flood of made-up subscriber ids is dropped.
// No I/O: the caller passes the clock, the owned versions and the publisher's side as functions.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/codec/messages.h"

namespace diloco {

// No defaults here but the bound on pending requests: the merger's options (MergerTimeouts,
// MergerOptions::snapshot_queue_bytes) are the one place the others are set.
struct SnapshotRequestOptions {
  std::chrono::milliseconds interval;
  std::chrono::milliseconds resend;
  uint64_t queue_bytes;
  size_t max_pending = 1 << 16;
};

class SnapshotRequests {
 public:
  using Clock = std::chrono::steady_clock;
  // A snapshot in the parts it travels in (segments; one part when whole).
  using Message = std::shared_ptr<const MessageParts>;

  explicit SnapshotRequests(const SnapshotRequestOptions& options) : o_(options) {}

  // A subscriber (re)connected: it holds nothing sent to it before.
  void joined(const std::string& id);
  // `id` asks for fragment p (only fragments owned are kept; an ask for another is ignored, not
  // dropped). False when an ask for an owned fragment is dropped at the bound.
  bool want(const std::string& id, uint32_t p, bool owned);

  struct Turn {
    uint64_t sent = 0;       // snapshots handed to the publisher
    uint64_t bytes = 0;      // their bytes
    uint64_t coalesced = 0;  // asks answered by a snapshot already sent or on its way
    uint64_t deferred = 0;   // due but held back by the queue bound
  };
  // One turn at time t. `versions`: the fragments owned now and their versions (requests for
  // others are forgotten). For each due fragment, round robin from the one after the fragment
  // served last, while queued() is below the bound: encode(p) once, then send(id, p, message)
  // for each subscriber due.
  Turn serve(Clock::time_point t, const std::map<uint32_t, uint64_t>& versions,
             const std::function<uint64_t()>& queued, const std::function<Message(uint32_t)>& encode,
             const std::function<void(const std::string&, uint32_t, const Message&)>& send);

  size_t pending() const { return requested_.size(); }

 private:
  using Key = std::pair<std::string, uint32_t>;
  struct Served {
    Clock::time_point at;
    uint64_t version = 0;
    std::weak_ptr<const MessageParts> queued;  // alive while the publisher holds it
  };
  SnapshotRequestOptions o_;
  std::set<Key> requested_;
  std::map<Key, Served> served_;
  uint32_t next_ = 0;  // the round robin's start: the fragment after the one served last
};

}  // namespace diloco
