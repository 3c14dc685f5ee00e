#include "merger/snapshot_requests.h"

#include <algorithm>

namespace diloco {

void SnapshotRequests::joined(const std::string& id) {
  std::erase_if(served_, [&](const auto& entry) { return entry.first.first == id; });
}

bool SnapshotRequests::want(const std::string& id, uint32_t p, bool owned) {
  if (!owned) return true;
  if (requested_.size() >= o_.max_pending && !requested_.count({id, p})) return false;
  requested_.insert({id, p});
  return true;
}

SnapshotRequests::Turn SnapshotRequests::serve(
    Clock::time_point t, const std::map<uint32_t, uint64_t>& versions, const std::function<uint64_t()>& queued,
    const std::function<Message(uint32_t)>& encode,
    const std::function<void(const std::string&, uint32_t, const Message&)>& send) {
  Turn turn;
  // Due requests by fragment, so that one encoding serves every subscriber asking for it.
  std::map<uint32_t, std::vector<std::string>> due;
  for (auto it = requested_.begin(); it != requested_.end();) {
    const auto& [id, p] = *it;
    const auto owned = versions.find(p);
    if (owned == versions.end()) {
      it = requested_.erase(it);
      continue;
    }
    const auto served = served_.find(*it);
    if (served == served_.end()) {
      due[p].push_back(id);
    } else if (served->second.version == owned->second &&
               (!served->second.queued.expired() || t - served->second.at < o_.resend)) {
      ++turn.coalesced;  // on its way, or sent a moment ago
      it = requested_.erase(it);
      continue;
    } else if (t - served->second.at >= o_.interval) {
      due[p].push_back(id);
    }
    ++it;
  }
  // Round robin from the fragment after the last one served: on a link that takes one snapshot
  // per turn, a fragment asked for again and again (a new version every few seconds) cannot
  // starve the others, as serving the lowest first did.
  std::vector<uint32_t> order;
  for (auto it = due.lower_bound(next_); it != due.end(); ++it) order.push_back(it->first);
  for (auto it = due.begin(); it != due.end() && it->first < next_; ++it) order.push_back(it->first);
  for (size_t i = 0; i < order.size(); ++i) {
    const uint32_t p = order[i];
    const auto& ids = due.at(p);
    if (queued() >= o_.queue_bytes) {
      for (size_t j = i; j < order.size(); ++j) turn.deferred += due.at(order[j]).size();
      break;
    }
    next_ = p + 1;
    const Message message = encode(p);
    for (const auto& id : ids) {
      send(id, p, message);
      ++turn.sent;
      if (message)
        for (const auto& part : *message) turn.bytes += part.size();
      served_[{id, p}] = Served{.at = t, .version = versions.at(p), .queued = message};
      requested_.erase({id, p});
    }
  }
  if (served_.size() > o_.max_pending) {
    const auto keep = std::max(o_.interval, o_.resend);
    std::erase_if(served_, [&](const auto& entry) {
      return t - entry.second.at >= keep && entry.second.queued.expired();
    });
  }
  return turn;
}

}  // namespace diloco
