#include "learner/refusal_watch.h"

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "core/kafka/consumer.h"
#include "core/metrics/metrics.h"

namespace diloco {

namespace {
constexpr int64_t kOffsetEnd = -1;  // librdkafka's RD_KAFKA_OFFSET_END
}

RefusalWatch::RefusalWatch(RefusalWatchOptions options, Metrics& metrics)
    : o_(std::move(options)), metrics_(metrics) {
  ConsumerOptions c{.kafka = o_.kafka};
  c.kafka.client_id = o_.learner_id + "-refusals";
  consumer_ = std::make_unique<Consumer>(c);
  std::vector<TopicPartitionOffset> assigned{{o_.topics.rejected(), 0, kOffsetEnd}};
  for (int p = 0; p < o_.partitions; ++p) assigned.push_back({o_.topics.merges(), p, kOffsetEnd});
  consumer_->assign(assigned);
}

RefusalWatch::~RefusalWatch() = default;

void RefusalWatch::report(const std::string& kind, const std::string& reason, const std::string& detail,
                          nlohmann::json where) {
  const bool refused = kind == "refused";
  (refused ? refused_ : dropped_) += 1;
  metrics_.add(refused ? "deltas_refused_total" : "deltas_dropped_total", 1, {{"reason", reason}});
  where["event"] = kind;
  where["reason"] = reason;
  where["detail"] = detail;
  if (o_.log) o_.log(where);
  // Superseded deltas are the normal life of an asynchronous learner (a newer delta replaced
  // one still pending): counted, never printed.
  if (!refused && reason == drop_reason_name(DropReason::Superseded)) return;
  const auto now = std::chrono::steady_clock::now();
  auto [it, first] = printed_.try_emplace(kind + "/" + reason, Printed{now, 0});
  if (!first && std::chrono::duration<double>(now - it->second.at).count() < o_.print_interval_s) {
    ++it->second.since;
    return;
  }
  std::string more;
  if (it->second.since > 0)
    more = detail::concat(" (and ", it->second.since, " more since the last such line)");
  it->second = Printed{now, 0};
  if (o_.say)
    o_.say(detail::concat(refused ? "a merger refused a delta of this learner: " : "a merger dropped a delta of this learner: ",
                          reason, ": ", detail, more));
}

void RefusalWatch::poll(int max_records) {
  for (int i = 0; i < max_records; ++i) {
    std::optional<ConsumedMessage> m;
    try {
      m = consumer_->poll(0);
    } catch (const Error&) {
      metrics_.add("refusal_watch_errors_total", 1);
      return;  // the broker's trouble shows in the publisher and the inbox; try again next step
    }
    if (!m || m->tombstone) {
      if (!m) return;
      continue;
    }
    try {
      if (m->topic == o_.topics.rejected()) {
        RejectedInput r = decode_rejected(m->value, o_.limits);
        if (r.sender != o_.learner_id) continue;
        // A proposal of version 0 that another learner's beat (learners that start together):
        // this learner trains on the winner's version 0, and no delta of it was refused.
        if (r.source.topic == o_.topics.genesis() && r.reason == "genesis_exists") continue;
        report("refused", r.reason, r.detail,
               {{"rejected_by", r.rejected_by}, {"topic", r.source.topic}, {"partition", r.source.partition},
                {"offset", r.source.offset}});
        continue;
      }
      MergeRecord record = decode_merge_record(m->value, o_.limits);
      for (const auto& d : record.dropped) {
        if (d.delta.learner_id != o_.learner_id) continue;
        const bool invalid = d.reason == DropReason::Invalid;
        report(invalid ? "refused" : "dropped", drop_reason_name(d.reason), d.detail,
               {{"fragment", record.fragment}, {"version", record.version}, {"seq", d.delta.seq},
                {"merger", record.merger_instance}});
      }
    } catch (const Rejection&) {
      metrics_.add("refusal_watch_undecodable_total", 1);  // not this learner's business to judge
    }
  }
}

}  // namespace diloco
