// The merger's snapshot rules (merger/snapshot_requests.h) on a hand-driven clock: one encoding
// per fragment and turn, at most one answer per interval, no second copy of a version while the
// first is queued or recent (unless the subscriber reconnected), deferral at the queue bound,
// unowned fragments forgotten, and a bound on pending requests.
#include <catch2/catch.hpp>

#include "merger/snapshot_requests.h"

using namespace diloco;
using namespace std::chrono_literals;

namespace {

// The rules' timing as the merger's defaults set it (MergerTimeouts); the bounds per test.
SnapshotRequestOptions options(uint64_t queue_bytes = 1ull << 30, size_t max_pending = 1 << 16) {
  return {.interval = 250ms, .resend = 5000ms, .queue_bytes = queue_bytes, .max_pending = max_pending};
}

struct Harness {
  explicit Harness(SnapshotRequestOptions o = options()) : requests(o) {}
  SnapshotRequests requests;
  SnapshotRequests::Clock::time_point now{};
  std::map<uint32_t, uint64_t> versions{{0, 1}, {1, 1}, {2, 1}};
  uint64_t queued = 0;
  std::map<uint32_t, int> encoded;                     // encodings per fragment
  std::vector<std::pair<std::string, uint32_t>> sent;  // in order
  std::vector<SnapshotRequests::Message> in_flight;    // what the "publisher" still holds

  SnapshotRequests::Turn turn() {
    return requests.serve(
        now, versions, [&] { return queued; },
        [&](uint32_t p) {
          ++encoded[p];
          return std::make_shared<const MessageParts>(1, std::vector<uint8_t>(100 + p, static_cast<uint8_t>(p)));
        },
        [&](const std::string& id, uint32_t p, const SnapshotRequests::Message& m) {
          sent.emplace_back(id, p);
          in_flight.push_back(m);
        });
  }
};

}  // namespace

TEST_CASE("subscribers asking for one fragment in one turn share one encoding", "[merger][snapshots]") {
  Harness h;
  CHECK(h.requests.want("a", 1, true));
  CHECK(h.requests.want("b", 1, true));
  CHECK(h.requests.want("b", 2, true));
  auto t = h.turn();
  CHECK(t.sent == 3);
  CHECK(t.bytes == 101 + 101 + 102);
  CHECK(h.encoded == std::map<uint32_t, int>{{1, 1}, {2, 1}});
  CHECK(h.sent == std::vector<std::pair<std::string, uint32_t>>{{"a", 1}, {"b", 1}, {"b", 2}});
  CHECK(h.requests.pending() == 0);
  CHECK(h.in_flight[0] == h.in_flight[1]);  // the same message, not a copy
}

TEST_CASE("the same version is not sent twice while queued or recent, unless the subscriber reconnected", "[merger][snapshots]") {
  Harness h;
  h.requests.want("a", 0, true);
  REQUIRE(h.turn().sent == 1);

  // Still in the publisher's queue, and long after: the ask is coalesced, not answered.
  h.now += 10s;
  h.requests.want("a", 0, true);
  auto t = h.turn();
  CHECK(t.sent == 0);
  CHECK(t.coalesced == 1);
  CHECK(h.requests.pending() == 0);

  // Out of the queue but within `resend` of being sent: still coalesced. Measured from the send
  // at time 0, so 4 s later is within the 5 s.
  h.in_flight.clear();
  h.now = SnapshotRequests::Clock::time_point{} + 4s;
  h.requests.want("a", 0, true);
  CHECK(h.turn().coalesced == 1);

  // After `resend` it was lost (a full queue): it goes again.
  h.now = SnapshotRequests::Clock::time_point{} + 5s;
  h.requests.want("a", 0, true);
  CHECK(h.turn().sent == 1);
  CHECK(h.sent.size() == 2);

  // A reconnect forgets what was sent: the next ask is answered at once, queued or not.
  h.requests.joined("a");
  h.requests.want("a", 0, true);
  CHECK(h.turn().sent == 1);
  CHECK(h.sent.size() == 3);
}

TEST_CASE("a new version is sent after the interval, asks inside it wait", "[merger][snapshots]") {
  Harness h;
  h.requests.want("a", 0, true);
  REQUIRE(h.turn().sent == 1);
  h.versions[0] = 2;  // a merge happened
  h.now += 100ms;     // inside the 250 ms interval
  h.requests.want("a", 0, true);
  auto t = h.turn();
  CHECK(t.sent == 0);
  CHECK(t.coalesced == 0);
  CHECK(h.requests.pending() == 1);  // still asked for
  h.now += 150ms;
  CHECK(h.turn().sent == 1);
  CHECK(h.encoded[0] == 2);
  CHECK(h.requests.pending() == 0);
}

TEST_CASE("snapshots wait while the publisher's queue is at its bound", "[merger][snapshots]") {
  Harness h(options(1000));
  h.requests.want("a", 0, true);
  h.requests.want("b", 0, true);
  h.requests.want("a", 2, true);
  h.queued = 1000;
  auto t = h.turn();
  CHECK(t.sent == 0);
  CHECK(t.deferred == 3);
  CHECK(h.encoded.empty());
  CHECK(h.requests.pending() == 3);
  h.queued = 999;
  t = h.turn();
  CHECK(t.sent == 3);
  CHECK(t.deferred == 0);
  CHECK(h.requests.pending() == 0);
}

TEST_CASE("requests for fragments not owned are forgotten, and pending requests are bounded", "[merger][snapshots]") {
  Harness h(options(1ull << 30, 2));
  CHECK(h.requests.want("a", 7, false));  // not owned: not kept
  CHECK(h.requests.pending() == 0);
  CHECK(h.requests.want("a", 0, true));
  CHECK(h.requests.want("b", 0, true));
  CHECK_FALSE(h.requests.want("c", 0, true));  // a flood of ids is dropped at the bound
  CHECK(h.requests.want("c", 7, false));       // at the bound, an unowned ask is ignored, not a drop
  CHECK(h.requests.want("a", 0, true));        // asking again for a kept request is no new entry
  CHECK(h.requests.pending() == 2);
  // Ownership moved away before the turn: nothing is sent and nothing stays pending.
  h.versions.erase(0);
  auto t = h.turn();
  CHECK(t.sent == 0);
  CHECK(h.requests.pending() == 0);
}

TEST_CASE("on a link that takes one snapshot per turn, a fragment asked for again and again starves no other",
          "[merger][snapshots]") {
  Harness h(options(1000));
  h.requests.want("a", 0, true);
  h.requests.want("a", 1, true);
  h.requests.want("a", 2, true);
  std::set<uint32_t> served;
  for (int turn = 0; turn < 3; ++turn) {
    // Fragment 0 merges every turn and is asked for again; the queue takes one snapshot a turn.
    h.versions[0] += 1;
    h.requests.want("a", 0, true);
    h.queued = 0;
    const size_t before = h.sent.size();
    h.requests.serve(
        h.now, h.versions, [&] { return h.queued; },
        [&](uint32_t p) {
          return std::make_shared<const MessageParts>(1, std::vector<uint8_t>(1000, static_cast<uint8_t>(p)));
        },
        [&](const std::string& id, uint32_t p, const SnapshotRequests::Message& m) {
          h.sent.emplace_back(id, p);
          h.queued += m->front().size();  // at the bound now: the rest of the turn waits
        });
    REQUIRE(h.sent.size() == before + 1);
    served.insert(h.sent.back().second);
    h.now += 300ms;  // past the interval
  }
  CHECK(served == std::set<uint32_t>{0, 1, 2});  // lowest first served fragment 0 three times
  CHECK(h.requests.pending() == 1);              // fragment 0's newest ask
}
