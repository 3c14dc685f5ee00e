#include "merger/log_writer.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/errors.h"

namespace diloco {

int transaction_timeout_ms(uint64_t bytes, double base_seconds, double min_bytes_per_s) {
  DILOCO_ENFORCE(base_seconds > 0 && min_bytes_per_s > 0, "transaction timeout of ", base_seconds, " s at ",
                 min_bytes_per_s, " bytes/s");
  const double ms = 1000.0 * (base_seconds + static_cast<double>(bytes) / min_bytes_per_s);
  return static_cast<int>(std::min(std::ceil(ms), static_cast<double>(kMaxTransactionTimeoutMs)));
}

uint64_t largest_transaction_bytes(const FragmentLayout& layout, bool residual, bool outer_state) {
  const uint64_t copies = 2 + (residual ? 1 : 0) + (outer_state ? 1 : 0);  // params and momentum always
  return copies * sizeof(float) * static_cast<uint64_t>(layout.numel());
}

LogWriter::LogWriter(const KafkaOptions& kafka, const std::string& transactional_id, const MergerTimeouts& timeouts,
                     int transaction_timeout_ms, int fail_commit_at, std::function<void()> on_failed_delivery,
                     std::function<void()> on_injected_fault)
    : t_(timeouts),
      transaction_timeout_ms_(transaction_timeout_ms),
      fail_commit_at_(fail_commit_at),
      on_failed_delivery_(std::move(on_failed_delivery)),
      on_injected_fault_(std::move(on_injected_fault)) {
  // The waits inside a transaction are at least as long as the transaction may take.
  t_.produce_ms = std::max(t_.produce_ms, transaction_timeout_ms);
  t_.commit_ms = std::max(t_.commit_ms, transaction_timeout_ms);
  t_.record_ack_ms = std::max(t_.record_ack_ms, transaction_timeout_ms);
  // As short as the largest transaction allows: an instance killed mid-transaction holds back
  // read_committed readers of merges/state (a successor's recovery) until the broker aborts it.
  ProducerOptions options{.kafka = kafka, .transactional_id = transactional_id,
                          .transaction_timeout_ms = transaction_timeout_ms};
  producer_ = std::make_unique<Producer>(options, [this](const DeliveryReport& r) {
    if (!r.ok && on_failed_delivery_) on_failed_delivery_();
    delivered_[r.token] = r;
  });
  producer_->init_transactions(t_.init_transactions_ms);
}

std::vector<std::string> stale_piece_keys(const std::string& key, uint64_t before, uint64_t now) {
  std::vector<std::string> keys;
  if (before == 0 || before == now) return keys;
  if (before == 1) return {key};  // the earlier value was whole; the new one is in pieces
  for (uint64_t i = now == 1 ? 0 : now; i < before; ++i) keys.push_back(key + "/" + std::to_string(i));
  return keys;
}

std::optional<LogPosition> LogWriter::commit(std::span<const LogWrite> writes,
                                             const std::vector<TopicPartitionOffset>& offsets, Consumer& consumer,
                                             bool merge) {
  delivered_.clear();
  producer_->begin_transaction();
  const uint64_t first = next_token_;
  records_written_.clear();
  for (const auto& w : writes) {
    uint64_t records = 0;
    auto produce = [&](const std::string& key, std::span<const uint8_t> value) {
      producer_->produce({.topic = w.topic, .partition = w.partition, .key = key, .value = value}, next_token_++,
                         t_.produce_ms);
      ++records;
    };
    if (!w.chunk_id) {
      produce(w.key, w.value);
    } else if (w.segments) {
      w.segments([&](uint32_t, uint32_t, std::span<const uint8_t> segment) {
        for_each_piece(segment, *w.chunk_id, w.chunk_bytes, [&](uint32_t, uint32_t, std::span<const uint8_t> piece) {
          produce(w.key + "/" + std::to_string(records), piece);
        });
      });
    } else {
      for_each_piece(w.value, *w.chunk_id, w.chunk_bytes, [&](uint32_t i, uint32_t count, std::span<const uint8_t> piece) {
        produce(count == 1 ? w.key : w.key + "/" + std::to_string(i), piece);
      });
    }
    records_written_.push_back(records);
    if (w.chunk_id)
      for (const auto& key : stale_piece_keys(w.key, w.replaces_pieces, records))
        producer_->produce({.topic = w.topic, .partition = w.partition, .key = key, .value = {}}, next_token_++,
                           t_.produce_ms);
  }
  if (merge && ++merge_commits_ == fail_commit_at_) {
    if (on_injected_fault_) on_injected_fault_();
    throw Error("fault injection: commit " + std::to_string(merge_commits_) + " fails");
  }
  if (!offsets.empty()) producer_->send_offsets_to_transaction(offsets, consumer.raw(), t_.send_offsets_ms);
  producer_->commit_transaction(t_.commit_ms);
  if (writes.empty()) return std::nullopt;
  // Committed, so every message of it was delivered; the report may still be on its way.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(t_.record_ack_ms);
  while (!delivered_.count(first) && std::chrono::steady_clock::now() < deadline) producer_->poll(10);
  auto it = delivered_.find(first);
  if (it == delivered_.end() || !it->second.ok) return std::nullopt;
  return LogPosition{it->second.topic, it->second.partition, it->second.offset};
}

void LogWriter::abort() {
  try {
    producer_->abort_transaction(t_.abort_ms);
  } catch (const Fenced&) {
    throw;
  } catch (const Error&) {
    // Nothing open, or the broker is away: the recovery that follows waits for it.
  }
}

}  // namespace diloco
