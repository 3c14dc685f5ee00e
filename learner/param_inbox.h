// Receives global fragments for a learner without touching the model.
//
// A background thread follows the `members` topic to learn every merger's ZeroMQ endpoint
// (including mergers that appear later), subscribes to all of them, and strictly decodes each
// FragmentParams (run id, fingerprint, shapes, checksum); a snapshot above codec.segment_bytes
// arrives in segments, each decoded into place (FragmentParamsAssembler). Rejected messages are counted by
// reason and never reach the model. The training thread calls take() at a step boundary and gets
// the newest version of each fragment that arrived since its last call. RoundOpen notices (a
// merger's quorum for a fragment is in) are decoded the same strict way and kept, newest per
// fragment, until take_round_opens(). Updates (a version as the change from the previous one) are
// applied to the held version and checked against their checksum. A snapshot of a fragment is
// asked for (core/zmq/params_channel.h) when a merger announces in `members` a version newer than
// the one held, or one held with another checksum, and when an update does not apply.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/codec/messages.h"
#include "core/kafka/options.h"
#include "core/kafka/topics.h"
#include "core/zmq/curve.h"
#include "core/metrics/metrics.h"

namespace diloco {

struct ParamInboxOptions {
  KafkaOptions kafka;
  RunTopics topics;
  DecodeLimits limits;  // run id, fingerprint, layout
  // Extra endpoints to subscribe to from the start (besides those announced in `members`).
  std::vector<std::string> endpoints;
  // A fragment whose version a merger announced in `members` and of which no usable version
  // arrived for request_delay_s, or for twice the recent delay between announcements and
  // arrivals if longer (a slow link), at most request_interval_max_s (a dropped message, a merger
  // that was recovering when this learner connected; learner/snapshot_asks.h, StallClock; for a
  // fragment held before any version of it arrived, request_interval_max_s) is
  // asked for; a gap found while the first read of `members` catches up (announced before this
  // inbox subscribed, so it will not arrive by itself) is asked for at once. While it stays
  // missing it is asked for again after request_interval_s, then after twice that, and so on up
  // to request_interval_max_s.
  double request_delay_s = 0.5;
  double request_interval_s = 1.0;
  double request_interval_max_s = 16.0;
  int members_metadata_ms = 5000;  // the wait for the members topic's metadata when opening it
  // `members` is followed from its records of the last members_lookback_s (every live merger
  // announced itself since): merger.members_lookback_seconds.
  double members_lookback_s = 120;
  // The versions the learner starts from (read from the `state` topic, so bit for bit the
  // mergers'): updates on them apply at once, and no snapshot is asked for while the mergers
  // announce nothing newer. Shared, never written (the learner's anchors are the same objects).
  std::vector<std::shared_ptr<const FragmentParams>> held;
  // The fragments wanted (a learner of some fragments, RuntimeOptions::fragments); empty: all.
  // Versions of the others are neither received nor asked for, and their announcements ignored.
  std::vector<uint32_t> fragments;
  // Authenticated parameters (core/zmq/curve.h): subscribe as this CURVE client, so that only a
  // publisher holding the mergers' secret key is heard. None: in the clear.
  std::optional<CurveClientOptions> curve;
};

class ParamInbox {
 public:
  ParamInbox(ParamInboxOptions options, Metrics& metrics);
  ~ParamInbox();

  // Newest received version of each fragment whose version is above `known[fragment]`. Shared
  // with the inbox, which applies the next update to it: one copy of each fragment is held.
  std::vector<std::shared_ptr<const FragmentParams>> take(const std::vector<uint64_t>& known);
  // The RoundOpen notices that arrived since the last call, newest per fragment.
  std::vector<RoundOpen> take_round_opens();

  uint64_t received() const { return received_; }
  uint64_t rejected() const { return rejected_; }
  // Payload bytes received from mergers over ZeroMQ (the learner's downlink), rejected messages too.
  uint64_t bytes_received() const { return bytes_received_; }
  // Of the messages applied: how many were snapshots and updates, and their message bytes.
  uint64_t snapshots() const { return snapshots_; }
  uint64_t updates() const { return updates_; }
  uint64_t snapshot_bytes() const { return snapshot_bytes_; }
  uint64_t update_bytes() const { return update_bytes_; }
  std::vector<std::string> endpoints() const;
  // Whether the mergers that announced `fragment` have gone silent: the newest record read from
  // `members` is more than `missed` announce intervals newer than the last announcement naming
  // the fragment (a merger killed before its liveness ran out, or one blocked that long). Broker
  // timestamps only. False until the first read of `members` reached its end, for a fragment no
  // merger announced, and for announcements that give no interval (older binaries).
  bool owner_silent(uint32_t fragment, double missed) const;

 private:
  void run();

  ParamInboxOptions options_;
  Metrics& metrics_;
  mutable std::mutex mutex_;
  std::map<uint32_t, std::shared_ptr<const FragmentParams>> latest_;
  std::map<uint32_t, RoundOpen> round_opens_;
  std::vector<std::string> endpoints_;
  struct Heard {
    int64_t stamp_ms = 0;
    float interval_s = 0;
  };
  std::map<uint32_t, Heard> owner_heard_;  // per fragment, its newest announcement by a merger
  int64_t members_newest_ms_ = 0;          // the newest record read from `members`
  // The first read of `members` reached its end. Written by the inbox thread under mutex_ (which
  // also reads it without the lock: no other thread writes it).
  bool members_caught_up_ = false;
  std::atomic<uint64_t> received_{0};
  std::atomic<uint64_t> rejected_{0};
  std::atomic<uint64_t> bytes_received_{0};
  std::atomic<uint64_t> snapshots_{0}, updates_{0}, snapshot_bytes_{0}, update_bytes_{0};
  std::atomic<bool> stop_{false};
  // Fault injection for tests (DILOCO_FAULT_INBOX_THROW=N): the Nth turn of the loop throws a
  // std::runtime_error, as an unforeseen failure would.
  const int fault_turn_ = fault_turn_from_environment();
  static int fault_turn_from_environment();
  std::thread thread_;
};

}  // namespace diloco
