// The ZeroMQ leg of the loop: mergers publish FragmentParams on an XPUB socket, learners SUBscribe
// to every merger. Each message is two frames: a topic and the encoded message. Topics:
// - "v.P": a new version of fragment P, for every subscriber (an update from the previous version,
//   or a snapshot from the optional periodic republish);
// - "open.P": a RoundOpen notice of fragment P (a merger's quorum is in);
// - "s.ID.P": a snapshot of fragment P for the subscriber ID alone (the publisher filters by
//   subscription, so no other subscriber's link carries it).
// A subscriber subscribes to "v.", "open." and "s.ID." (or, when it wants some fragments only, to
// "v.P" and "open.P" of each, dropping on arrival a fragment whose number merely begins with P,
// such as 10 for 1); the publisher sees the last one as the
// subscriber's hello when it connects or reconnects. A subscriber that lacks a version (it learns
// the versions from the mergers' heartbeats in `members`, or gets an update it cannot apply) asks
// for a snapshot with request(P): a subscription to "want.P.ID", a topic nobody publishes on, which
// the publisher sees. PUB/SUB drops messages for slow or absent subscribers; every version is
// also durable in Kafka (`state`).
// This is the zguide's Clone pattern on one socket: snapshots on request, then updates, with no
// second socket or port to announce.
//
// Threading: a socket belongs to the thread that uses it.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <map>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "core/codec/messages.h"
#include "core/zmq/curve.h"

namespace diloco {

// A publisher's send queue per subscriber, in messages: a subscriber that falls further behind
// misses messages (it asks for a snapshot when it notices).
inline constexpr int kPublisherHighWaterMark = 64;

class ParamsPublisher {
 public:
  // bind: e.g. "tcp://127.0.0.1:0" (a free port) or "tcp://0.0.0.0:5555". Throws IoError.
  // With `curve`: a CURVE server whose ZAP handler (bound first, in `context`, which must have no
  // other) admits only the learners whose keys are in curve->allowed_dir; `on_decision` hears of
  // every handshake's outcome, on the handler's thread.
  ParamsPublisher(zmq::context_t& context, const std::string& bind, int send_high_water_mark = kPublisherHighWaterMark,
                  const CurveServerOptions* curve = nullptr,
                  std::function<void(const ZapDecision&)> on_decision = {});
  // The endpoint actually bound (port resolved), e.g. "tcp://127.0.0.1:40123".
  const std::string& bound_endpoint() const { return bound_; }
  // Never blocks: a subscriber whose queue is full misses this message.
  void publish(uint32_t fragment, std::span<const uint8_t> message);
  // A snapshot for one subscriber (its id, as in Requests).
  void publish_to(const std::string& subscriber, uint32_t fragment, std::span<const uint8_t> message);
  // The same without a copy, for a message in parts (the segments of a streamed snapshot, one
  // ZeroMQ message each, in order; one part when whole): ZeroMQ holds each part until it is sent
  // (or dropped), `parts` is alive until the last one is, and queued_bytes() counts the parts not
  // yet sent, so a caller can bound the memory its snapshots take.
  void publish_to(const std::string& subscriber, uint32_t fragment, std::shared_ptr<const MessageParts> parts);
  // Bytes of shared messages handed to ZeroMQ and not yet sent or dropped.
  uint64_t queued_bytes() const { return queued_->load(); }
  // A RoundOpen notice of the fragment (same rules).
  void publish_round_open(uint32_t fragment, std::span<const uint8_t> message);

  // What subscribers asked for since the last call; never blocks. Call it often: subscriptions
  // queue up in the socket until read.
  struct Requests {
    std::set<std::string> joined;  // subscribers that (re)connected: each wants every fragment
    std::map<std::string, std::set<uint32_t>> fragments;  // subscriber -> fragments it asked for
    uint64_t count = 0;            // subscription messages read (malformed ones too)
  };
  Requests take_requests();

 private:
  void send(const std::string& topic, std::span<const uint8_t> message);

  std::unique_ptr<ZapHandler> zap_;  // before socket_: bound first, closed last
  zmq::socket_t socket_;
  // Shared with the messages in flight, which may be freed by ZeroMQ's I/O thread after this
  // publisher is gone.
  std::shared_ptr<std::atomic<uint64_t>> queued_ = std::make_shared<std::atomic<uint64_t>>(0);
  std::string bound_;
};

class ParamsSubscriber {
 public:
  // `id` names this subscriber in its snapshot topic: letters, digits, '-' and '_' (InvalidInput
  // otherwise); empty: a random one.
  // With `curve`: a CURVE client that completes a handshake only with a publisher holding the
  // mergers' secret key, and only if that publisher admits this learner's key.
  // With `fragments` not empty: versions and notices of those fragments only (the publisher
  // filters by subscription, so the others never cross this subscriber's link).
  explicit ParamsSubscriber(zmq::context_t& context, int receive_high_water_mark = 256, std::string id = {},
                            const CurveClientOptions* curve = nullptr, const std::vector<uint32_t>& fragments = {});
  const std::string& id() const { return id_; }
  // Connects once per endpoint; repeated calls with a known endpoint do nothing.
  void connect(const std::string& endpoint);
  void disconnect(const std::string& endpoint);
  const std::set<std::string>& endpoints() const { return endpoints_; }

  struct Received {
    uint32_t fragment = 0;
    bool round_open = false;  // a RoundOpen notice, not FragmentParams
    bool snapshot_for_me = false;  // sent to this subscriber alone ("s.ID.P")
    std::vector<uint8_t> message;
  };
  // One message, or nothing within timeout. Malformed framing is skipped (returns nothing).
  std::optional<Received> receive(std::chrono::milliseconds timeout);
  // Asks every connected publisher for a snapshot of `fragment`.
  void request(uint32_t fragment);
  // Payload bytes of every frame received so far (topic and message frames, malformed ones too):
  // what this subscriber's downlink carried, without ZMTP and TCP/IP headers.
  uint64_t bytes_received() const { return bytes_received_; }

 private:
  zmq::socket_t socket_;
  std::string id_;
  std::set<uint32_t> fragments_;  // empty: every fragment
  std::set<std::string> endpoints_;
  uint64_t bytes_received_ = 0;
};

}  // namespace diloco
