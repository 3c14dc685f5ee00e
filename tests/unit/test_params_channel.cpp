// The ZeroMQ parameter channel over loopback TCP: a subscriber connected to two publishers gets
// both; malformed framing is skipped; an endpoint already in use is a clear error.
#include <catch2/catch.hpp>

#include <thread>
#include <zmq.hpp>

#include "core/errors.h"
#include "core/zmq/params_channel.h"

using namespace diloco;
using namespace std::chrono_literals;

namespace {

// PUB/SUB needs the subscription to propagate before messages flow: publish until one arrives.
std::optional<ParamsSubscriber::Received> publish_until_received(ParamsPublisher& pub, ParamsSubscriber& sub,
                                                                 uint32_t fragment,
                                                                 const std::vector<uint8_t>& message) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    pub.publish(fragment, message);
    if (auto r = sub.receive(50ms)) return r;
  }
  return std::nullopt;
}

}  // namespace

TEST_CASE("a subscriber receives from every publisher it connected to", "[zmq]") {
  zmq::context_t context;
  ParamsPublisher a(context, "tcp://127.0.0.1:*");
  ParamsPublisher b(context, "tcp://127.0.0.1:*");
  CHECK(a.bound_endpoint().rfind("tcp://127.0.0.1:", 0) == 0);
  CHECK(a.bound_endpoint() != b.bound_endpoint());

  ParamsSubscriber sub(context);
  sub.connect(a.bound_endpoint());
  sub.connect(b.bound_endpoint());
  sub.connect(a.bound_endpoint());  // idempotent
  CHECK(sub.endpoints().size() == 2);

  auto from_a = publish_until_received(a, sub, 3, {1, 2, 3});
  REQUIRE(from_a);
  CHECK(from_a->fragment == 3);
  CHECK(from_a->message == std::vector<uint8_t>{1, 2, 3});
  std::optional<ParamsSubscriber::Received> from_b;
  for (int i = 0; i < 100 && !(from_b && from_b->fragment == 7); ++i) from_b = publish_until_received(b, sub, 7, {9});
  REQUIRE(from_b);
  CHECK(from_b->fragment == 7);
  CHECK(from_b->message == std::vector<uint8_t>{9});
}

TEST_CASE("malformed framing is skipped, not crashed on", "[zmq]") {
  zmq::context_t context;
  zmq::socket_t raw(context, zmq::socket_type::pub);
  raw.bind("tcp://127.0.0.1:*");
  std::string endpoint = raw.get(zmq::sockopt::last_endpoint);
  ParamsSubscriber sub(context);
  sub.connect(endpoint);
  // Malformed messages interleaved with a valid one: only the valid one ever comes out.
  int valid = 0;
  for (int attempt = 0; attempt < 200 && valid < 3; ++attempt) {
    (void)raw.send(zmq::str_buffer("not-a-number"), zmq::send_flags::sndmore);
    (void)raw.send(zmq::str_buffer("payload"), zmq::send_flags::none);
    (void)raw.send(zmq::str_buffer("single frame"), zmq::send_flags::none);
    (void)raw.send(zmq::str_buffer("12x"), zmq::send_flags::sndmore);
    (void)raw.send(zmq::str_buffer("payload"), zmq::send_flags::none);
    (void)raw.send(zmq::str_buffer("5"), zmq::send_flags::sndmore);
    (void)raw.send(zmq::str_buffer("ok"), zmq::send_flags::none);
    for (int i = 0; i < 4; ++i) {
      if (auto r = sub.receive(20ms)) {
        CHECK(r->fragment == 5);
        CHECK(std::string(r->message.begin(), r->message.end()) == "ok");
        ++valid;
      }
    }
  }
  CHECK(valid >= 3);
}

TEST_CASE("binding an endpoint in use names it and the way out", "[zmq]") {
  zmq::context_t context;
  ParamsPublisher a(context, "tcp://127.0.0.1:*");
  CHECK_THROWS_WITH(ParamsPublisher(context, a.bound_endpoint()), Catch::Contains("--bind"));
  ParamsSubscriber sub(context);
  CHECK_THROWS_AS(sub.connect("nonsense://x"), InvalidInput);
}
