#include "learner/delta_publisher.h"

#include "core/kafka/delta_headers.h"

namespace diloco {

namespace {
constexpr uint64_t kHeartbeatToken = ~0ull;
}

DeltaPublisher::DeltaPublisher(DeltaPublisherOptions options, Metrics& metrics)
    : options_(std::move(options)), metrics_(metrics) {
  producer_ = std::make_unique<Producer>(options_.producer, [this](const DeliveryReport& report) {
    // Runs on the publisher thread inside poll()/flush().
    std::lock_guard lock(mutex_);
    if (report.token == kHeartbeatToken) {
      heartbeat_in_flight_ = false;
      if (report.ok) ++stats_.heartbeats_delivered;
      return;
    }
    uint32_t fragment = static_cast<uint32_t>(report.token);
    auto it = in_flight_.find(fragment);
    size_t bytes = it == in_flight_.end() ? 0 : it->second.second;
    if (it != in_flight_.end()) in_flight_.erase(it);
    if (report.ok) {
      ++stats_.delivered;
      stats_.bytes_delivered += bytes;
      metrics_.add("deltas_delivered_total", 1);
      metrics_.add("bytes_sent_total", static_cast<double>(bytes));
    } else {
      ++stats_.failed;
      metrics_.add("deltas_failed_total", 1);
    }
  });
  thread_ = std::thread([this] { run(); });
}

DeltaPublisher::~DeltaPublisher() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void DeltaPublisher::submit(OutgoingDelta delta) {
  std::lock_guard lock(mutex_);
  if (closing_) return;
  ++stats_.submitted;
  uint32_t fragment = delta.header.fragment;
  auto [it, inserted] = waiting_.try_emplace(fragment);
  if (!inserted) {
    ++stats_.superseded;
    metrics_.add("deltas_superseded_total", 1);
  }
  it->second = std::move(delta);
}

void DeltaPublisher::submit_heartbeat(const std::string& instance_id, std::vector<uint8_t> member) {
  std::lock_guard lock(mutex_);
  if (closing_) return;
  heartbeat_ = std::make_pair(instance_id, std::move(member));
}

PublisherStats DeltaPublisher::stats() const {
  std::lock_guard lock(mutex_);
  PublisherStats out = stats_;
  out.in_flight = static_cast<int>(in_flight_.size());
  out.waiting = waiting_.size();
  return out;
}

void DeltaPublisher::hand_over_locked(Producer& producer) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    uint32_t fragment = it->first;
    if (in_flight_.count(fragment)) {
      ++it;
      continue;
    }
    const OutgoingDelta& delta = it->second;
    Record record{.topic = options_.topics.deltas(delta.header.region),
                  .partition = static_cast<int32_t>(fragment % static_cast<uint32_t>(options_.partitions)),
                  .key = std::to_string(fragment),
                  .value = delta.bytes,
                  .headers = delta_headers(delta.header)};
    if (producer.try_produce(record, fragment) == Producer::Enqueue::QueueFull) break;
    in_flight_[fragment] = {delta.header.seq, delta.bytes.size()};
    it = waiting_.erase(it);
  }
  if (heartbeat_ && !heartbeat_in_flight_) {
    Record record{.topic = options_.topics.members(), .partition = 0, .key = heartbeat_->first,
                  .value = heartbeat_->second};
    if (producer.try_produce(record, kHeartbeatToken) == Producer::Enqueue::Ok) {
      heartbeat_in_flight_ = true;
      heartbeat_.reset();
    }
  }
}

void DeltaPublisher::run() {
  while (!stop_) {
    {
      std::lock_guard lock(mutex_);
      hand_over_locked(*producer_);
    }
    producer_->poll(20);
  }
}

std::vector<std::pair<uint32_t, uint64_t>> DeltaPublisher::close(std::chrono::milliseconds timeout) {
  closing_ = true;
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  auto deadline = std::chrono::steady_clock::now() + timeout;
  // Hand over what waits (each fragment's in-flight delta must be acknowledged first).
  while (std::chrono::steady_clock::now() < deadline) {
    {
      std::lock_guard lock(mutex_);
      hand_over_locked(*producer_);
      if (waiting_.empty() && in_flight_.empty()) break;
    }
    producer_->poll(20);
  }
  std::lock_guard lock(mutex_);
  std::vector<std::pair<uint32_t, uint64_t>> undelivered;
  for (const auto& [fragment, entry] : in_flight_) undelivered.emplace_back(fragment, entry.first);
  for (const auto& [fragment, delta] : waiting_) undelivered.emplace_back(fragment, delta.header.seq);
  return undelivered;
}

}  // namespace diloco
