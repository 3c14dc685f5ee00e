// The ZeroMQ leg of the loop: mergers publish FragmentParams on an XPUB socket, learners SUBscribe
// to every merger. Each message is two frames: a topic and the encoded message. The topic is the
// fragment id as decimal text for FragmentParams ("3"), and "open." before it for a RoundOpen
// notice ("open.3"). PUB/SUB drops messages for slow or absent subscribers; every version is also
// durable in Kafka (`state`), and a subscriber gets the current versions on request:
// - a subscriber that connects (or reconnects to a restarted merger) subscribes to everything, and
//   the publisher sees that subscription: the merger then publishes every fragment it owns;
// - a subscriber that missed a version (it learns the versions from the mergers' heartbeats in
//   `members`) asks for one fragment with request(p): a subscription to "want.p", a topic nobody
//   publishes on, which the publisher sees.
// This is the last-value-cache variant of the zguide's snapshot patterns: no second socket or
// port, and reconnects ask by themselves. The price: the answer goes to every subscriber.
//
// Threading: a socket belongs to the thread that uses it.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <zmq.hpp>

namespace diloco {

class ParamsPublisher {
 public:
  // bind: e.g. "tcp://127.0.0.1:0" (a free port) or "tcp://0.0.0.0:5555". Throws IoError.
  ParamsPublisher(zmq::context_t& context, const std::string& bind, int send_high_water_mark = 64);
  // The endpoint actually bound (port resolved), e.g. "tcp://127.0.0.1:40123".
  const std::string& bound_endpoint() const { return bound_; }
  // Never blocks: a subscriber whose queue is full misses this message.
  void publish(uint32_t fragment, std::span<const uint8_t> message);
  // A RoundOpen notice of the fragment (same rules).
  void publish_round_open(uint32_t fragment, std::span<const uint8_t> message);

  // What subscribers asked for since the last call; never blocks. Call it often: subscriptions
  // queue up in the socket until read.
  struct Requests {
    bool all = false;              // a subscriber (re)connected: it wants every fragment
    std::set<uint32_t> fragments;  // fragments named by request()
    uint64_t count = 0;            // subscription messages read (malformed ones too)
  };
  Requests take_requests();

 private:
  void send(const std::string& topic, std::span<const uint8_t> message);

  zmq::socket_t socket_;
  std::string bound_;
};

class ParamsSubscriber {
 public:
  explicit ParamsSubscriber(zmq::context_t& context, int receive_high_water_mark = 256);
  // Connects once per endpoint; repeated calls with a known endpoint do nothing.
  void connect(const std::string& endpoint);
  void disconnect(const std::string& endpoint);
  const std::set<std::string>& endpoints() const { return endpoints_; }

  struct Received {
    uint32_t fragment = 0;
    bool round_open = false;  // a RoundOpen notice, not FragmentParams
    std::vector<uint8_t> message;
  };
  // One message, or nothing within timeout. Malformed framing is skipped (returns nothing).
  std::optional<Received> receive(std::chrono::milliseconds timeout);
  // Asks every connected publisher to publish the current version of `fragment` again.
  void request(uint32_t fragment);
  // Payload bytes of every frame received so far (topic and message frames, malformed ones too):
  // what this subscriber's downlink carried, without ZMTP and TCP/IP headers.
  uint64_t bytes_received() const { return bytes_received_; }

 private:
  zmq::socket_t socket_;
  std::set<std::string> endpoints_;
  uint64_t bytes_received_ = 0;
};

}  // namespace diloco
