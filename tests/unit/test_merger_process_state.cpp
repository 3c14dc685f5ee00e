// The merger process's bookkeeping (merger/process_state.h) driven directly, without a broker or
// a timed signal: the stop and failure paths of merger/merger_process.cc, step by step as its loop
// takes them. The rule held throughout: a merger that cannot trust its state writes nothing on
// the way out (no record, no offsets), and a restart recovers. The same paths run with real
// processes and fault injection in tests/integration/test_merger_faults.cpp.
#include <catch2/catch.hpp>

#include <atomic>
#include <memory>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "core/codec/chunk.h"
#include "merger/fragment_merger.h"
#include "merger/process_state.h"
#include "merger/weighting.h"

namespace diloco {
inline std::ostream& operator<<(std::ostream& out, const TopicPartitionOffset& t) {
  return out << t.topic << "[" << t.partition << "]@" << t.offset;
}
}  // namespace diloco

using namespace diloco;

namespace {

const std::string kRun = "state-test";
const std::string kDeltas = "diloco.state-test.deltas.r0";
constexpr uint32_t kFragments = 4;  // with 2 partitions: 0 and 2 in partition 0, 1 and 3 in 1
const std::vector<std::string> kNobody;
const GraceWindow kNoGrace;

DecodeLimits limits() {
  DecodeLimits l;
  l.run_id = kRun;
  return l;
}

// A book of a run of 4 fragments over 2 partitions, stopped by `stop`.
ProcessState book_of(const std::atomic<bool>& stop) {
  ProcessState book(stop, kFragments, limits());
  book.set_partitions(2);
  return book;
}

ConsumedMessage record(int32_t partition, int64_t offset, std::vector<uint8_t> value = {1, 2, 3}) {
  ConsumedMessage m;
  m.topic = kDeltas;
  m.partition = partition;
  m.offset = offset;
  m.value = std::move(value);
  return m;
}

TopicPartitionOffset at(int32_t partition, int64_t offset) { return {kDeltas, partition, offset}; }

// Fragment p as a recovery leaves it: the logs' `version`, a merger collecting at quorum 1.
OwnedFragment fragment(uint32_t p, uint64_t version) {
  OwnedFragment f;
  f.state.fragment = p;
  f.state.version = version;
  OuterHyper hyper;
  hyper.quorum = 1;
  hyper.max_staleness = kUnlimitedStaleness;
  f.merger = std::make_unique<FragmentMerger>(p, version, hyper, 0.0);
  return f;
}

// A recovery that succeeds, as ensure_recovered runs it: every fragment of the assigned partitions
// rebuilt at version 0, and the consumer rewound when that was asked.
void recover(ProcessState& book) {
  REQUIRE(book.recovery_due());
  book.begin_recovery();
  for (int32_t partition : book.assigned())
    for (uint32_t p : book.fragments_of(partition)) book.owned[p] = fragment(p, 0);
  if (book.rewind_needed()) {
    book.begin_rewind();
    book.rewound();
  }
  book.recovered();
}

// A merger's book with the partitions `assigned` recovered, and the flag its signal handler sets.
struct Recovered {
  std::atomic<bool> stop = false;
  ProcessState book;
  explicit Recovered(std::set<int32_t> assigned) : book(book_of(stop)) {
    book.assign(std::move(assigned));
    recover(book);
  }
};

// A delta of `fragment` from `learner` on version `base`, read at `offset` of `partition`,
// handled as handle_delta does: consumed, found owned, offered to the fragment's merger. Returns
// the drop it caused, if any.
std::optional<DroppedDelta> deliver(ProcessState& book, int32_t partition, int64_t offset, uint32_t fragment,
                                    const std::string& learner, uint64_t base) {
  auto assembled = book.consume(record(partition, offset), 0.0);
  REQUIRE(assembled);
  REQUIRE(assembled->message);
  REQUIRE(book.owner_of(fragment, partition) == DeltaOwner::Owned);
  DeltaRef ref;
  ref.position = {kDeltas, partition, offset};
  ref.learner_id = learner;
  ref.seq = 1;
  ref.base_version = base;
  ref.inner_steps = 10;
  ref.tokens = 100;
  return book.owned.at(fragment).merger->offer(ref, DeltaTensors(std::vector<DenseTensor>{{0, {2}, {1.0f, -1.0f}}}),
                                               0.0);
}

// A merge of fragment p up to its commit, as the loop runs it: due, its inputs taken.
MergePlan take(ProcessState& book, uint32_t p) {
  auto& merger = *book.owned.at(p).merger;
  REQUIRE(merger.poll(1.0, kNobody, kNoGrace));
  return merger.take_merge_inputs(1.0);
}

// The merge's commit with `offsets` succeeded: the fragment is at its next version, published.
void committed(ProcessState& book, uint32_t p, const std::vector<TopicPartitionOffset>& offsets) {
  auto& f = book.owned.at(p);
  ++f.state.version;
  book.committed(offsets);
  f.merger->merge_committed(f.state.version);
  f.merger->published(1.0);
}

// "<position> <reason>" of each delta a stop record would hold.
std::vector<std::string> described(const std::vector<DroppedDelta>& held) {
  std::vector<std::string> out;
  for (const auto& d : held) out.push_back(describe(d.delta.position) + " " + drop_reason_name(d.reason));
  return out;
}

}  // namespace

TEST_CASE("a merge whose commit failed, then a stop: nothing is written or served, and a restart recovers",
          "[merger][process_state][stop]") {
  Recovered merger({0});
  auto& book = merger.book;
  CHECK_FALSE(deliver(book, 0, 4, 0, "a", 0));
  take(book, 0);
  // merge_step_in_place wrote version 1 over the committed version 0, then the commit failed
  // (the SIGTERM of DILOCO_FAULT_STOP_AT comes at that instant).
  book.owned.at(0).state.version = 1;
  book.request_recovery(true);
  merger.stop = true;

  CHECK_FALSE(book.recovery_due());  // no recovery runs under a stop
  CHECK_FALSE(book.trusted());       // the loop ends before announcing or serving version 1
  CHECK_FALSE(book.handles_polled(false));
  CHECK_FALSE(book.stop_writes());   // no accounting record, no offsets
  // The held fragment was not stopped into a record either.
  CHECK(book.owned.at(0).merger->state() == MergerState::Merging);

  // The restarted merger (same id) is assigned the partition, which starts at the group's
  // committed offsets (before offset 4, never committed): it rebuilds version 0 from the logs
  // before it handles a delta, and reads the held delta again.
  std::atomic<bool> no_stop = false;
  ProcessState restarted = book_of(no_stop);
  restarted.assign({0});
  CHECK(restarted.recovery_needed());
  CHECK_FALSE(restarted.rewind_needed());
  CHECK_FALSE(restarted.handles_polled(false));
  recover(restarted);
  CHECK(restarted.owned.at(0).state.version == 0);
  CHECK_FALSE(deliver(restarted, 0, 4, 0, "a", 0));
  CHECK(restarted.owned.at(0).merger->pending_learners() == 1);
}

TEST_CASE("a recovery that failed, then a stop: no offset is committed past the deltas it held",
          "[merger][process_state][stop]") {
  Recovered merger({0});
  auto& book = merger.book;
  CHECK(book.recoveries() == 1);
  CHECK_FALSE(deliver(book, 0, 3, 0, "a", 0));
  CHECK_FALSE(deliver(book, 0, 4, 2, "b", 0));
  // Held in memory, the two deltas hold the offset at the first of them.
  CHECK(book.offsets_to_commit() == std::vector{at(0, 3)});

  // Fragment 0's merge did not commit: the loop asks for a recovery with a rewind and, with no
  // stop yet, starts it at once (the second of the process), dropping what it held.
  take(book, 0);
  book.request_recovery(true);
  REQUIRE(book.recovery_due());
  CHECK(book.begin_recovery() == 2);
  CHECK(book.owned.empty());
  // The broker is away: the recovery fails, and the stop comes with it.
  book.recovery_failed();
  merger.stop = true;

  CHECK(book.recovery_needed());
  CHECK(book.rewind_needed());
  CHECK_FALSE(book.recovery_due());
  CHECK_FALSE(book.trusted());
  // The consumed offsets are still counted (only a rewind forgets them) and no fragment holds
  // them back any more: offsets taken now would pass both deltas (5, beyond 3 and 4), which the
  // next owner would then never read. So the stop writes nothing at all.
  CHECK(book.next_offsets().at({kDeltas, 0}) == 5);
  CHECK(book.offsets_to_commit() == std::vector{at(0, 5)});
  CHECK_FALSE(book.stop_writes());
}

TEST_CASE("a delta handed in while a recovery is needed is not consumed, nor refused as another owner's",
          "[merger][process_state]") {
  Recovered merger({0});
  auto& book = merger.book;
  // A merge failed and the recovery after it too: fragment 0 is not held any more.
  book.request_recovery(true);
  book.begin_recovery();
  book.recovery_failed();
  REQUIRE(book.owned.empty());

  // A delta of fragment 0, polled in its own partition.
  CHECK_FALSE(book.handles_polled(false));
  CHECK(book.owner_of(0, 0) == DeltaOwner::Unrecovered);  // not WrongPartition: the fragment is this merger's
  CHECK_FALSE(book.consume(record(0, 7), 0.0));
  CHECK(book.next_offsets().empty());  // its offset is not passed

  // Once recovered (and rewound) it is handled like any other: read again after the rewind, it is
  // consumed and offered. The copy polled before the rewind is not handled.
  recover(book);
  CHECK(book.rewinds() == 1);
  CHECK_FALSE(book.handles_polled(true));
  CHECK(book.handles_polled(false));
  CHECK(book.owner_of(0, 0) == DeltaOwner::Owned);
  CHECK_FALSE(deliver(book, 0, 7, 0, "a", 0));
  CHECK(book.next_offsets().at({kDeltas, 0}) == 8);
}

TEST_CASE("a clean stop records every held delta and holds the offsets at the first pending one",
          "[merger][process_state][stop]") {
  Recovered merger({0, 1});
  auto& book = merger.book;
  // Partition 0: at 5 a delta of fragment 2 on a base from the future (dropped as invalid), at 6
  // a delta of fragment 1, which belongs in partition 1 (refused as wrong_partition).
  auto dropped = deliver(book, 0, 5, 2, "b", 3);
  REQUIRE(dropped);
  CHECK(dropped->reason == DropReason::Invalid);
  REQUIRE(book.consume(record(0, 6), 0.0));
  CHECK(book.owner_of(1, 0) == DeltaOwner::WrongPartition);
  // Partition 1: at 2 a delta of fragment 1 on a base from the future (invalid), at 3 one refused.
  REQUIRE(deliver(book, 1, 2, 1, "c", 4));
  REQUIRE(book.consume(record(1, 3), 0.0));

  merger.stop = true;
  REQUIRE(book.trusted());
  // The drain reads on: at 7 a delta of fragment 0, pending; at 8 a record refused.
  CHECK(book.handles_polled(false));
  CHECK_FALSE(deliver(book, 0, 7, 0, "a", 0));
  REQUIRE(book.consume(record(0, 8), 0.0));

  auto writes = book.stop_writes();
  REQUIRE(writes);
  // An accounting record per fragment that holds something: the pending delta for a later owner
  // to merge, and the drops no record accounted for yet. Fragment 3 held nothing.
  CHECK(writes->held.size() == 3);
  CHECK(described(writes->held.at(0)) == std::vector<std::string>{kDeltas + "[0]@7 pending_at_stop"});
  CHECK(described(writes->held.at(1)) == std::vector<std::string>{kDeltas + "[1]@2 invalid"});
  CHECK(described(writes->held.at(2)) == std::vector<std::string>{kDeltas + "[0]@5 invalid"});
  CHECK_FALSE(writes->held.count(3));
  // Partition 0 is held at the pending delta (7, not 9: the next owner reads it again); partition
  // 1 holds nothing pending and passes its drop, which the record accounts for (4).
  CHECK(writes->offsets == std::vector{at(0, 7), at(1, 4)});
  for (const auto& [p, f] : book.owned) CHECK(f.merger->state() == MergerState::Stopped);
}

TEST_CASE("a merge commits offsets held back by the deltas other fragments of its partition still hold",
          "[merger][process_state]") {
  Recovered merger({0, 1});
  auto& book = merger.book;
  // Partition 0: fragment 0's delta at 7, fragment 2's at 8 and, at 9, one of fragment 2 on a
  // base from the future (dropped, not yet in a record). Partition 1: fragment 1's delta at 2.
  CHECK_FALSE(deliver(book, 0, 7, 0, "a", 0));
  CHECK_FALSE(deliver(book, 0, 8, 2, "b", 0));
  REQUIRE(deliver(book, 0, 9, 2, "c", 4));
  CHECK_FALSE(deliver(book, 1, 2, 1, "d", 0));
  CHECK(book.offsets_to_commit() == std::vector{at(0, 7), at(1, 2)});

  // Fragment 1 merges its delta: partition 1 holds nothing else and advances to its next offset.
  take(book, 1);
  auto offsets = book.offsets_to_commit();
  CHECK(offsets == std::vector{at(0, 7), at(1, 3)});
  committed(book, 1, offsets);

  // Fragment 0 merges: partition 0 is held at fragment 2's pending delta.
  take(book, 0);
  offsets = book.offsets_to_commit();
  CHECK(offsets == std::vector{at(0, 8), at(1, 3)});
  committed(book, 0, offsets);

  // Fragment 2 merges its pending delta and records its drop: nothing holds partition 0 back.
  const MergePlan plan = take(book, 2);
  CHECK(plan.inputs.size() == 1);
  CHECK(described(plan.dropped) == std::vector<std::string>{kDeltas + "[0]@9 invalid"});
  offsets = book.offsets_to_commit();
  CHECK(offsets == std::vector{at(0, 10), at(1, 3)});
  committed(book, 2, offsets);
}

TEST_CASE("offsets are never committed inside a chunked delta", "[merger][process_state][chunks]") {
  Recovered merger({0});
  auto& book = merger.book;
  // Two chunked deltas interleaved in partition 0: A in three pieces at 10, 12 and 14, B in two
  // at 11 and 13.
  auto a = split_message(std::vector<uint8_t>(10'000, 1), ChunkId{kRun, "learner-a", 0, 1}, 4096);
  auto b = split_message(std::vector<uint8_t>(6'000, 2), ChunkId{kRun, "learner-b", 2, 1}, 4096);
  REQUIRE(a.size() == 3);
  REQUIRE(b.size() == 2);
  auto add = [&](int64_t offset, std::vector<uint8_t> piece) {
    auto assembled = book.consume(record(0, offset, std::move(piece)), 0.0);
    REQUIRE(assembled);
    CHECK(assembled->problems.empty());
    return assembled->message;
  };
  CHECK_FALSE(add(10, a[0]));
  CHECK_FALSE(add(11, b[0]));
  CHECK_FALSE(add(12, a[1]));
  // Incomplete messages hold the offset at the first piece of the earliest (A's).
  CHECK(book.offsets_holding({}) == std::vector{at(0, 10)});
  auto whole_b = add(13, b[1]);
  REQUIRE(whole_b);
  CHECK(whole_b->offset == 11);
  CHECK(whole_b->last_offset == 13);
  auto whole_a = add(14, a[2]);
  REQUIRE(whole_a);
  CHECK(whole_a->offset == 10);

  // Both whole: with nothing held the offset passes them (15).
  CHECK(book.offsets_holding({}) == std::vector{at(0, 15)});
  // B held (pending at 11): 11 would fall inside A (10 to 14), whose tail alone a restart would
  // read, so the offset goes back to A's first piece.
  CHECK(book.offsets_holding({{kDeltas, 0, 11}}) == std::vector{at(0, 10)});
  // Once 15 is committed both lie wholly below it and hold nothing back any more: a position
  // inside them is taken as it is.
  book.committed({at(0, 15)});
  CHECK(book.offsets_holding({{kDeltas, 0, 12}}) == std::vector{at(0, 12)});
}

TEST_CASE("an assignment forgets what was consumed and asks for a recovery without a rewind, a failure for one with",
          "[merger][process_state]") {
  std::atomic<bool> stop = false;
  ProcessState book = book_of(stop);
  CHECK(book.trusted());  // nothing held yet
  book.assign({0});
  CHECK(book.recovery_needed());
  CHECK_FALSE(book.rewind_needed());  // the consumer starts at the committed offsets
  CHECK_FALSE(book.trusted());
  recover(book);
  CHECK(book.rewinds() == 0);
  CHECK(book.owned.size() == 2);  // fragments 0 and 2
  REQUIRE(book.consume(record(0, 3), 0.0));

  // A failure asks for a rewind; a later request without one does not take it back.
  book.request_recovery(true);
  book.request_recovery(false);
  CHECK(book.rewind_needed());
  REQUIRE(book.recovery_due());
  CHECK(book.begin_recovery() == 2);
  CHECK(book.begin_rewind() == 1);
  book.rewound();
  CHECK(book.next_offsets().empty());  // read again from the committed offsets
  CHECK_FALSE(book.rewind_needed());
  CHECK(book.recovery_needed());  // until the fragments are rebuilt
  book.recovered();
  CHECK(book.trusted());

  // A new assignment while a rewind is pending: the consumer is at the committed offsets already.
  REQUIRE(book.consume(record(0, 3), 0.0));
  book.request_recovery(true);
  book.assign({1});
  CHECK_FALSE(book.rewind_needed());
  CHECK(book.owned.empty());
  CHECK(book.next_offsets().empty());
  CHECK(book.assigned() == std::set<int32_t>{1});
  recover(book);
  CHECK(book.owned.size() == 2);  // fragments 1 and 3

  // Revoked: nothing held, nothing to commit.
  REQUIRE(book.consume(record(1, 6), 0.0));
  book.revoke();
  CHECK(book.owned.empty());
  CHECK(book.assigned().empty());
  CHECK(book.offsets_to_commit().empty());
}

TEST_CASE("who takes a decoded delta: its owner, or a refusal with the reason", "[merger][process_state]") {
  Recovered merger({0});
  auto& book = merger.book;
  book.owned.erase(2);
  book.awaiting_genesis.insert(2);  // fragment 2 has no version 0 yet
  book.owned.at(0).state.recent.insert({kDeltas, 0, 5});  // a committed record accounts for it

  CHECK(book.owner_of(0, 0) == DeltaOwner::Owned);
  CHECK(book.owner_of(0, 1) == DeltaOwner::WrongPartition);  // fragment 0 belongs in partition 0
  CHECK(book.owner_of(1, 1) == DeltaOwner::WrongPartition);  // partition 1 is another merger's
  CHECK(book.owner_of(2, 0) == DeltaOwner::AwaitingGenesis);
  CHECK(book.owner_of(2, 1) == DeltaOwner::AwaitingGenesis);  // said so whatever the partition
  CHECK(book.accounted({kDeltas, 0, 5}));
  CHECK_FALSE(book.accounted({kDeltas, 0, 6}));
  CHECK_FALSE(book.accounted({kDeltas, 1, 5}));
}
