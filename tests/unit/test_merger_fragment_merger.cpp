// The per-fragment state machine: pending-set rules, quorum, grace window, every transition and
// every call made in the wrong state.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "core/errors.h"
#include "merger/fragment_merger.h"
#include "merger/recovery.h"
#include "merger/weighting.h"

using namespace diloco;

namespace {

const std::string kTopic = "diloco.r.deltas.eu";

DeltaRef ref(const std::string& learner, uint64_t seq, uint64_t base, int64_t offset,
             const std::string& topic = kTopic, int32_t partition = 0) {
  DeltaRef r;
  r.position = {topic, partition, offset};
  r.learner_id = learner;
  r.seq = seq;
  r.base_version = base;
  r.inner_steps = 10;
  r.tokens = 100;
  return r;
}

std::vector<DenseTensor> tensors(float v) { return {{0, {2}, {v, -v}}}; }

OuterHyper hyper(uint32_t quorum, uint32_t max_staleness = kUnlimitedStaleness,
                 float alpha = 0.0f) {
  OuterHyper h;
  h.quorum = quorum;
  h.max_staleness = max_staleness;
  h.staleness_alpha = alpha;
  return h;
}

const std::vector<std::string> kNobody;

// A window that gives no grace: merges happen at quorum.
const GraceWindow kNoGrace;

// A window with step time 1 s: grace = 0.5 * (2 - quorum_time - 0), capped at 1 s.
GraceWindow one_second_steps() {
  GraceWindow window;
  window.observe_step_time(1.0);
  return window;
}

// Runs one whole merge of what is pending and returns the plan.
MergePlan merge_all(FragmentMerger& m, double now) {
  REQUIRE(m.poll(now, kNobody, kNoGrace));
  MergePlan plan = m.take_merge_inputs(now);
  m.merge_committed(m.version() + 1);
  m.published(now);
  return plan;
}

}  // namespace

TEST_CASE("a merger starts collecting at its version", "[merger]") {
  FragmentMerger m(4, 17, hyper(1), 0.0);
  CHECK(m.state() == MergerState::Collecting);
  CHECK(m.fragment() == 4);
  CHECK(m.version() == 17);
  CHECK(m.pending_learners() == 0);
  CHECK_FALSE(m.grace_deadline());
  CHECK_FALSE(m.poll(100.0, kNobody, kNoGrace));
  CHECK(m.state() == MergerState::Collecting);
  CHECK_THROWS_AS(FragmentMerger(0, 0, hyper(0), 0.0), InvalidInput);
}

TEST_CASE("state names", "[merger]") {
  CHECK(std::string(merger_state_name(MergerState::Collecting)) == "COLLECTING");
  CHECK(std::string(merger_state_name(MergerState::Grace)) == "GRACE");
  CHECK(std::string(merger_state_name(MergerState::Merging)) == "MERGING");
  CHECK(std::string(merger_state_name(MergerState::Publish)) == "PUBLISH");
  CHECK(std::string(merger_state_name(MergerState::Stopped)) == "STOPPED");
}

TEST_CASE("delta_ref copies the routing fields of a header", "[merger]") {
  DeltaHeader h;
  h.learner_id = "l7";
  h.seq = 4;
  h.base_version = 9;
  h.inner_steps = 12;
  h.tokens = 3456;
  const DeltaRef r = delta_ref(h, {"t", 2, 99});
  CHECK(r.position == LogPosition{"t", 2, 99});
  CHECK(r.learner_id == "l7");
  CHECK(r.seq == 4);
  CHECK(r.base_version == 9);
  CHECK(r.inner_steps == 12);
  CHECK(r.tokens == 3456);
  CHECK(r.staleness == 0);
  CHECK(r.weight == 0);
}

TEST_CASE("the quorum counts distinct learners", "[merger]") {
  FragmentMerger m(0, 5, hyper(2), 0.0);
  CHECK_FALSE(m.offer(ref("a", 1, 5, 10), tensors(1), 0.1));
  CHECK_FALSE(m.poll(0.2, kNobody, kNoGrace));
  CHECK(m.offer(ref("a", 2, 5, 11), tensors(1), 0.3));  // replaces a's first: still one learner
  CHECK(m.pending_learners() == 1);
  CHECK_FALSE(m.poll(0.4, kNobody, kNoGrace));
  CHECK(m.state() == MergerState::Collecting);
  CHECK_FALSE(m.offer(ref("b", 1, 5, 12), tensors(1), 0.5));
  CHECK(m.pending_learners() == 2);
  // No step time known: no grace, straight to MERGING.
  CHECK(m.poll(0.6, kNobody, kNoGrace));
  CHECK(m.state() == MergerState::Merging);
}

TEST_CASE("the grace window runs from the quorum, sized by the time the quorum took",
          "[merger]") {
  const GraceWindow window = one_second_steps();
  FragmentMerger m(0, 5, hyper(2), 0.0);  // born long before the round: that time is not counted
  CHECK_FALSE(m.poll(10.5, kNobody, window));
  m.offer(ref("a", 1, 5, 1), tensors(1), 10.6);  // the round starts with its first delta
  CHECK_FALSE(m.poll(10.7, kNobody, window));
  CHECK(m.state() == MergerState::Collecting);
  REQUIRE(m.round_first_delta());
  CHECK(*m.round_first_delta() == Approx(10.6));
  m.offer(ref("b", 1, 5, 2), tensors(1), 11.0);  // quorum after 0.4 s: grace 0.5 * 1.6 = 0.8
  CHECK_FALSE(m.poll(11.0, kNobody, window));
  CHECK(m.state() == MergerState::Grace);
  REQUIRE(m.grace_deadline());
  CHECK(*m.grace_deadline() == Approx(11.8));
  CHECK(*m.quorum_reached() == Approx(11.0));
  CHECK_FALSE(m.poll(11.79, kNobody, window));
  m.offer(ref("c", 1, 5, 3), tensors(1), 11.5);  // late joiners are welcome during the grace
  CHECK(m.pending_learners() == 3);
  CHECK(m.poll(11.8, kNobody, window));
  CHECK(m.state() == MergerState::Merging);
  CHECK_FALSE(m.grace_deadline());
  CHECK(m.take_merge_inputs(11.8).inputs.size() == 3);
}

TEST_CASE("with quorum 1 the quorum time is 0: the whole slack is grace", "[merger]") {
  const GraceWindow window = one_second_steps();  // slack tau * step_time = 2 s, capped at 1 s
  FragmentMerger m(0, 5, hyper(1), 0.0);
  m.offer(ref("a", 1, 5, 1), tensors(1), 30.0);  // 30 s after the merger started
  CHECK_FALSE(m.poll(30.0, kNobody, window));
  REQUIRE(m.grace_deadline());
  CHECK(*m.grace_deadline() == Approx(31.0));
  CHECK(m.granted_grace() == Approx(1.0));
}

TEST_CASE("deltas that arrive during a merge open the next round at publication", "[merger]") {
  const GraceWindow window = one_second_steps();
  FragmentMerger m(0, 5, hyper(1), 0.0);
  m.offer(ref("a", 1, 5, 1), tensors(1), 1.0);
  REQUIRE(m.poll(2.0, kNobody, window));
  m.take_merge_inputs(2.0);
  m.offer(ref("b", 1, 5, 2), tensors(1), 2.1);  // during the merge: waits for the next round
  m.merge_committed(6);
  m.published(2.3);
  REQUIRE(m.round_first_delta());
  CHECK(*m.round_first_delta() == Approx(2.3));
  CHECK(*m.quorum_reached() == Approx(2.3));
  CHECK_FALSE(m.poll(2.3, kNobody, window));
  CHECK(*m.grace_deadline() == Approx(3.3));
}

TEST_CASE("the grace is fixed when it starts", "[merger]") {
  GraceWindow window = one_second_steps();
  FragmentMerger m(0, 5, hyper(1), 0.0);
  m.offer(ref("a", 1, 5, 1), tensors(1), 0.0);
  CHECK_FALSE(m.poll(0.0, kNobody, window));
  CHECK(*m.grace_deadline() == Approx(1.0));  // capped at one step time
  window.observe_sync_time(100.0);            // would leave no slack if it counted now
  CHECK_FALSE(m.poll(0.5, kNobody, window));
  CHECK(*m.grace_deadline() == Approx(1.0));
  CHECK(m.poll(1.0, kNobody, window));
}

TEST_CASE("a quorum that took too long leaves no grace", "[merger]") {
  const GraceWindow window = one_second_steps();
  FragmentMerger m(0, 5, hyper(2), 0.0);
  m.offer(ref("a", 1, 5, 1), tensors(1), 1.0);
  CHECK_FALSE(m.poll(2.0, kNobody, window));
  m.offer(ref("b", 1, 5, 2), tensors(1), 3.0);  // 2 s for the quorum: no slack left
  CHECK(m.poll(3.0, kNobody, window));
}

TEST_CASE("the grace ends early once every live learner has a delta pending", "[merger]") {
  const GraceWindow window = one_second_steps();
  FragmentMerger m(0, 5, hyper(1), 0.0);
  m.offer(ref("a", 1, 5, 1), tensors(1), 0.0);
  const std::vector<std::string> ab{"a", "b"}, abc{"a", "b", "c"};
  CHECK_FALSE(m.poll(0.1, ab, window));  // b is live and has not reported
  m.offer(ref("b", 1, 5, 2), tensors(1), 0.2);
  CHECK_FALSE(m.poll(0.3, abc, window));  // nor has c
  CHECK_FALSE(m.poll(0.3, kNobody, window));  // an unknown membership never ends it early
  CHECK(m.state() == MergerState::Grace);
  CHECK(m.poll(0.3, ab, window));
  CHECK(m.state() == MergerState::Merging);
}

TEST_CASE("the merge plan: inputs sorted by Kafka position, weighted, with the drops",
          "[merger]") {
  FragmentMerger m(0, 10, hyper(3, 4, 1.0f), 0.0);
  m.offer(ref("c", 1, 9, 5, "diloco.r.deltas.us", 1), tensors(3), 0.1);
  m.offer(ref("a", 1, 10, 7, "diloco.r.deltas.eu", 1), tensors(1), 0.2);
  m.offer(ref("b", 1, 8, 3, "diloco.r.deltas.eu", 1), tensors(2), 0.3);
  m.offer(ref("d", 1, 5, 1, "diloco.r.deltas.eu", 0), tensors(4), 0.4);  // too stale
  m.offer(ref("e", 1, 11, 2, "diloco.r.deltas.eu", 0), tensors(5), 0.5);  // from the future
  REQUIRE(m.poll(0.6, kNobody, kNoGrace));
  const MergePlan plan = m.take_merge_inputs(0.6);
  CHECK(plan.version == 10);
  REQUIRE(plan.inputs.size() == 3);
  CHECK(plan.inputs[0].ref.learner_id == "b");  // eu/1/3
  CHECK(plan.inputs[1].ref.learner_id == "a");  // eu/1/7
  CHECK(plan.inputs[2].ref.learner_id == "c");  // us/1/5
  CHECK(plan.inputs[0].ref.staleness == 2);
  CHECK(plan.inputs[0].ref.weight == Approx(1000.0 / 3));
  CHECK(plan.inputs[1].ref.staleness == 0);
  CHECK(plan.inputs[1].ref.weight == 1000.0);
  CHECK(plan.inputs[2].ref.staleness == 1);
  CHECK(plan.inputs[2].ref.weight == 500.0);
  CHECK(plan.tensors[2].dense[0].values == std::vector<float>{3, -3});
  REQUIRE(plan.dropped.size() == 2);
  CHECK(plan.dropped[0].delta.learner_id == "d");
  CHECK(plan.dropped[0].reason == DropReason::TooStale);
  CHECK(plan.dropped[0].delta.staleness == 5);
  CHECK(plan.dropped[1].delta.learner_id == "e");
  CHECK(plan.dropped[1].reason == DropReason::Invalid);
  CHECK(plan.dropped[1].detail.find("base from the future") != std::string::npos);
  CHECK(m.pending_learners() == 0);
}

TEST_CASE("a full round: MERGING -> PUBLISH -> COLLECTING at the next version", "[merger]") {
  FragmentMerger m(0, 5, hyper(1), 0.0);
  m.offer(ref("a", 1, 5, 1), tensors(1), 1.0);
  REQUIRE(m.poll(1.0, kNobody, kNoGrace));
  CHECK(m.take_merge_inputs(1.5).inputs.size() == 1);
  CHECK(m.state() == MergerState::Merging);
  CHECK_FALSE(m.poll(1.6, kNobody, kNoGrace));  // inputs already taken
  CHECK(m.merge_committed(6).empty());
  CHECK(m.state() == MergerState::Publish);
  CHECK(m.version() == 6);
  CHECK_FALSE(m.poll(1.7, kNobody, kNoGrace));
  CHECK(m.published(1.75) == Approx(0.25));  // from taking the inputs to publishing
  CHECK(m.state() == MergerState::Collecting);
  CHECK_FALSE(m.poll(2.0, kNobody, kNoGrace));
  CHECK_FALSE(m.round_first_delta());
  // The next round starts with its first delta, not at publication.
  const GraceWindow window = one_second_steps();
  m.offer(ref("b", 1, 6, 2), tensors(1), 2.25);
  CHECK(*m.round_first_delta() == Approx(2.25));
  CHECK_FALSE(m.poll(2.25, kNobody, window));
  CHECK(*m.grace_deadline() == Approx(3.25));
}

TEST_CASE("calls in the wrong state throw InternalError", "[merger]") {
  FragmentMerger m(0, 5, hyper(2), 0.0);
  // COLLECTING
  CHECK_THROWS_AS(m.take_merge_inputs(0.0), InternalError);
  CHECK_THROWS_AS(m.merge_committed(6), InternalError);
  CHECK_THROWS_AS(m.published(0.0), InternalError);
  // GRACE
  const GraceWindow window = one_second_steps();
  m.offer(ref("a", 1, 5, 1), tensors(1), 0.0);
  m.offer(ref("b", 1, 5, 2), tensors(1), 0.0);
  CHECK_FALSE(m.poll(0.0, kNobody, window));
  REQUIRE(m.state() == MergerState::Grace);
  CHECK_THROWS_AS(m.take_merge_inputs(0.0), InternalError);
  CHECK_THROWS_AS(m.merge_committed(6), InternalError);
  CHECK_THROWS_AS(m.published(0.0), InternalError);
  // MERGING, before and after taking the inputs
  REQUIRE(m.poll(1.0, kNobody, window));
  CHECK_THROWS_AS(m.merge_committed(6), InternalError);
  CHECK_THROWS_AS(m.published(1.0), InternalError);
  m.take_merge_inputs(1.0);
  CHECK_THROWS_AS(m.take_merge_inputs(1.0), InternalError);
  CHECK_THROWS_AS(m.published(1.0), InternalError);
  CHECK_THROWS_AS(m.merge_committed(5), InternalError);
  CHECK_THROWS_AS(m.merge_committed(7), InternalError);
  CHECK(m.state() == MergerState::Merging);
  // PUBLISH
  m.merge_committed(6);
  CHECK_THROWS_AS(m.take_merge_inputs(1.0), InternalError);
  CHECK_THROWS_AS(m.merge_committed(7), InternalError);
  // STOPPED
  m.stop();
  CHECK(m.state() == MergerState::Stopped);
  CHECK_THROWS_AS(m.offer(ref("a", 2, 6, 3), tensors(1), 2.0), InternalError);
  CHECK_THROWS_AS(m.poll(2.0, kNobody, window), InternalError);
  CHECK_THROWS_AS(m.take_merge_inputs(2.0), InternalError);
  CHECK_THROWS_AS(m.merge_committed(7), InternalError);
  CHECK_THROWS_AS(m.published(2.0), InternalError);
  CHECK_THROWS_AS(m.stop(), InternalError);
}

TEST_CASE("a newer delta of a learner supersedes its pending one", "[merger]") {
  FragmentMerger m(0, 5, hyper(1), 0.0);
  CHECK_FALSE(m.offer(ref("a", 3, 5, 1), tensors(1), 0.0));
  const auto dropped = m.offer(ref("a", 4, 5, 2), tensors(2), 0.1);
  REQUIRE(dropped);
  CHECK(dropped->reason == DropReason::Superseded);
  CHECK(dropped->delta.seq == 3);
  CHECK(dropped->delta.position.offset == 1);
  CHECK(dropped->detail.find("replaced by seq 4") != std::string::npos);
  CHECK(m.pending_learners() == 1);

  // Older or equal sequence numbers are superseded by the pending one.
  for (uint64_t seq : {2u, 4u}) {
    const auto late = m.offer(ref("a", seq, 5, 3 + seq), tensors(9), 0.2);
    REQUIRE(late);
    CHECK(late->reason == DropReason::Superseded);
    CHECK(late->delta.seq == seq);
  }
  const MergePlan plan = merge_all(m, 1.0);
  REQUIRE(plan.inputs.size() == 1);
  CHECK(plan.inputs[0].ref.seq == 4);
  CHECK(plan.tensors[0].dense[0].values == std::vector<float>{2, -2});
  REQUIRE(plan.dropped.size() == 3);
  CHECK(plan.dropped[0].delta.seq == 3);
  CHECK(plan.dropped[1].delta.seq == 2);
  CHECK(plan.dropped[2].delta.seq == 4);
}

TEST_CASE("a newer delta on a newer base replaces the pending one too", "[merger]") {
  FragmentMerger m(0, 6, hyper(1), 0.0);
  m.offer(ref("a", 1, 5, 1), tensors(1), 0.0);
  const auto dropped = m.offer(ref("a", 2, 6, 2), tensors(2), 0.0);
  REQUIRE(dropped);
  CHECK(dropped->delta.base_version == 5);
  CHECK(dropped->reason == DropReason::Superseded);
}

TEST_CASE("deltas past max_staleness are dropped as too stale", "[merger]") {
  SECTION("a limit of 3") {
    FragmentMerger m(0, 10, hyper(1, 3), 0.0);
    const auto stale = m.offer(ref("a", 1, 6, 1), tensors(1), 0.0);
    REQUIRE(stale);
    CHECK(stale->reason == DropReason::TooStale);
    CHECK(stale->delta.staleness == 4);
    CHECK_FALSE(m.offer(ref("b", 1, 7, 2), tensors(1), 0.0));
  }
  SECTION("0 accepts only the current version") {
    FragmentMerger m(0, 10, hyper(1, 0), 0.0);
    CHECK(m.offer(ref("a", 1, 9, 1), tensors(1), 0.0)->reason == DropReason::TooStale);
    CHECK_FALSE(m.offer(ref("b", 1, 10, 2), tensors(1), 0.0));
  }
  SECTION("unlimited") {
    FragmentMerger m(0, 1'000'000, hyper(1), 0.0);
    CHECK_FALSE(m.offer(ref("a", 1, 0, 1), tensors(1), 0.0));
  }
}

TEST_CASE("a delta from the future is invalid", "[merger]") {
  FragmentMerger m(0, 10, hyper(1), 0.0);
  const auto future = m.offer(ref("a", 1, 11, 1), tensors(1), 0.0);
  REQUIRE(future);
  CHECK(future->reason == DropReason::Invalid);
  CHECK(m.pending_learners() == 0);
}

TEST_CASE("a delta that would weigh nothing is invalid", "[merger]") {
  // (1 + 1000)^-200 underflows to 0.
  FragmentMerger m(0, 1000, hyper(1, kUnlimitedStaleness, 200.0f), 0.0);
  const auto nothing = m.offer(ref("a", 1, 0, 1), tensors(1), 0.0);
  REQUIRE(nothing);
  CHECK(nothing->reason == DropReason::Invalid);
  CHECK(nothing->detail.find("weight 0") != std::string::npos);
  CHECK_FALSE(m.offer(ref("b", 1, 1000, 2), tensors(1), 0.0));
}

TEST_CASE("a learner's base is merged at most once", "[merger]") {
  FragmentMerger m(0, 5, hyper(1), 0.0);
  m.offer(ref("a", 1, 5, 1), tensors(1), 0.0);
  m.offer(ref("b", 1, 4, 2), tensors(1), 0.0);
  merge_all(m, 1.0);
  REQUIRE(m.version() == 6);
  // a has not adopted version 6 yet: its next delta, from the same anchor, repeats merged progress.
  const auto again = m.offer(ref("a", 2, 5, 3), tensors(1), 1.1);
  REQUIRE(again);
  CHECK(again->reason == DropReason::Superseded);
  CHECK(again->detail.find("base already merged from this learner") != std::string::npos);
  CHECK(m.offer(ref("b", 2, 3, 4), tensors(1), 1.1)->reason == DropReason::Superseded);
  // Other learners on that base, and a on a newer one, are fine.
  CHECK_FALSE(m.offer(ref("c", 1, 5, 5), tensors(1), 1.2));
  CHECK_FALSE(m.offer(ref("a", 3, 6, 6), tensors(1), 1.3));
  CHECK_FALSE(m.offer(ref("b", 3, 5, 7), tensors(1), 1.3));
}

TEST_CASE("deltas arriving during a merge wait for the next round", "[merger]") {
  FragmentMerger m(0, 5, hyper(1, 1), 0.0);
  m.offer(ref("a", 1, 5, 1), tensors(1), 0.0);
  m.offer(ref("b", 1, 4, 2), tensors(1), 0.0);
  REQUIRE(m.poll(0.0, kNobody, kNoGrace));
  const MergePlan plan = m.take_merge_inputs(0.0);
  REQUIRE(plan.inputs.size() == 2);

  // While MERGING: a on the base being merged repeats it; b's newer delta is fine now but
  // becomes too stale at version 6; c is fine.
  CHECK(m.offer(ref("a", 2, 5, 3), tensors(1), 0.1)->detail.find("base already merged") !=
        std::string::npos);
  CHECK_FALSE(m.offer(ref("b", 2, 5, 4), tensors(1), 0.1));
  CHECK_FALSE(m.offer(ref("c", 1, 4, 5), tensors(1), 0.1));
  CHECK(m.offer(ref("d", 1, 6, 6), tensors(1), 0.1)->reason == DropReason::Invalid);
  CHECK(m.pending_learners() == 2);
  CHECK(m.uncommitted_positions().size() == 4);  // b, c pending; a, d dropped

  const auto dropped = m.merge_committed(6);
  REQUIRE(dropped.size() == 1);
  CHECK(dropped[0].delta.learner_id == "c");
  CHECK(dropped[0].reason == DropReason::TooStale);
  CHECK(dropped[0].delta.staleness == 2);
  CHECK(m.pending_learners() == 1);

  // b is already pending at publication: the quorum is in from the start of the round.
  m.published(0.5);
  const GraceWindow window = one_second_steps();
  CHECK_FALSE(m.poll(0.5, kNobody, window));
  CHECK(*m.grace_deadline() == Approx(1.5));
  REQUIRE(m.poll(1.5, kNobody, window));
  const MergePlan next = m.take_merge_inputs(1.5);
  REQUIRE(next.inputs.size() == 1);
  CHECK(next.inputs[0].ref.learner_id == "b");
  CHECK(next.inputs[0].ref.staleness == 1);
  REQUIRE(next.dropped.size() == 3);  // each drop goes into exactly one plan
  CHECK(next.dropped[0].delta.learner_id == "a");
  CHECK(next.dropped[1].delta.learner_id == "d");
  CHECK(next.dropped[2].delta.learner_id == "c");
}

TEST_CASE("uncommitted positions: pending and unrecorded drops", "[merger]") {
  FragmentMerger m(0, 5, hyper(2), 0.0);
  CHECK(m.uncommitted_positions().empty());
  m.offer(ref("a", 1, 5, 10), tensors(1), 0.0);
  m.offer(ref("a", 2, 5, 11), tensors(1), 0.0);
  const auto positions = m.uncommitted_positions();
  REQUIRE(positions.size() == 2);
  CHECK(positions[0].offset == 11);
  CHECK(positions[1].offset == 10);
  m.offer(ref("b", 1, 5, 12), tensors(1), 0.0);
  merge_all(m, 1.0);
  CHECK(m.uncommitted_positions().empty());
}

TEST_CASE("stop hands back every delta no record accounts for", "[merger]") {
  SECTION("while collecting") {
    FragmentMerger m(0, 5, hyper(3), 0.0);
    m.offer(ref("a", 1, 5, 1), tensors(1), 0.0);
    m.offer(ref("a", 2, 5, 4), tensors(1), 0.0);
    m.offer(ref("b", 1, 5, 3), tensors(1), 0.0);
    m.offer(ref("c", 1, 6, 2), tensors(1), 0.0);
    const auto out = m.stop();
    REQUIRE(out.size() == 4);
    CHECK(out[0].delta.seq == 1);
    CHECK(out[0].reason == DropReason::Superseded);
    CHECK(out[1].delta.learner_id == "c");
    CHECK(out[1].reason == DropReason::Invalid);
    CHECK(out[2].delta.learner_id == "b");  // pending, by position
    CHECK(out[2].reason == DropReason::PendingAtStop);
    CHECK(out[3].delta.learner_id == "a");
    CHECK(out[3].reason == DropReason::PendingAtStop);
    CHECK(m.state() == MergerState::Stopped);
    CHECK(m.pending_learners() == 0);
  }
  SECTION("during an uncommitted merge, its inputs are still pending") {
    FragmentMerger m(0, 5, hyper(1), 0.0);
    m.offer(ref("a", 1, 5, 1), tensors(1), 0.0);
    REQUIRE(m.poll(0.0, kNobody, kNoGrace));
    m.take_merge_inputs(0.0);
    m.offer(ref("b", 1, 5, 2), tensors(1), 0.0);
    const auto out = m.stop();
    REQUIRE(out.size() == 2);
    CHECK(out[0].delta.learner_id == "a");
    CHECK(out[1].delta.learner_id == "b");
    for (const auto& d : out) CHECK(d.reason == DropReason::PendingAtStop);
  }
  SECTION("after a committed merge, its inputs are accounted for") {
    FragmentMerger m(0, 5, hyper(1), 0.0);
    m.offer(ref("a", 1, 5, 1), tensors(1), 0.0);
    REQUIRE(m.poll(0.0, kNobody, kNoGrace));
    m.take_merge_inputs(0.0);
    m.merge_committed(6);
    CHECK(m.stop().empty());
  }
}

TEST_CASE("a merger built from a state's merged bases does not merge a learner's progress twice", "[merger]") {
  // What recovery at a checkpoint rebuilds: the records after it, applied with account(), and the
  // merged bases the checkpoint kept.
  FragmentState state;
  state.fragment = 2;
  state.version = 6;
  state.merged_bases = {{"a", 5}};
  MergeRecord record;
  record.fragment = 2;
  record.prev_version = 6;
  record.version = 7;
  record.inputs = {ref("b", 1, 3, 2)};
  record.dropped = {{ref("c", 4, 6, 3), DropReason::TooStale, ""},
                    {ref("a", 9000, 99, 4), DropReason::Invalid, "base from the future"},
                    {ref("d", 1, 6, 5), DropReason::PendingAtStop, ""}};
  account(state, record);
  CHECK(state.merged_bases == std::map<std::string, uint64_t>{{"a", 5}, {"b", 3}});
  // An invalid drop raises no learner's bookkeeping; a pending one is not accounted at all.
  CHECK(state.accounted == std::map<std::string, uint64_t>{{"b", 1}, {"c", 4}});
  CHECK(state.recent == std::set<LogPosition>{{kTopic, 0, 2}, {kTopic, 0, 3}, {kTopic, 0, 4}});
  prune_recent(state, std::vector<TopicPartitionOffset>{{kTopic, 0, 4}, {"other", 0, 100}});
  CHECK(state.recent == std::set<LogPosition>{{kTopic, 0, 4}});

  FragmentMerger m(2, 7, hyper(1), 0.0, state.merged_bases);
  CHECK(m.offer(ref("a", 10, 5, 6), tensors(1), 0.0)->reason == DropReason::Superseded);
  CHECK(m.offer(ref("b", 2, 3, 7), tensors(1), 0.0)->reason == DropReason::Superseded);
  CHECK_FALSE(m.offer(ref("b", 3, 7, 8), tensors(1), 0.0));
  CHECK_FALSE(m.offer(ref("a", 11, 6, 9), tensors(1), 0.0));
  // Without the merged bases (a checkpoint that did not keep them) learner a's base-5 progress
  // would be merged a second time.
  FragmentMerger forgetful(2, 7, hyper(1), 0.0);
  CHECK_FALSE(forgetful.offer(ref("a", 10, 5, 6), tensors(1), 0.0));
}

TEST_CASE("of two pending deltas of a learner the higher base wins, even with a lower seq", "[merger]") {
  // A learner restarted on a host whose clock is behind: lower seqs, but it adopted version 6.
  FragmentMerger m(0, 6, hyper(2), 0.0);
  CHECK_FALSE(m.offer(ref("a", 5000, 5, 1), tensors(1), 0.0));
  const auto dropped = m.offer(ref("a", 40, 6, 2), tensors(2), 0.0);
  REQUIRE(dropped);
  CHECK(dropped->delta.seq == 5000);
  const auto late = m.offer(ref("a", 6000, 5, 3), tensors(3), 0.0);
  REQUIRE(late);
  CHECK(late->delta.seq == 6000);
  CHECK(late->detail.find("older than the pending delta (base 6") != std::string::npos);
}

TEST_CASE("well-formed deltas that do not fit the run are dropped as invalid and never become pending", "[merger]") {
  InputBounds bounds{.max_norm_ratio = 100, .norm_window = 16, .norm_min = 4};
  FragmentMerger m(0, 5, hyper(9), 0.0, {}, bounds);  // quorum 9: nothing merges here
  // The norm bound applies once 4 deltas were accepted: norm of tensors(v) is v * sqrt(2).
  for (int i = 0; i < 4; ++i) CHECK_FALSE(m.offer(ref("l" + std::to_string(i), 1, 5, 10 + i), tensors(1.0f + 0.1f * i), 0.0));
  CHECK_FALSE(m.offer(ref("b", 1, 5, 20), tensors(90), 0.0));  // 90x the median: within 100x
  const auto huge = m.offer(ref("c", 1, 5, 21), tensors(1e6f), 0.0);
  REQUIRE(huge);
  CHECK(huge->reason == DropReason::Invalid);
  CHECK(huge->detail.find("merger.max_norm_ratio") != std::string::npos);
  CHECK(m.pending_learners() == 5);

  // Off: no bound at all.
  FragmentMerger open(0, 5, hyper(9), 0.0);
  for (int i = 0; i < 4; ++i) open.offer(ref("l" + std::to_string(i), 1, 5, 10 + i), tensors(1), 0.0);
  CHECK_FALSE(open.offer(ref("c", 1, 5, 21), tensors(1e6f), 0.0));
  DeltaRef any_tokens = ref("d", 1, 5, 22);
  any_tokens.tokens = 7;
  CHECK_FALSE(open.offer(any_tokens, tensors(1), 0.0));
}

TEST_CASE("an abandoned merge merges nothing: the inputs come back as invalid drops and their bases are not merged",
          "[merger]") {
  FragmentMerger m(0, 5, hyper(1), 0.0, {{"a", 2}});
  m.offer(ref("a", 7, 4, 1), tensors(1), 0.0);
  REQUIRE(m.poll(0.0, kNobody, kNoGrace));
  CHECK_THROWS_AS(m.merge_abandoned("x", 0.0), InternalError);  // nothing taken yet
  m.take_merge_inputs(0.0);
  const auto dropped = m.merge_abandoned("the merge result is not finite", 1.0);
  REQUIRE(dropped.size() == 1);
  CHECK(dropped[0].delta.seq == 7);
  CHECK(dropped[0].reason == DropReason::Invalid);
  CHECK(m.state() == MergerState::Collecting);
  CHECK(m.version() == 5);
  // Base 4 of learner a was not merged: a later delta on it may still be.
  CHECK_FALSE(m.offer(ref("a", 8, 4, 2), tensors(1), 2.0));
  CHECK(m.offer(ref("a", 9, 2, 3), tensors(1), 2.0)->reason == DropReason::Superseded);
}

// Learners of different batch sizes share a run: each delta's tokens are bounded by what its own
// learner announced (members), not by one batch size for all, and each weighs by its real tokens.
TEST_CASE("a delta's tokens are bounded by its learner's announced batch x context, and weigh as they are",
          "[merger]") {
  FragmentMerger m(0, 5, hyper(9), 0.0);
  // ref() says 100 tokens in 10 steps.
  const DeclaredBatch small{.batch = 2, .context = 5};   // 10 tokens per step: 100 in 10 steps fits exactly
  const DeclaredBatch tiny{.batch = 1, .context = 9};    // 9 per step: 100 is more than 90
  const DeclaredBatch large{.batch = 64, .context = 5};  // 320 per step
  CHECK_FALSE(m.offer(ref("a", 1, 5, 1), tensors(1), 0.0, small));
  const auto over = m.offer(ref("b", 1, 5, 2), tensors(1), 0.0, tiny);
  REQUIRE(over);
  CHECK(over->reason == DropReason::Invalid);
  CHECK(over->delta.learner_id == "b");
  CHECK(over->detail == "100 tokens in 10 inner steps, more than the 1 sequences x 9 tokens per step that learner b "
                        "announced");
  DeltaRef big = ref("c", 1, 5, 3);
  big.tokens = 3200;  // 10 steps of 64 x 5
  CHECK_FALSE(m.offer(big, tensors(1), 0.0, large));
  DeltaRef short_steps = ref("d", 1, 5, 4);
  short_steps.tokens = 2000;  // fewer than 10 x 320: shorter sequences, still fine
  CHECK_FALSE(m.offer(short_steps, tensors(1), 0.0, large));
  // Not announced (yet): not bounded here.
  DeltaRef unknown = ref("e", 1, 5, 5);
  unknown.tokens = 1u << 20;
  CHECK_FALSE(m.offer(unknown, tensors(1), 0.0));
  CHECK(m.pending_learners() == 4);
  // The dropped delta is kept for the next merge record, with its reason.
  const auto plan = m.stop();
  const auto invalid = std::count_if(plan.begin(), plan.end(), [](const DroppedDelta& d) {
    return d.reason == DropReason::Invalid && d.delta.learner_id == "b";
  });
  CHECK(invalid == 1);
}

TEST_CASE("learners of different batch sizes merge together, weighted by their real tokens", "[merger]") {
  FragmentMerger m(0, 5, hyper(2), 0.0);
  DeltaRef small = ref("small", 1, 5, 1);  // batch 2 x context 5, 10 steps: 100 tokens
  DeltaRef large = ref("large", 1, 5, 2);
  large.tokens = 3200;  // batch 64 x context 5, 10 steps
  CHECK_FALSE(m.offer(small, tensors(1), 0.0, DeclaredBatch{.batch = 2, .context = 5}));
  CHECK_FALSE(m.offer(large, tensors(1), 0.0, DeclaredBatch{.batch = 64, .context = 5}));
  const MergePlan plan = merge_all(m, 1.0);
  REQUIRE(plan.inputs.size() == 2);
  CHECK(plan.dropped.empty());
  // Weight = tokens x tokens per step (weighting.h), by hand: 100 x 10 and 3200 x 320.
  CHECK(plan.inputs[0].ref.learner_id == "small");
  CHECK(plan.inputs[0].ref.weight == 1000.0);
  CHECK(plan.inputs[1].ref.weight == 1024000.0);
}
