#include "learner/param_inbox.h"

#include <zmq.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <set>
#include <stdexcept>

#include "core/errors.h"
#include "core/kafka/consumer.h"
#include "core/process.h"
#include "core/kafka/run_log.h"
#include "core/zmq/params_channel.h"
#include "learner/snapshot_asks.h"

namespace diloco {

ParamInbox::ParamInbox(ParamInboxOptions options, Metrics& metrics)
    : options_(std::move(options)), metrics_(metrics) {
  thread_ = std::thread([this] { run(); });
}

int ParamInbox::fault_turn_from_environment() {
  const int n = fault_count_from_environment("DILOCO_FAULT_INBOX_THROW");
  if (n) std::cerr << "learner: fault injection on (DILOCO_FAULT_INBOX_THROW=" << n << "): for tests only\n";
  return n;
}

ParamInbox::~ParamInbox() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

std::vector<std::shared_ptr<const FragmentParams>> ParamInbox::take(const std::vector<uint64_t>& known) {
  std::lock_guard lock(mutex_);
  std::vector<std::shared_ptr<const FragmentParams>> out;
  for (auto it = latest_.begin(); it != latest_.end();) {
    if (it->first < known.size() && it->second->version > known[it->first]) out.push_back(std::move(it->second));
    it = latest_.erase(it);
  }
  return out;
}

std::vector<RoundOpen> ParamInbox::take_round_opens() {
  std::lock_guard lock(mutex_);
  std::vector<RoundOpen> out;
  for (auto& [p, notice] : round_opens_) out.push_back(std::move(notice));
  round_opens_.clear();
  return out;
}

bool ParamInbox::owner_silent(uint32_t fragment, double missed) const {
  std::lock_guard lock(mutex_);
  auto it = owner_heard_.find(fragment);
  if (!members_caught_up_ || it == owner_heard_.end() || it->second.interval_s <= 0) return false;
  return static_cast<double>(members_newest_ms_ - it->second.stamp_ms) > missed * 1000.0 * it->second.interval_s;
}

std::vector<std::string> ParamInbox::endpoints() const {
  std::lock_guard lock(mutex_);
  return endpoints_;
}

void ParamInbox::run() {
  zmq::context_t context(1);
  ParamsSubscriber subscriber(context, 256, {}, options_.curve ? &*options_.curve : nullptr, options_.fragments);
  const std::set<uint32_t> wanted_fragments(options_.fragments.begin(), options_.fragments.end());
  auto takes = [&](uint32_t p) { return wanted_fragments.empty() || wanted_fragments.count(p) > 0; };
  auto connect = [&](const std::string& endpoint) {
    try {
      subscriber.connect(endpoint);
      std::lock_guard lock(mutex_);
      endpoints_.assign(subscriber.endpoints().begin(), subscriber.endpoints().end());
    } catch (const InvalidInput& e) {
      std::cerr << "learner: ignoring merger endpoint: " << e.what() << "\n";
    }
  };
  for (const auto& e : options_.endpoints) connect(e);

  // Follow `members` from its recent tail (core/kafka/run_log.h): every live merger announced
  // itself there, and a run's older heartbeats are many.
  std::unique_ptr<Consumer> members;
  auto open_members = [&] {
    try {
      ConsumerOptions consumer_options{.kafka = options_.kafka};
      consumer_options.kafka.client_id = options_.kafka.client_id + "-members";
      consumer_options.assign_metadata_ms = options_.members_metadata_ms;
      members = std::make_unique<Consumer>(consumer_options);
      members->assign({{options_.topics.members(), 0,
                        members_tail_offset(*members, options_.topics, options_.members_lookback_s,
                                            options_.members_metadata_ms)}});
    } catch (const Error& e) {
      std::cerr << "learner: cannot follow " << options_.topics.members() << " yet: " << e.what() << "\n";
      members.reset();
    }
  };
  open_members();

  // Versions the mergers announce in their heartbeats against the newest version received, per
  // fragment: a gap that lasts is asked for again.
  using Clock = std::chrono::steady_clock;
  // Versions announced and versions arrived, per fragment: when a lag stalls (learner/snapshot_asks.h).
  StallClock stall(std::chrono::duration<double>(options_.request_delay_s),
                   std::chrono::duration<double>(options_.request_interval_max_s));
  SnapshotAsks asks(std::chrono::duration<double>(options_.request_interval_s),
                    std::chrono::duration<double>(options_.request_interval_max_s));
  // The newest version of each fragment held in full: what the next update applies to. The same
  // object is handed out by take(), never changed (an update makes the next one).
  std::map<uint32_t, std::shared_ptr<const FragmentParams>> held;
  for (auto& params : options_.held) {
    DILOCO_ENFORCE(params != nullptr, "ParamInboxOptions::held: a null version");
    held[params->fragment] = std::move(params);
  }
  options_.held.clear();
  // Snapshots above codec.segment_bytes arrive as segments, decoded into place one at a time.
  // While a fragment's segments keep arriving (one within request_interval_max_s), it is not
  // asked for again: a large snapshot takes longer to arrive and decode than the asks' back-off,
  // and an ask the merger serves would send the whole fragment a second time.
  FragmentParamsAssembler assembler(options_.limits);
  std::map<uint32_t, Clock::time_point> arriving;  // fragment -> its last segment taken
  // Fragments a snapshot is wanted of: asked for again until a usable version arrives, each time
  // waiting twice as long (learner/snapshot_asks.h).
  std::set<uint32_t> wanted;
  // The checksum a merger's heartbeat gives for a version: a held version with other bits (from a
  // merger that lost the fragment, or corrupted) is replaced by a snapshot.
  std::map<uint32_t, std::pair<uint64_t, uint64_t>> announced_checksum;
  // Why a snapshot is wanted, said once when it becomes wanted (a snapshot is a whole fragment).
  auto want = [&](uint32_t p, const std::string& why) {
    if (wanted.insert(p).second) std::cerr << "learner: fragment " << p << ": " << why << "; a snapshot is wanted\n";
  };
  auto ask_for_gaps = [&] {
    const auto now = Clock::now();
    for (auto it = announced_checksum.begin(); it != announced_checksum.end();) {
      auto h = held.find(it->first);
      if (h == held.end() || h->second->version != it->second.first) {
        ++it;
        continue;
      }
      if (h->second->checksum != it->second.second) {
        metrics_.add("params_checksum_mismatch_total", 1);
        want(it->first, detail::concat("version ", it->second.first, ": held checksum ", h->second->checksum,
                                       ", the merger announces ", it->second.second));
      }
      it = announced_checksum.erase(it);  // checked once per announcement
    }
    for (const uint32_t p : stall.fragments()) {
      const auto h = held.find(p);
      const std::optional<uint64_t> version =
          h == held.end() ? std::nullopt : std::optional<uint64_t>(h->second->version);
      if (!stall.behind(p, version)) continue;
      // Until the first read of `members` reaches its end, what it announces was published before
      // this subscriber connected and will not arrive by itself: asked for at once.
      if (!members_caught_up_)
        want(p, "a newer version was announced before this learner subscribed");
      else if (stall.stalled(p, version, now))
        want(p, detail::concat("no newer version arrived for ", stall.threshold(p, version.has_value()).count(), " s after one was announced"));
    }
    for (auto it = wanted.begin(); it != wanted.end();) {
      const auto segment = arriving.find(*it);
      if (segment != arriving.end() &&
          now - segment->second < std::chrono::duration<double>(options_.request_interval_max_s)) {
        ++it;
        continue;
      }
      if (!asks.due(*it, now)) {
        ++it;
        continue;
      }
      subscriber.request(*it);
      asks.asked(*it, now);
      metrics_.add("params_requested_total", 1);
      it = wanted.erase(it);
    }
  };

  // Whatever goes wrong in a turn must not end the learner (an exception leaving a thread
  // terminates the process): it is counted, said at most once a minute, and the loop goes on.
  auto last_said = Clock::now() - std::chrono::hours(1);
  int turns = 0;
  while (!stop_) try {
    if (++turns == fault_turn_) throw std::runtime_error(detail::concat("fault injection: turn ", turns, " fails"));
    if (!members) open_members();
    if (members) {
      try {
        for (int i = 0; i < 4096; ++i) {  // what was fetched, within a bound that keeps a turn short
          auto message = members->poll(0);
          if (!message) break;
          {
            std::lock_guard lock(mutex_);
            members_newest_ms_ = std::max(members_newest_ms_, message->timestamp_ms);
          }
          if (message->tombstone) continue;
          try {
            Member m = decode_member(message->value, options_.limits);
            if (m.role == Role::Merger && !m.endpoint.empty()) connect(m.endpoint);
            if (m.role == Role::Merger)
              for (size_t i = 0; i < m.owned_fragments.size(); ++i) {
                if (options_.limits.layout && m.owned_fragments[i] >= options_.limits.layout->num_fragments()) continue;
                if (!takes(m.owned_fragments[i])) continue;
                {
                  std::lock_guard lock(mutex_);
                  auto& heard = owner_heard_[m.owned_fragments[i]];
                  if (message->timestamp_ms >= heard.stamp_ms) heard = {message->timestamp_ms, m.announce_interval_s};
                }
                stall.announced(m.owned_fragments[i], m.fragment_versions[i], Clock::now());
                if (i < m.fragment_checksums.size())
                  announced_checksum[m.owned_fragments[i]] = {m.fragment_versions[i], m.fragment_checksums[i]};
              }
          } catch (const Rejection& e) {
            metrics_.add("members_rejected_total", 1);
          }
        }
        if (!members_caught_up_ && members->at_end()) {
          std::lock_guard lock(mutex_);
          members_caught_up_ = true;
        }
      } catch (const Error& e) {
        std::cerr << "learner: members topic: " << e.what() << "\n";
        members.reset();
      }
    }
    ask_for_gaps();
    auto received = subscriber.receive(std::chrono::milliseconds(50));
    if (uint64_t bytes = subscriber.bytes_received(); bytes != bytes_received_) {
      metrics_.add("params_bytes_received_total", static_cast<double>(bytes - bytes_received_));
      bytes_received_ = bytes;
    }
    if (!received) continue;
    try {
      if (received->round_open) {
        RoundOpen notice = decode_round_open(received->message, options_.limits);
        if (notice.fragment != received->fragment)
          throw Rejection(RejectReason::FragmentOutOfRange, "ZeroMQ topic and RoundOpen name different fragments");
        metrics_.add("round_opens_received_total", 1);
        std::lock_guard lock(mutex_);
        auto& slot = round_opens_[notice.fragment];
        if (notice.version >= slot.version) slot = std::move(notice);
        continue;
      }
      auto assembled = assembler.add(received->message);
      if (!assembled) {
        metrics_.add("params_segments_received_total", 1);
        arriving[received->fragment] = Clock::now();
        continue;  // a segment of a snapshot not yet complete
      }
      if (!assembled->update) arriving.erase(received->fragment);  // an update passes by a snapshot begun
      FragmentParams params = std::move(*assembled);
      if (params.fragment != received->fragment)
        throw Rejection(RejectReason::FragmentOutOfRange, "ZeroMQ topic says fragment " +
                                                               std::to_string(received->fragment) + ", message says " +
                                                               std::to_string(params.fragment));
      const uint32_t p = params.fragment;
      auto h = held.find(p);
      if (h != held.end() && (params.version < h->second->version ||
                              (params.version == h->second->version && params.checksum == h->second->checksum))) {
        metrics_.add("params_already_held_total", 1);  // a duplicate, or the optional republish
        continue;
      }
      const bool update = params.update;
      const size_t wire_bytes = params.wire_bytes;
      if (update) {
        if (h == held.end() || h->second->version != params.base_version) {
          // Missed the version this update applies to (or joined after it): a snapshot is needed.
          metrics_.add("params_updates_unusable_total", 1);
          want(p, detail::concat("an update from version ", params.base_version, " does not apply to the version held"));
          continue;
        }
        try {
          params = apply_fragment_update(*h->second, std::move(params));
        } catch (const Rejection& e) {
          want(p, std::string("an update was refused: ") + e.what());
          throw;
        }
      }
      ++received_;
      (update ? update_bytes_ : snapshot_bytes_) += wire_bytes;
      (update ? updates_ : snapshots_) += 1;
      metrics_.add("params_received_total", 1, {{"kind", update ? "update" : "snapshot"}});
      auto shared = std::make_shared<const FragmentParams>(std::move(params));
      held[p] = shared;
      wanted.erase(p);
      asks.satisfied(p);
      stall.arrived(p, shared->version, Clock::now());
      std::lock_guard lock(mutex_);
      auto& slot = latest_[p];
      if (!slot || shared->version >= slot->version) slot = std::move(shared);
    } catch (const Rejection& e) {
      arriving.erase(received->fragment);  // a lost segment: the snapshot is asked for again
      ++rejected_;
      metrics_.add("params_rejected_total", 1, {{"reason", reject_reason_name(e.reason)}});
    }
  } catch (const std::exception& e) {
    metrics_.add("inbox_errors_total", 1);
    if (Clock::now() - last_said >= std::chrono::minutes(1)) {
      last_said = Clock::now();
      std::cerr << "learner: parameter inbox: " << e.what() << " (going on)\n";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace diloco
