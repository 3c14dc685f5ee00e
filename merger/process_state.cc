#include "merger/process_state.h"

#include <algorithm>

namespace diloco {

namespace {
// Proposals are read against the layout they carry: the run may have none yet, and one of another
// model is rejected by how it differs (merger_process.cc handle_proposal).
DecodeLimits any_layout(DecodeLimits limits) {
  limits.layout = nullptr;
  return limits;
}
}  // namespace

ProcessState::ProcessState(const std::atomic<bool>& stop, uint32_t fragments, DecodeLimits limits)
    : stop_(stop), fragments_(fragments), chunks_(limits), proposals_(any_layout(limits)) {}

void ProcessState::set_limits(DecodeLimits limits) {
  proposals_.set_limits(any_layout(limits));
  chunks_.set_limits(std::move(limits));
}

std::optional<GenesisProposal> ProcessState::read_proposal(const ConsumedMessage& message) {
  return proposals_.add(message.value, {message.topic, message.partition, message.offset});
}

std::vector<uint32_t> ProcessState::fragments_of(int32_t partition) const {
  std::vector<uint32_t> out;
  for (uint32_t p = static_cast<uint32_t>(partition); p < fragments_; p += static_cast<uint32_t>(partitions_))
    out.push_back(p);
  return out;
}

void ProcessState::assign(std::set<int32_t> partitions) {
  assigned_ = std::move(partitions);
  owned.clear();
  awaiting_genesis.clear();
  forget_consumed();
  recover_needed_ = true;
  rewind_needed_ = false;  // a new assignment starts at the committed offsets anyway
}

void ProcessState::revoke() {
  owned.clear();
  awaiting_genesis.clear();
  assigned_.clear();
  forget_consumed();
}

DeltaOwner ProcessState::owner_of(uint32_t fragment, int32_t partition) const {
  if (recover_needed_) return DeltaOwner::Unrecovered;
  if (awaiting_genesis.count(fragment)) return DeltaOwner::AwaitingGenesis;
  if (partition_of(fragment) != partition || !owned.count(fragment)) return DeltaOwner::WrongPartition;
  return DeltaOwner::Owned;
}

bool ProcessState::accounted(const LogPosition& at) const {
  for (uint32_t q : fragments_of(at.partition))
    if (auto f = owned.find(q); f != owned.end() && f->second.state.recent.contains(at)) return true;
  return false;
}

void ProcessState::request_recovery(bool rewind) {
  recover_needed_ = true;
  rewind_needed_ = rewind_needed_ || rewind;
}

int ProcessState::begin_recovery() {
  owned.clear();
  awaiting_genesis.clear();
  return ++recoveries_;
}

void ProcessState::recovery_failed() {
  owned.clear();
  awaiting_genesis.clear();
}

int ProcessState::begin_rewind() { return ++rewinds_; }

void ProcessState::rewound() {
  forget_consumed();
  rewind_needed_ = false;
}

void ProcessState::forget_consumed() {
  next_offset_.clear();
  chunks_.clear();
  proposals_.reset();
  spans_.clear();
}

std::optional<ChunkAssembler::Result> ProcessState::consume(ConsumedMessage record, double now) {
  if (!trusted()) return std::nullopt;
  next_offset_[{record.topic, record.partition}] = record.offset + 1;
  auto assembled = chunks_.add(std::move(record), now);
  if (const auto& m = assembled.message; m && m->end() > m->offset)
    spans_[{m->topic, m->partition}][m->offset] = m->end();
  return assembled;
}

std::vector<TopicPartitionOffset> ProcessState::offsets_to_commit() const {
  // A partition's offset may not pass a delta some fragment still holds (pending, or dropped but
  // not yet in a committed record): after a crash it must be read again. Deltas re-read that a
  // committed record already accounts for are skipped by position (FragmentState.recent).
  std::vector<LogPosition> held;
  for (const auto& [p, f] : owned)
    for (auto& pos : f.merger->uncommitted_positions()) held.push_back(std::move(pos));
  return offsets_holding(held);
}

std::vector<TopicPartitionOffset> ProcessState::offsets_holding(const std::vector<LogPosition>& held) const {
  std::map<std::pair<std::string, int32_t>, int64_t> commit = next_offset_;
  auto hold = [&](const LogPosition& pos) {
    auto it = commit.find({pos.topic, pos.partition});
    if (it != commit.end()) it->second = std::min(it->second, pos.offset);
  };
  for (const auto& pos : held) hold(pos);
  for (const auto& pos : chunks_.open_heads()) hold(pos);
  for (const auto& pos : proposals_.open_heads()) hold(pos);
  // Nor inside a completed chunked delta: back to its first piece (which may fall inside
  // another one, hence the loop, from the highest span down).
  for (auto& [tp, offset] : commit) {
    auto spans = spans_.find(tp);
    if (spans == spans_.end()) continue;
    for (auto it = spans->second.rbegin(); it != spans->second.rend(); ++it)
      if (it->first < offset && it->second >= offset) offset = it->first;
  }
  std::vector<TopicPartitionOffset> out;
  for (const auto& [tp, offset] : commit)
    if (assigned_.count(tp.second)) out.push_back({tp.first, tp.second, offset});
  return out;
}

void ProcessState::committed(const std::vector<TopicPartitionOffset>& offsets) {
  for (const auto& tp : offsets) {
    auto spans = spans_.find({tp.topic, tp.partition});
    if (spans == spans_.end()) continue;
    for (auto it = spans->second.begin(); it != spans->second.end();)
      it = it->second < tp.offset ? spans->second.erase(it) : std::next(it);
  }
}

std::optional<StopWrites> ProcessState::stop_writes() {
  if (!trusted()) return std::nullopt;
  // A clean stop records what is still held: pending deltas as PendingAtStop (a later owner merges
  // them) and drops not yet in a record, with the offsets that the pending deltas allow.
  StopWrites out;
  std::vector<LogPosition> pending;
  for (auto& [p, f] : owned) {
    auto held = f.merger->stop();
    for (const auto& d : held)
      if (d.reason == DropReason::PendingAtStop) pending.push_back(d.delta.position);
    if (!held.empty()) out.held[p] = std::move(held);
  }
  out.offsets = offsets_holding(pending);
  return out;
}

}  // namespace diloco
