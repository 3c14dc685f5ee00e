// The ZeroMQ parameter channel over loopback TCP: a subscriber connected to two publishers gets
// both; malformed framing is skipped; an endpoint already in use is a clear error; a publisher
// sees a subscriber that connects and one that asks for a fragment; bytes received are counted;
// shared snapshots travel without a copy and are counted as queued until sent.
#include <catch2/catch.hpp>

#include <functional>
#include <set>
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

TEST_CASE("a subscriber of some fragments receives their versions and notices alone", "[zmq]") {
  zmq::context_t context;
  ParamsPublisher pub(context, "tcp://127.0.0.1:*");
  ParamsSubscriber sub(context, 256, "some", nullptr, {1, 3});
  sub.connect(pub.bound_endpoint());
  // Fragment 1 arrives once the subscription is through; 10 and 12 begin with "1", 2 is not wanted.
  auto first = publish_until_received(pub, sub, 1, {1});
  REQUIRE(first);
  CHECK(first->fragment == 1);
  const std::vector<uint8_t> message = {7};
  for (uint32_t p : {10u, 12u, 2u, 3u}) pub.publish(p, message);
  pub.publish_round_open(2, message);
  pub.publish_round_open(3, message);
  std::vector<std::pair<uint32_t, bool>> got;
  for (int i = 0; i < 20; ++i)
    if (auto r = sub.receive(50ms)) got.emplace_back(r->fragment, r->round_open);
  // Fragment 1 may come again (published until it arrived); nothing of 2, 10 or 12.
  std::erase(got, std::pair<uint32_t, bool>{1, false});
  CHECK(got == std::vector<std::pair<uint32_t, bool>>{{3, false}, {3, true}});
  CHECK(sub.bytes_received() > 0);
}

TEST_CASE("a subscriber counts the payload bytes of every message it received", "[zmq]") {
  zmq::context_t context;
  ParamsPublisher pub(context, "tcp://127.0.0.1:*");
  ParamsSubscriber sub(context);
  sub.connect(pub.bound_endpoint());
  CHECK(sub.bytes_received() == 0);
  const std::vector<uint8_t> message(1000, 7), notice{1, 2};
  REQUIRE(publish_until_received(pub, sub, 12, message));
  // FragmentParams: the topic "v.12" and 1000 bytes; a RoundOpen notice: "open.3" and 2 bytes.
  uint64_t expected = 4 + 1000;
  int notices = 0;
  for (int i = 0; i < 5; ++i) {
    pub.publish(12, message);
    pub.publish_round_open(3, notice);
  }
  for (int i = 0; i < 50; ++i) {
    if (auto r = sub.receive(20ms)) {
      expected += r->round_open ? 6 + 2 : 4 + 1000;
      notices += r->round_open;
    }
  }
  CHECK(notices == 5);
  CHECK(sub.bytes_received() == expected);
}

namespace {

// The requests a publisher has seen within about two seconds, merged.
ParamsPublisher::Requests requests_within(ParamsPublisher& pub, const std::function<bool(const ParamsPublisher::Requests&)>& done) {
  ParamsPublisher::Requests all;
  for (int i = 0; i < 100 && !done(all); ++i) {
    auto r = pub.take_requests();
    all.joined.insert(r.joined.begin(), r.joined.end());
    for (const auto& [id, fragments] : r.fragments) all.fragments[id].insert(fragments.begin(), fragments.end());
    all.count += r.count;
    std::this_thread::sleep_for(20ms);
  }
  return all;
}

}  // namespace

TEST_CASE("a publisher sees a subscriber connect and ask for one fragment, and answers it alone", "[zmq]") {
  zmq::context_t context;
  ParamsPublisher pub(context, "tcp://127.0.0.1:*");
  CHECK(pub.take_requests().count == 0);
  ParamsSubscriber sub(context, 256, "learner-a");
  ParamsSubscriber other(context);
  CHECK(other.id().size() == 16);  // a random id
  CHECK(other.id() != ParamsSubscriber(context).id());
  CHECK_THROWS_AS(ParamsSubscriber(context, 256, "a.b"), InvalidInput);
  sub.connect(pub.bound_endpoint());
  other.connect(pub.bound_endpoint());
  auto joined = requests_within(pub, [](const auto& r) { return r.joined.size() == 2; });
  CHECK(joined.joined == std::set<std::string>{"learner-a", other.id()});
  CHECK(joined.fragments.empty());

  sub.request(3);
  sub.request(11);
  auto asked = requests_within(pub, [](const auto& r) { return r.fragments.count("learner-a") && r.fragments.at("learner-a").size() == 2; });
  CHECK(asked.joined.empty());
  CHECK(asked.fragments.size() == 1);
  CHECK(asked.fragments["learner-a"] == std::set<uint32_t>{3, 11});

  // Asking again is seen again (a request is not a subscription that is already there).
  sub.request(3);
  CHECK(requests_within(pub, [](const auto& r) { return r.fragments.count("learner-a") > 0; }).fragments.count("learner-a"));

  // The answer reaches the subscriber that asked, and only it; a version reaches both.
  std::optional<ParamsSubscriber::Received> got;
  for (int i = 0; i < 100 && !got; ++i) {
    pub.publish_to("learner-a", 3, std::vector<uint8_t>{4, 2});
    got = sub.receive(20ms);
  }
  REQUIRE(got);
  CHECK(got->fragment == 3);
  CHECK(got->snapshot_for_me);
  CHECK(got->message == std::vector<uint8_t>{4, 2});
  std::optional<ParamsSubscriber::Received> broadcast;
  for (int i = 0; i < 100 && !broadcast; ++i) {
    pub.publish(5, std::vector<uint8_t>{1});
    broadcast = other.receive(20ms);
  }
  REQUIRE(broadcast);
  CHECK(broadcast->fragment == 5);  // the snapshots for learner-a were filtered out at the publisher
  CHECK_FALSE(broadcast->snapshot_for_me);

  // Subscriptions that are not requests are read and ignored.
  zmq::socket_t raw(context, zmq::socket_type::sub);
  raw.connect(pub.bound_endpoint());
  raw.set(zmq::sockopt::subscribe, "want.x");
  raw.set(zmq::sockopt::subscribe, "want.3");
  raw.set(zmq::sockopt::subscribe, "want.3.bad id");
  raw.set(zmq::sockopt::subscribe, "s.");
  raw.set(zmq::sockopt::subscribe, "7");
  auto odd = requests_within(pub, [](const auto& r) { return r.count >= 5; });
  CHECK(odd.count >= 5);
  CHECK(odd.fragments.empty());
  CHECK(odd.joined.empty());
}

TEST_CASE("a shared snapshot is sent without a copy and counted as queued until it is out", "[zmq]") {
  zmq::context_t context;
  ParamsPublisher pub(context, "tcp://127.0.0.1:*");
  // Its receive queue holds one message, so once that is full its I/O thread stops reading the
  // socket, as a subscriber behind a slow link would.
  ParamsSubscriber sub(context, 1, "slow");
  sub.connect(pub.bound_endpoint());
  REQUIRE(requests_within(pub, [](const auto& r) { return r.joined.count("slow") > 0; }).joined.count("slow"));

  // Nobody subscribed to this id: the publisher drops the message at once and lets go of it.
  auto unseen = std::make_shared<const MessageParts>(2, std::vector<uint8_t>(1000, 1));
  pub.publish_to("nobody", 0, unseen);
  CHECK(unseen.use_count() == 1);
  CHECK(pub.queued_bytes() == 0);

  // Three 32 MiB snapshots to a subscriber that does not read: one fills its queue, loopback's
  // socket buffers take a few MiB, the rest stays in the publisher's queue, held by reference
  // (the same bytes, not a copy).
  constexpr size_t kSize = 32u << 20;
  std::vector<std::shared_ptr<const MessageParts>> snapshots;
  for (uint8_t fill : {uint8_t{5}, uint8_t{6}, uint8_t{7}}) {
    snapshots.push_back(std::make_shared<const MessageParts>(1, std::vector<uint8_t>(kSize, fill)));
    pub.publish_to("slow", fill, snapshots.back());
  }
  // The first message leaves the queue once its send completes: wait for that, not a fixed time.
  for (int i = 0; i < 500 && pub.queued_bytes() > 2 * kSize; ++i) std::this_thread::sleep_for(10ms);
  CHECK(pub.queued_bytes() > kSize);
  CHECK(pub.queued_bytes() <= 2 * kSize);
  CHECK(snapshots.front().use_count() == 1);  // out of the publisher
  CHECK(snapshots.back().use_count() == 2);   // ours and the queued message's

  // Once the subscriber has read them all, nothing is queued and ZeroMQ holds no reference.
  for (uint8_t fill : {uint8_t{5}, uint8_t{6}, uint8_t{7}}) {
    auto got = sub.receive(5000ms);
    REQUIRE(got);
    CHECK(got->snapshot_for_me);
    CHECK(got->fragment == fill);
    CHECK(got->message.size() == kSize);
    CHECK(got->message.front() == fill);
    CHECK(got->message.back() == fill);
  }
  for (int i = 0; i < 100 && pub.queued_bytes() > 0; ++i) std::this_thread::sleep_for(10ms);
  CHECK(pub.queued_bytes() == 0);
  for (const auto& s : snapshots) CHECK(s.use_count() == 1);
}

TEST_CASE("a message in parts goes out as one ZeroMQ message per part, in order, held until the last is sent",
          "[zmq]") {
  zmq::context_t context;
  ParamsPublisher pub(context, "tcp://127.0.0.1:*");
  ParamsSubscriber sub(context, 1, "slow");
  sub.connect(pub.bound_endpoint());
  REQUIRE(requests_within(pub, [](const auto& r) { return r.joined.count("slow") > 0; }).joined.count("slow"));
  // Three parts of 16 MiB to a subscriber that does not read yet: the last ones wait in the queue,
  // which holds the parts (not copies) and counts their bytes until each is sent.
  constexpr size_t kSize = 16u << 20;
  auto parts = std::make_shared<MessageParts>();
  for (uint8_t fill : {uint8_t{1}, uint8_t{2}, uint8_t{3}}) parts->emplace_back(kSize, fill);
  const std::shared_ptr<const MessageParts> shared = std::move(parts);
  pub.publish_to("slow", 4, shared);
  CHECK(pub.queued_bytes() > 0);
  CHECK(pub.queued_bytes() <= 3 * kSize);
  CHECK(shared.use_count() > 1);
  for (uint8_t fill : {uint8_t{1}, uint8_t{2}, uint8_t{3}}) {
    auto got = sub.receive(5000ms);
    REQUIRE(got);
    CHECK(got->snapshot_for_me);
    CHECK(got->fragment == 4);
    CHECK(got->message.size() == kSize);
    CHECK(got->message.front() == fill);
    CHECK(got->message.back() == fill);
  }
  for (int i = 0; i < 100 && (pub.queued_bytes() > 0 || shared.use_count() > 1); ++i)
    std::this_thread::sleep_for(10ms);
  CHECK(pub.queued_bytes() == 0);
  CHECK(shared.use_count() == 1);
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
    (void)raw.send(zmq::str_buffer("v.not-a-number"), zmq::send_flags::sndmore);
    (void)raw.send(zmq::str_buffer("payload"), zmq::send_flags::none);
    (void)raw.send(zmq::str_buffer("v.single frame"), zmq::send_flags::none);
    (void)raw.send(zmq::str_buffer("v.12x"), zmq::send_flags::sndmore);
    (void)raw.send(zmq::str_buffer("payload"), zmq::send_flags::none);
    (void)raw.send(zmq::str_buffer("v.5"), zmq::send_flags::sndmore);
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
