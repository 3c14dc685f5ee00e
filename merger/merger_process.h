// diloco-merger as a process: a member of the run's merger consumer group that owns whole
// fragments (range assignor over co-partitioned delta topics), runs one FragmentMerger per owned
// fragment, commits every merge exactly once (MergeRecord + FragmentState + consumed offsets in
// one Kafka transaction) and only then publishes the new fragment on ZeroMQ.
//
// Threading: one thread does everything (poll, decode, merge, commit, publish), so the merge
// order is the consumption order and nothing races on state; rebalance callbacks run inside poll.
#pragma once

#include <atomic>
#include <string>

#include "core/config/run_config.h"
#include "core/kafka/options.h"

namespace diloco {

struct MergerOptions {
  RunConfig config;
  std::string instance_id = "merger-0";  // stable across restarts: it is the transactional id
  KafkaOptions kafka;
  std::string bind = "tcp://127.0.0.1:*";  // ZeroMQ PUB endpoint to bind
  std::string advertise;                   // endpoint announced to learners (default: as bound)
  std::string run_dir;                     // metrics.jsonl goes here (empty: no file)
  int metrics_port = 0;
  double announce_interval_s = 2;
  int session_timeout_ms = 10000;
};

// Runs until `stop`; returns the exit code (0 after a clean stop, 4 when fenced by a newer
// instance). Throws InvalidInput / Unavailable for bad configs or no broker at start-up.
int run_merger(const MergerOptions& options, const std::atomic<bool>& stop);

}  // namespace diloco
