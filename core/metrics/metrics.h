// Process metrics: counters, gauges and histograms with optional labels, readable as Prometheus
// text (GET /metrics on --metrics-port) and as JSON snapshots appended to a JSON-lines file in
// the run folder. Thread-safe: any thread may update, any thread may read.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace diloco {

using Labels = std::vector<std::pair<std::string, std::string>>;

class Metrics {
 public:
  // `prefix` is prepended to every name in the Prometheus output (e.g. "diloco_learner_").
  explicit Metrics(std::string prefix) : prefix_(std::move(prefix)) {}

  void add(const std::string& name, double delta, const Labels& labels = {});    // counter
  void set(const std::string& name, double value, const Labels& labels = {});    // gauge
  // Histogram with fixed upper bounds (the first observation of a name fixes its bounds).
  void observe(const std::string& name, double value, const std::vector<double>& bounds,
               const Labels& labels = {});

  double value(const std::string& name, const Labels& labels = {}) const;  // 0 if never set
  std::string prometheus_text() const;
  nlohmann::json snapshot() const;  // {"name{labels}": value, ...}, histograms as objects

 private:
  struct Histogram {
    std::vector<double> bounds;
    std::vector<uint64_t> counts;  // one per bound, plus +Inf
    double sum = 0;
    uint64_t count = 0;
  };
  struct Series {
    std::string kind;  // "counter" | "gauge"
    double value = 0;
  };
  static std::string key(const std::string& name, const Labels& labels);

  std::string prefix_;
  mutable std::mutex mutex_;
  std::map<std::string, Series> series_;        // key -> series
  std::map<std::string, Histogram> histograms_;  // key -> histogram
};

// Appends one JSON object per line, flushed at once, so a crash loses at most the line being written.
class JsonLines {
 public:
  explicit JsonLines(const std::string& path);
  ~JsonLines();
  void write(const nlohmann::json& record);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::mutex mutex_;
  int fd_ = -1;
};

// Serves GET /metrics (Prometheus text format) on 127.0.0.1:port (0 = disabled) from a thread.
class MetricsEndpoint {
 public:
  MetricsEndpoint(const Metrics& metrics, int port, const std::string& host = "127.0.0.1");
  ~MetricsEndpoint();
  int port() const { return port_; }

 private:
  struct Server;
  std::unique_ptr<Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace diloco
