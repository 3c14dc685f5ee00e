#include "learner/resume.h"

#include <algorithm>

namespace diloco {

ResumePoint resume_point(const std::string& self, std::span<const MemberRecord> records, int64_t liveness_ms,
                         bool align_to_peers) {
  std::map<std::string, const MemberRecord*> newest;
  int64_t now = 0;
  for (const auto& r : records) {
    now = std::max(now, r.stamp_ms);
    if (r.member)
      newest[r.key] = &r;
    else
      newest.erase(r.key);
  }
  ResumePoint out;
  std::optional<uint64_t> slowest_peer;
  std::optional<uint64_t> own;
  for (const auto& [key, r] : newest) {
    const Member& m = *r->member;
    const bool live = !m.leaving && now - r->stamp_ms <= liveness_ms;
    if (m.role == Role::Learner && key == self) {
      own = m.step;
    } else if (m.role == Role::Learner && live) {
      ++out.live_peers;
      slowest_peer = std::min(slowest_peer.value_or(m.step), m.step);
    } else if (m.role == Role::Merger && live) {
      for (size_t i = 0; i < m.owned_fragments.size() && i < m.fragment_versions.size(); ++i) {
        auto& v = out.versions[m.owned_fragments[i]];
        v = std::max(v, m.fragment_versions[i]);
      }
    }
  }
  if (!own) return out;  // new to the run: step 0, whatever the peers do
  out.restarted = true;
  out.step = *own;
  if (align_to_peers && slowest_peer) out.step = *slowest_peer > 0 ? *slowest_peer - 1 : 0;
  return out;
}

}  // namespace diloco
