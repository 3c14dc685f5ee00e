// diloco-merger as a process: a member of the run's merger consumer group that owns whole
// fragments (range assignor over co-partitioned delta topics), runs one FragmentMerger per owned
// fragment, commits every merge exactly once (MergeRecord + FragmentState + consumed offsets in
// one Kafka transaction: merger/log_writer.h) and only then publishes the new fragment on ZeroMQ.
// Membership and liveness are merger/membership.h, rebuilding from the logs merger/recovery.h.
// The process is MergerProcess (merger/merger_process_impl.h); what its loop decides by (owned
// fragments, consumed offsets, recovery, stop) is merger/process_state.h, free of I/O.
//
// Threading: one thread does everything (poll, decode, merge, commit, publish), so the merge
// order is the consumption order and nothing races on state; rebalance callbacks run inside poll.
#pragma once

#include <atomic>
#include <string>

#include "core/config/run_config.h"
#include "core/kafka/options.h"

namespace diloco {

// Every wait of the merger's loop, by name (milliseconds unless said).
struct MergerTimeouts {
  int poll_idle_ms = 200;       // consumer poll while no fragment is owned
  int poll_owned_ms = 5;        // consumer poll while fragments are owned (merges are due)
  // Catching up: while the owned partitions' high watermarks (from the last fetches) are above
  // what was read (a backlog, e.g. after an outage), the merger keeps reading, up to catch_up_ms
  // per loop turn, before it merges, so that a learner's newest delta on a base is the one merged
  // and not the oldest.
  int catch_up_poll_ms = 50;
  int catch_up_ms = 2000;
  int metadata_ms = 10000;      // partition counts at start-up
  int init_transactions_ms = 60000;
  int produce_ms = 30000;       // queueing a message when the producer's queue is full
  int record_ack_ms = 60000;    // the merge record's delivery (the checkpoint names its offset)
  int send_offsets_ms = 30000;
  int commit_ms = 60000;
  int abort_ms = 30000;
  int committed_offsets_ms = 10000;  // the group's committed offsets, to rewind after a failure
  int recovery_retry_ms = 1000;
  int status_ms = 5000;
  // Answering subscribers that ask for the current version of a fragment (a subscriber that
  // connects, or one that missed a version): requests for one fragment are coalesced into at most
  // one publish per snapshot_interval_ms, so a burst of joins or a hostile subscriber costs little.
  int snapshot_interval_ms = 250;
  // The same version of a fragment goes to the same subscriber again only this long after it was
  // sent (and once it has left the queue), unless the subscriber reconnected: its asks while a
  // large snapshot is still arriving or being decoded are not answered twice.
  int snapshot_resend_ms = 5000;
  int drain_ms = 5000;          // at a clean stop, reading deltas already in Kafka
  int drain_quiet_ms = 500;
  int flush_ms = 5000;
  // A chunked delta with no new piece for this long is given up (rejected as chunk_missing): its
  // learner died mid-message, and the consumer offset it holds back must move on.
  int chunk_expiry_ms = 300000;
};

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
  // Joins the group as a static member under instance_id (core/kafka/consumer.h): restarted
  // after a crash, it takes its fragments back at once instead of after the session timeout.
  // The cost: a clean stop hands its fragments to the others only when its session times out.
  bool static_membership = true;
  // Threads that share a merge's arithmetic (0: one per hardware thread). The result has the same
  // bits for any number (merge_step.h).
  unsigned merge_threads = 0;
  // Snapshots handed to ZeroMQ and not yet sent are held in memory (about 3.4 bytes per
  // parameter of a fragment each): past this many bytes queued, further snapshot requests wait.
  uint64_t snapshot_queue_bytes = 512ull << 20;
  MergerTimeouts timeouts;
};

// Fault injection for tests, from the environment (0: off): DILOCO_FAULT_FAIL_COMMIT=N makes the
// Nth merge commit of the process fail after its records are produced (the transaction is
// aborted), DILOCO_FAULT_FAIL_RECOVERY=N makes the Nth recovery fail as if the broker were away,
// DILOCO_FAULT_FAIL_REWIND=N makes the Nth rewind to the committed offsets fail after it moved
// the consumer (the loop rebuilds and rewinds again), DILOCO_FAULT_STOP_AT=N sends the process
// SIGTERM at the instant its Nth injected fault fires (a stop timed inside a failure).
struct MergerFaults {
  int fail_commit = 0;
  int fail_recovery = 0;
  int fail_rewind = 0;  // the Nth rewind fails after its seeks (the consumer has moved)
  int stop_at = 0;      // SIGTERM at the Nth injected fault, before it is thrown
  // N > 0: the producer of `rejected` and `members` queues at most N records and holds each for
  // a second, so a burst overflows it.
  int plain_queue = 0;
  static MergerFaults from_environment();
};

// Runs until `stop`; returns the exit code (0 after a clean stop, 4 when fenced by a newer
// instance). Throws InvalidInput / Unavailable for bad configs or no broker at start-up.
int run_merger(const MergerOptions& options, const std::atomic<bool>& stop);

}  // namespace diloco
