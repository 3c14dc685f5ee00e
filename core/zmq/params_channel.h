// The ZeroMQ leg of the loop: mergers PUBlish FragmentParams, learners SUBscribe to every merger.
// Each message is two frames: a topic and the encoded message. The topic is the fragment id as
// decimal text for FragmentParams ("3"), and "open." before it for a RoundOpen notice ("open.3"). PUB/SUB drops messages for slow or absent
// subscribers; that is fine here because every version is also durable in Kafka (`state`) and
// mergers re-publish their latest versions periodically.
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

 private:
  zmq::socket_t socket_;
  std::set<std::string> endpoints_;
};

}  // namespace diloco
