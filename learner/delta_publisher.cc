#include "learner/delta_publisher.h"

#include <iostream>

#include "core/codec/chunk.h"
#include "core/errors.h"
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
    if (it == in_flight_.end()) return;
    Sending& sending = it->second;
    ++sending.acknowledged;
    sending.failed = sending.failed || !report.ok;
    if (sending.acknowledged < sending.pieces.size()) return;  // the delta's other pieces are on their way
    const size_t bytes = sending.bytes;
    const bool ok = !sending.failed;
    in_flight_.erase(it);
    if (ok) {
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
  // A waiting delta starts once its fragment has nothing in flight.
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (in_flight_.count(it->first)) {
      ++it;
      continue;
    }
    OutgoingDelta& delta = it->second;
    Sending sending{.header = delta.header, .bytes = delta.bytes.size()};
    sending.pieces = options_.chunk_bytes == 0
                         ? std::vector<std::vector<uint8_t>>{std::move(delta.bytes)}
                         : split_message(std::move(delta.bytes),
                                         ChunkId{delta.header.run_id, delta.header.learner_id, delta.header.fragment,
                                                 delta.header.seq},
                                         options_.chunk_bytes);
    in_flight_[it->first] = std::move(sending);
    it = waiting_.erase(it);
  }
  // Pieces go to the producer in order, as far as its queue takes them. A piece the producer
  // refuses for good (larger than the broker takes) fails its whole delta: it is dropped and
  // counted, and the thread goes on with the others.
  for (auto entry = in_flight_.begin(); entry != in_flight_.end();) {
    auto& [fragment, sending] = *entry;
    bool refused = false;
    while (sending.next < sending.pieces.size()) {
      Headers headers = delta_headers(sending.header);
      if (sending.pieces.size() > 1)
        headers.emplace_back("chunk", std::to_string(sending.next) + "/" + std::to_string(sending.pieces.size()));
      Record record{.topic = options_.topics.deltas(sending.header.region),
                    .partition = static_cast<int32_t>(fragment % static_cast<uint32_t>(options_.partitions)),
                    .key = std::to_string(fragment),
                    .value = sending.pieces[sending.next],
                    .headers = std::move(headers)};
      try {
        if (producer.try_produce(record, fragment) == Producer::Enqueue::QueueFull) break;
      } catch (const InvalidInput& e) {
        std::cerr << "learner: the delta of fragment " << fragment << " seq " << sending.header.seq
                  << " cannot be sent, dropped: " << e.what() << "\n";
        refused = true;
        break;
      }
      std::vector<uint8_t>().swap(sending.pieces[sending.next]);  // the producer has its copy
      ++sending.next;
    }
    // Pieces already handed over would still be acknowledged; only a first piece is ever refused
    // (they are all of one size), so nothing of the delta is in the producer.
    if (refused && sending.next == 0) {
      ++stats_.failed;
      metrics_.add("deltas_failed_total", 1);
      entry = in_flight_.erase(entry);
      continue;
    }
    ++entry;
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
  // Whatever goes wrong here must not end the learner (an exception leaving a thread terminates
  // the process): it is counted, said at most once a minute, and the loop goes on.
  auto last_said = std::chrono::steady_clock::now() - std::chrono::hours(1);
  while (!stop_) {
    try {
      {
        std::lock_guard lock(mutex_);
        hand_over_locked(*producer_);
      }
      producer_->poll(20);
    } catch (const std::exception& e) {
      metrics_.add("publisher_errors_total", 1);
      if (std::chrono::steady_clock::now() - last_said >= std::chrono::minutes(1)) {
        last_said = std::chrono::steady_clock::now();
        std::cerr << "learner: publisher: " << e.what() << " (going on)\n";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
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
  for (const auto& [fragment, entry] : in_flight_) undelivered.emplace_back(fragment, entry.header.seq);
  for (const auto& [fragment, delta] : waiting_) undelivered.emplace_back(fragment, delta.header.seq);
  return undelivered;
}

}  // namespace diloco
