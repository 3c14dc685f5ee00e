// Publishes a learner's deltas and heartbeats to Kafka without ever blocking the training loop.
//
// One background thread owns the Kafka producer. submit() only swaps a pointer under a mutex:
// each fragment has one slot for the newest delta not yet handed to Kafka, and at most one delta
// per fragment is in flight inside the producer (a large one as chunks, in order). When the broker is slow or down, a newer delta
// of a fragment replaces the unsent older one (it contains the older one's progress, both being
// measured from the same anchor), so memory stays bounded at two deltas per fragment and training
// never waits. Heartbeats have one slot too: the newest wins.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/codec/messages.h"
#include "core/kafka/producer.h"
#include "core/kafka/topics.h"
#include "core/metrics/metrics.h"

namespace diloco {

struct DeltaPublisherOptions {
  ProducerOptions producer;
  RunTopics topics;
  int partitions = 1;  // NP: fragment p goes to partition p mod NP
  // A delta larger than this goes out as chunks (core/codec/chunk.h), all of one delta's pieces in
  // order before the next delta of that fragment; 0: never chunked.
  uint64_t chunk_bytes = 0;
};

struct OutgoingDelta {
  DeltaHeader header;
  std::vector<uint8_t> bytes;  // encoded Delta
};

struct PublisherStats {
  uint64_t submitted = 0;
  uint64_t superseded = 0;       // replaced in their slot before reaching Kafka
  uint64_t delivered = 0;        // acknowledged by Kafka (acks=all)
  uint64_t failed = 0;           // delivery failed for good
  uint64_t bytes_delivered = 0;  // payload bytes of delivered deltas
  uint64_t heartbeats_delivered = 0;
  int in_flight = 0;             // inside the producer, not yet acknowledged
  size_t waiting = 0;            // in slots, not yet handed to the producer
};

class DeltaPublisher {
 public:
  DeltaPublisher(DeltaPublisherOptions options, Metrics& metrics);
  ~DeltaPublisher();  // stops the thread without waiting for deliveries (see close())

  // Never blocks on I/O.
  void submit(OutgoingDelta delta);
  void submit_heartbeat(const std::string& instance_id, std::vector<uint8_t> member);

  PublisherStats stats() const;

  // Stops accepting, hands what waits to Kafka and waits up to `timeout` for acknowledgements.
  // Returns the deltas (fragment, seq) that were not acknowledged.
  std::vector<std::pair<uint32_t, uint64_t>> close(std::chrono::milliseconds timeout);

 private:
  void run();
  void hand_over_locked(Producer& producer);  // mutex_ held

  DeltaPublisherOptions options_;
  Metrics& metrics_;
  mutable std::mutex mutex_;
  std::map<uint32_t, OutgoingDelta> waiting_;              // fragment -> newest unsent
  // A delta handed to the producer piece by piece: at most one per fragment.
  struct Sending {
    DeltaHeader header;
    size_t bytes = 0;                           // the whole delta's
    std::vector<std::vector<uint8_t>> pieces;  // itself, or its chunks
    size_t next = 0;                            // pieces handed to the producer
    size_t acknowledged = 0;                    // delivery reports back
    bool failed = false;
  };
  std::map<uint32_t, Sending> in_flight_;       // fragment -> delta
  std::optional<std::pair<std::string, std::vector<uint8_t>>> heartbeat_;
  bool heartbeat_in_flight_ = false;
  PublisherStats stats_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> closing_{false};
  std::unique_ptr<Producer> producer_;
  std::thread thread_;
};

}  // namespace diloco
