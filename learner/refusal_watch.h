// What the mergers did with this learner's deltas that it would not otherwise hear of: the deltas
// a merge record lists as dropped (diloco.R.merges: superseded, too stale, invalid, pending at a
// stop) and the inputs a merger rejected that name this learner as their sender
// (diloco.R.rejected), but not its proposals of version 0 that another learner's beat
// (genesis_exists). A learner whose deltas are refused (its tokens above what it announced,
// a norm far above the others', a malformed message) learns why instead of training for nothing:
// each refusal is counted (deltas_refused_total{reason}, deltas_dropped_total{reason}), written to
// metrics.jsonl as a `refused` or `dropped` line, and printed: the first of each reason at once,
// then at most one line per reason every `print_interval_s`, with the count since.
//
// Polled on the learner's thread between steps (poll() never waits); reads from the end of both
// topics as they stand when it starts, so only what happens from then on is reported.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "core/codec/messages.h"
#include "core/kafka/options.h"
#include "core/kafka/topics.h"

namespace diloco {

class Consumer;
class Metrics;

struct RefusalWatchOptions {
  KafkaOptions kafka;
  RunTopics topics;
  int partitions = 1;  // of the merges topic
  std::string learner_id;
  DecodeLimits limits;
  double print_interval_s = 60;
  std::function<void(const std::string&)> say;     // one line to the operator (stderr)
  std::function<void(nlohmann::json)> log;         // one line into metrics.jsonl
};

class RefusalWatch {
 public:
  // Assigns the topics at their ends; throws like Consumer::assign when a topic is missing.
  RefusalWatch(RefusalWatchOptions options, Metrics& metrics);
  ~RefusalWatch();
  RefusalWatch(const RefusalWatch&) = delete;
  RefusalWatch& operator=(const RefusalWatch&) = delete;

  // Reads what arrived (at most `max_records`), never waiting.
  void poll(int max_records = 256);

  // Deltas of this learner dropped by merges (any reason), and inputs rejected or dropped as
  // invalid: refused, the ones that mean something is wrong with this learner.
  uint64_t dropped() const { return dropped_; }
  uint64_t refused() const { return refused_; }

 private:
  void report(const std::string& kind, const std::string& reason, const std::string& detail, nlohmann::json where);

  RefusalWatchOptions o_;
  Metrics& metrics_;
  std::unique_ptr<Consumer> consumer_;
  uint64_t dropped_ = 0;
  uint64_t refused_ = 0;
  struct Printed {
    std::chrono::steady_clock::time_point at;
    uint64_t since = 0;  // not printed since `at`
  };
  std::map<std::string, Printed> printed_;  // by reason
};

}  // namespace diloco
