// RoundOpen notices: the strict codec and their ZeroMQ framing beside FragmentParams.
#include <catch2/catch.hpp>

#include <zmq.hpp>

#include "core/codec/messages.h"
#include "core/codec/reject.h"
#include "core/zmq/params_channel.h"

using namespace diloco;
using namespace std::chrono_literals;

namespace {

RoundOpen notice() {
  return RoundOpen{.run_id = "r1", .fingerprint = 0xfeed, .fragment = 2, .version = 17, .pending = 1,
                   .grace_ms = 250, .merger_instance = "merger-0", .epoch = 9, .time_us = 123456};
}

DecodeLimits limits(const FragmentLayout* layout = nullptr) {
  return DecodeLimits{.run_id = "r1", .fingerprint = 0xfeed, .layout = layout};
}

}  // namespace

TEST_CASE("a RoundOpen notice survives the codec field for field", "[codec]") {
  const RoundOpen in = notice();
  const RoundOpen out = decode_round_open(encode_round_open(in), limits());
  CHECK(out.run_id == "r1");
  CHECK(out.fingerprint == 0xfeed);
  CHECK(out.fragment == 2);
  CHECK(out.version == 17);
  CHECK(out.pending == 1);
  CHECK(out.grace_ms == 250);
  CHECK(out.merger_instance == "merger-0");
  CHECK(out.epoch == 9);
  CHECK(out.time_us == 123456);
}

TEST_CASE("a RoundOpen notice of another run, model or fragment is rejected with its reason", "[codec]") {
  const auto bytes = encode_round_open(notice());
  DecodeLimits other_run = limits();
  other_run.run_id = "r2";
  CHECK_THROWS_MATCHES(decode_round_open(bytes, other_run), Rejection,
                       Catch::Predicate<Rejection>([](const Rejection& e) { return e.reason == RejectReason::WrongRunId; }));
  DecodeLimits other_model = limits();
  other_model.fingerprint = 1;
  CHECK_THROWS_MATCHES(decode_round_open(bytes, other_model), Rejection,
                       Catch::Predicate<Rejection>([](const Rejection& e) { return e.reason == RejectReason::WrongFingerprint; }));
  FragmentLayout two;  // fragments 0 and 1 only
  two.fragments.resize(2);
  two.fingerprint = 0xfeed;
  CHECK_THROWS_MATCHES(decode_round_open(bytes, limits(&two)), Rejection,
                       Catch::Predicate<Rejection>([](const Rejection& e) { return e.reason == RejectReason::FragmentOutOfRange; }));
  std::vector<uint8_t> garbage(bytes.begin(), bytes.begin() + bytes.size() / 2);
  CHECK_THROWS_AS(decode_round_open(garbage, limits()), Rejection);
}

TEST_CASE("RoundOpen notices and FragmentParams share a socket and stay apart", "[zmq]") {
  zmq::context_t context;
  ParamsPublisher pub(context, "tcp://127.0.0.1:*");
  ParamsSubscriber sub(context);
  sub.connect(pub.bound_endpoint());
  zmq::socket_t raw(context, zmq::socket_type::pub);
  raw.bind("tcp://127.0.0.1:*");
  sub.connect(raw.get(zmq::sockopt::last_endpoint));
  const std::vector<uint8_t> params{1, 2}, open{3};
  bool saw_params = false, saw_open = false;
  for (int attempt = 0; attempt < 200 && !(saw_params && saw_open); ++attempt) {
    pub.publish(4, params);
    pub.publish_round_open(6, open);
    // Malformed notice topics are skipped like any malformed framing.
    (void)raw.send(zmq::str_buffer("open."), zmq::send_flags::sndmore);
    (void)raw.send(zmq::str_buffer("x"), zmq::send_flags::none);
    (void)raw.send(zmq::str_buffer("open.6x"), zmq::send_flags::sndmore);
    (void)raw.send(zmq::str_buffer("x"), zmq::send_flags::none);
    for (int i = 0; i < 4; ++i) {
      auto r = sub.receive(20ms);
      if (!r) continue;
      if (r->round_open) {
        CHECK(r->fragment == 6);
        CHECK(r->message == open);
        saw_open = true;
      } else {
        CHECK(r->fragment == 4);
        CHECK(r->message == params);
        saw_params = true;
      }
    }
  }
  CHECK(saw_params);
  CHECK(saw_open);
}
