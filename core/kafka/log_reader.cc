#include "core/kafka/log_reader.h"

#include <librdkafka/rdkafkacpp.h>

#include <chrono>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "core/errors.h"
#include "core/kafka/chunk_assembler.h"

namespace diloco {

namespace {

// The end of a partition is only reported after an empty fetch, so a short fetch wait makes
// reading a short log fast (recovery, start-up, replay).
ConsumerOptions log_reader_options(const KafkaOptions& options) {
  ConsumerOptions consumer_options;
  consumer_options.kafka = options;
  consumer_options.kafka.extra.emplace_back("fetch.wait.max.ms", "10");
  return consumer_options;
}

using Clock = std::chrono::steady_clock;

}  // namespace

// One read's assignment: assigned on construction, unassigned when the read ends (also when it
// throws), so that nothing is fetched between reads and no message of one read reaches the next.
class LogReader::Assignment {
 public:
  Assignment(LogReader& reader, const std::vector<TopicPartitionOffset>& partitions) : reader_(reader) {
    reader_.consumer_.assign(partitions);
    ++reader_.reads_;
  }
  ~Assignment() {
    try {
      reader_.consumer_.unassign();
    } catch (const std::exception&) {
      // The next assign() replaces the assignment anyway.
    }
  }
  Assignment(const Assignment&) = delete;
  Assignment& operator=(const Assignment&) = delete;

 private:
  LogReader& reader_;
};

LogReader::LogReader(const KafkaOptions& options) : consumer_(log_reader_options(options)) {}

std::pair<int64_t, int64_t> LogReader::watermarks(const std::string& topic, int32_t partition, int timeout_ms) {
  return consumer_.watermarks(topic, partition, timeout_ms);
}

std::vector<std::pair<std::string, int>> LogReader::list_topics(int timeout_ms) {
  return consumer_.list_topics(timeout_ms);
}

int LogReader::partition_count(const std::string& topic, int timeout_ms) {
  return consumer_.partition_count(topic, timeout_ms);
}

std::vector<UnstablePartition> LogReader::wait_until_stable(const std::vector<TopicPartitionOffset>& partitions,
                                                           int timeout_ms) {
  std::vector<UnstablePartition> unstable;
  if (partitions.empty()) return unstable;
  // Since librdkafka 1.7.1 the watermark query honours isolation.level: the read_committed
  // consumer is told the last stable offset, a read_uncommitted one the high watermark.
  if (!uncommitted_) {
    ConsumerOptions options = consumer_.options();
    options.read_committed = false;
    uncommitted_ = std::make_unique<Consumer>(options);
  }
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    unstable.clear();
    for (const auto& tp : partitions) {
      // Every query shares the one deadline (at least a second each, so that a partition whose
      // query fails says so rather than being reported unstable).
      const int left = std::max<int>(1000, static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                              deadline - Clock::now()).count()));
      const int64_t high = uncommitted_->watermarks(tp.topic, tp.partition, left).second;
      const int64_t stable = consumer_.watermarks(tp.topic, tp.partition, left).second;
      if (stable < high) unstable.push_back({tp.topic, tp.partition, stable, high});
    }
    if (unstable.empty() || Clock::now() >= deadline) return unstable;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

std::optional<int64_t> LogReader::offset_at_time(const std::string& topic, int32_t partition, int64_t ms,
                                                 int timeout_ms) {
  return consumer_.offset_at_time(topic, partition, ms, timeout_ms);
}

void LogReader::read_to_end(const std::vector<TopicPartitionOffset>& starts,
                            const std::function<void(const ConsumedMessage&)>& on_message, int timeout_ms,
                            const DecodeLimits* chunks, const OnChunkProblem& on_problem) {
  if (starts.empty()) return;
  // Start at the low watermark rather than "beginning": the offset lookup librdkafka does for
  // the logical offset costs a fetch cycle per partition.
  std::vector<TopicPartitionOffset> resolved = starts;
  for (auto& tp : resolved)
    if (tp.offset == RdKafka::Topic::OFFSET_BEGINNING) tp.offset = watermarks(tp.topic, tp.partition, timeout_ms).first;
  Assignment assigned(*this, resolved);
  std::optional<ChunkAssembler> assembler;
  if (chunks) assembler.emplace(*chunks);
  auto problems = [&](const std::vector<ChunkProblem>& found) {
    if (on_problem)
      for (const auto& p : found) on_problem(p);
  };
  // Timed out only when no message comes for timeout_ms: a long log (a checkpoint of several GB,
  // each segment decoded as it comes) may take any time while it keeps arriving.
  const auto wait = std::chrono::milliseconds(timeout_ms);
  auto stalled_at = Clock::now() + wait;
  while (!consumer_.at_end()) {
    if (Clock::now() > stalled_at)
      throw Unavailable("no message from " + starts.front().topic + " for " + std::to_string(timeout_ms) +
                        " ms while reading it to its end");
    auto message = consumer_.poll(200);
    if (!message) continue;
    if (!assembler) {
      on_message(*message);
    } else {
      auto result = assembler->add(std::move(*message));
      problems(result.problems);
      if (result.message) on_message(*result.message);
    }
    stalled_at = Clock::now() + wait;
  }
  if (assembler) problems(assembler->finish());
}

std::vector<ConsumedMessage> LogReader::fetch(const std::vector<TopicPartitionOffset>& positions, int timeout_ms,
                                              const DecodeLimits* chunks) {
  // One sequential read per partition, from its lowest wanted offset to its highest (and on to
  // the last piece of a wanted chunked message).
  std::map<std::pair<std::string, int32_t>, std::set<int64_t>> wanted;
  for (const auto& p : positions) wanted[{p.topic, p.partition}].insert(p.offset);
  std::vector<ConsumedMessage> out;
  if (wanted.empty()) return out;
  std::vector<TopicPartitionOffset> starts;
  for (const auto& [tp, offsets] : wanted) starts.push_back({tp.first, tp.second, *offsets.begin()});
  Assignment assigned(*this, starts);
  std::optional<ChunkAssembler> assembler;
  if (chunks)
    assembler.emplace(*chunks, [&](const ConsumedMessage& head) {
      const auto it = wanted.find({head.topic, head.partition});
      return it != wanted.end() && it->second.count(head.offset) > 0;
    });
  // A partition is done once its wanted offsets are found, or read past with none of them still
  // being reassembled.
  auto open_in = [&](const std::pair<std::string, int32_t>& partition) {
    if (!assembler) return false;
    for (const auto& head : assembler->open_heads())
      if (head.topic == partition.first && head.partition == partition.second) return true;
    return false;
  };
  // As read_to_end: timed out only when no message comes for timeout_ms.
  const auto wait = std::chrono::milliseconds(timeout_ms);
  auto stalled_at = Clock::now() + wait;
  size_t remaining = positions.size();
  std::set<std::pair<std::string, int32_t>> done;
  while (remaining > 0 && done.size() < wanted.size() && !consumer_.at_end()) {
    if (Clock::now() > stalled_at)
      throw Unavailable("no message for " + std::to_string(timeout_ms) + " ms while fetching " +
                        std::to_string(remaining) + " logged messages");
    auto message = consumer_.poll(200);
    if (!message) continue;
    stalled_at = Clock::now() + wait;
    // Read before the message is moved on.
    const std::pair<std::string, int32_t> partition{message->topic, message->partition};
    const int64_t offset = message->offset;
    if (done.count(partition)) continue;
    std::optional<ConsumedMessage> whole;
    if (assembler)
      whole = std::move(assembler->add(std::move(*message)).message);
    else
      whole = std::move(*message);
    auto& offsets = wanted[partition];
    if (whole && offsets.erase(whole->offset)) {
      --remaining;
      out.push_back(std::move(*whole));
    }
    if (offsets.empty() || (offset >= *offsets.rbegin() && !open_in(partition))) done.insert(partition);
  }
  return out;
}

void LogReader::read_ranges(const std::vector<OffsetRange>& ranges,
                            const std::function<void(const ConsumedMessage&)>& on_message, int timeout_ms) {
  std::vector<TopicPartitionOffset> starts;
  std::map<std::pair<std::string, int32_t>, int64_t> ends;  // unfinished partitions
  for (const auto& r : ranges)
    if (r.begin < r.end) {
      starts.push_back({r.topic, r.partition, r.begin});
      ends[{r.topic, r.partition}] = r.end;
    }
  if (starts.empty()) return;
  Assignment assigned(*this, starts);
  auto stalled_at = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (!ends.empty() && !consumer_.at_end()) {
    if (Clock::now() > stalled_at)
      throw Unavailable("no message from " + ends.begin()->first.first + " for " + std::to_string(timeout_ms) + " ms");
    auto message = consumer_.poll(200);
    if (!message) continue;
    stalled_at = Clock::now() + std::chrono::milliseconds(timeout_ms);
    auto it = ends.find({message->topic, message->partition});
    if (it == ends.end()) continue;
    if (message->offset < it->second) on_message(*message);
    if (message->offset + 1 >= it->second) ends.erase(it);
  }
}

void read_partitions_to_end(const KafkaOptions& options, const std::vector<TopicPartitionOffset>& starts,
                            const std::function<void(const ConsumedMessage&)>& on_message, int timeout_ms,
                            const DecodeLimits* chunks, const OnChunkProblem& on_problem) {
  if (starts.empty()) return;
  LogReader(options).read_to_end(starts, on_message, timeout_ms, chunks, on_problem);
}

std::vector<ConsumedMessage> fetch_positions(const KafkaOptions& options,
                                             const std::vector<TopicPartitionOffset>& positions, int timeout_ms,
                                             const DecodeLimits* chunks) {
  if (positions.empty()) return {};
  return LogReader(options).fetch(positions, timeout_ms, chunks);
}

void read_to_end(LogReader& reader, const std::vector<std::string>& topics,
                 const std::function<void(const ConsumedMessage&)>& on_message, int timeout_ms,
                 const DecodeLimits* chunks, const OnChunkProblem& on_problem) {
  std::vector<TopicPartitionOffset> starts;
  for (const auto& topic : topics) {
    const int n = reader.partition_count(topic, timeout_ms);
    for (int p = 0; p < n; ++p) starts.push_back({topic, p, RdKafka::Topic::OFFSET_BEGINNING});
  }
  reader.read_to_end(starts, on_message, timeout_ms, chunks, on_problem);
}

void read_to_end(const KafkaOptions& options, const std::vector<std::string>& topics,
                 const std::function<void(const ConsumedMessage&)>& on_message, int timeout_ms,
                 const DecodeLimits* chunks, const OnChunkProblem& on_problem) {
  LogReader reader(options);
  read_to_end(reader, topics, on_message, timeout_ms, chunks, on_problem);
}

}  // namespace diloco
