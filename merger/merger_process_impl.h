// The merger process behind run_merger (merger/merger_process.h): its Kafka and ZeroMQ driver.
// Its bookkeeping (ownership, consumed offsets, recovery, stop) is a ProcessState
// (merger/process_state.h), whose transitions tests drive without a broker; this class does the
// I/O around them.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include "core/fragments/message_budget.h"
#include "core/kafka/consumer.h"
#include "core/kafka/log_reader.h"
#include "core/kafka/producer.h"
#include "core/kafka/topics.h"
#include "core/metrics/metrics.h"
#include "core/parallel.h"
#include "core/zmq/params_channel.h"
#include "merger/fragment_merger.h"
#include "merger/grace_window.h"
#include "merger/log_writer.h"
#include "merger/membership.h"
#include "merger/merger_process.h"
#include "merger/process_state.h"
#include "merger/recovery.h"
#include "merger/snapshot_requests.h"

namespace diloco {

// How one round of a fragment went: from its first pending delta to the quorum, the grace spent
// after it, and the live learners the merge did not include.
struct RoundTiming {
  double quorum_seconds = 0;
  double grace_seconds = 0;
  std::vector<std::string> missed;
};

class MergerProcess : public RebalanceListener {
 public:
  using Clock = std::chrono::steady_clock;

  MergerProcess(const MergerOptions& options, const std::atomic<bool>& stop);
  int run();

  void on_assigned(const std::vector<TopicPartitionOffset>& partitions) override;
  void on_revoked(const std::vector<TopicPartitionOffset>& partitions) override;

 private:
  double now() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  // What a message must be: with the run's layout once known; before it (no learner's proposal
  // committed yet), only proposals are expected, which carry their own layout.
  DecodeLimits limits() const {
    if (layout_) return run_decode_limits(o_.config, *layout_);
    return DecodeLimits{.run_id = o_.config.run.id, .max_message_bytes = kMaxLogicalMessageBytes,
                        .max_decompressed_bytes = kMaxLogicalMessageBytes};
  }
  uint64_t fingerprint() const { return layout_ ? layout_->fingerprint : 0; }
  LogContext log_context() const {
    if (!log_reader_) log_reader_ = std::make_shared<LogReader>(o_.kafka);
    return LogContext{.kafka = o_.kafka, .topics = topics_, .config = &o_.config, .layout = layout_,
                      .limits = limits(), .pool = &pool_, .reader = log_reader_};
  }
  // The norm bound; a delta's tokens are bounded by its own learner's announcement
  // (Membership::declared, passed to each offer) and the decoder's limit.
  InputBounds input_bounds() const { return InputBounds{.max_norm_ratio = o_.config.merger.max_norm_ratio}; }
  void adopt_layout(std::shared_ptr<const FragmentLayout> layout);
  int transaction_timeout() const;
  void make_writer(int timeout_ms);
  KafkaOptions writer_kafka_;  // the options of the transactional producer (client id: the instance id)
  void handle_proposal(const ConsumedMessage& message);
  void abandon_merge(uint32_t p, MergePlan& plan, const std::string& reason);
  void recover(const std::set<int32_t>& partitions);
  bool ensure_recovered();
  bool consume(int timeout_ms);
  std::optional<int64_t> unread(const std::pair<std::string, int32_t>& tp, int64_t next);
  bool backlog();
  void catch_up();
  void handle_delta(ConsumedMessage record);
  void reject_chunks(const std::vector<ChunkProblem>& problems);
  // The writes of one fragment's checkpoint: one record keyed by the fragment id, or, when it
  // is larger than codec.chunk_bytes, its pieces keyed "<fragment>/<index>" (the topic is
  // compacted by key, so each piece must keep its own key until the next checkpoint replaces it).
  void add_state_write(std::vector<LogWrite>& writes, const FragmentState& state);
  // `sender`: the learner id the input names, when a header could be read (its learner reads
  // its own refusals from `rejected` by it).
  void reject(const ConsumedMessage& message, const std::string& reason, const std::string& detail,
              const std::string& sender = {});
  void reject(const LogPosition& at, size_t payload_size, const std::vector<uint8_t>& head, const std::string& reason,
              const std::string& detail, const std::string& sender = {});
  void merge(uint32_t p, const std::vector<std::string>& live);
  RoundTiming round_timing(const FragmentMerger& merger, const MergePlan& plan,
                           const std::vector<std::string>& live) const;
  void commit(uint32_t p, MergeRecord& record, bool write_state);
  void publish(uint32_t p);  // a snapshot of the current version, to every subscriber
  SnapshotRequests::Message snapshot_message(uint32_t p) const;
  void publish_update(uint32_t p);
  void serve_requests();
  void announce_round(uint32_t p);
  void follow_members();
  void announce(bool leaving);
  void stop_fragments(const StopWrites& stop);
  MergeRecord accounting_record(uint32_t p, std::vector<DroppedDelta> dropped) const;
  void log(nlohmann::json record);
  void injected_fault();
  void send_plain(const Record& record);
  void plain_failed(const std::string& topic, const std::string& why);

  const MergerOptions& o_;
  const MergerTimeouts& t_;
  const MergerFaults faults_ = MergerFaults::from_environment();
  mutable WorkPool pool_;  // shares each merge's arithmetic (live merges and recovery)
  // Every recovery's reads of the logs, through one consumer made at the first recovery.
  mutable std::shared_ptr<LogReader> log_reader_;
  int faults_fired_ = 0;  // injected faults so far (MergerFaults)
  // The run's model layout: from the checkpoints in `state`, or from the first proposal of version
  // 0 this merger commits; null until then (the merger holds no model of its own).
  std::shared_ptr<const FragmentLayout> layout_;
  RunTopics topics_;
  Metrics metrics_{"diloco_merger_"};
  std::unique_ptr<JsonLines> log_;
  std::unique_ptr<MetricsEndpoint> endpoint_;
  Clock::time_point start_ = Clock::now();
  uint64_t epoch_ = 0;
  std::string advertised_;
  GraceWindow grace_;
  // Ownership, consumed offsets, recovery and stop: what the loop decides by (merger/process_state.h).
  ProcessState book_;
  Membership membership_;
  zmq::context_t zmq_{1};
  std::unique_ptr<ParamsPublisher> publisher_;
  SnapshotRequests snapshots_;
  std::unique_ptr<Consumer> consumer_;
  std::unique_ptr<LogWriter> writer_;
  struct Said {
    Clock::time_point at = Clock::now() - std::chrono::hours(1);
    uint64_t since = 0;
  };
  std::map<std::string, Said> plain_said_;  // per topic: the last report of a lost record
  std::unique_ptr<Producer> plain_;  // after what its delivery callback uses: destroyed first
  std::unique_ptr<Consumer> members_;
  // Per fragment, the pieces its newest checkpoint in `state` went out in (the next one's
  // leftover keys get tombstones: LogWrite::replaces_pieces).
  std::map<uint32_t, uint64_t> state_pieces_;
  // `members` read since the start, and whether its end (as of then) was reached.
  uint64_t members_records_ = 0;
  bool members_read_ = false;
  Clock::time_point members_since_ = Clock::now();
};

}  // namespace diloco
