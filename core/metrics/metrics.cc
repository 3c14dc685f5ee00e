#include "core/metrics/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <sstream>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "core/errors.h"

namespace diloco {

namespace {

std::string escape_label(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

std::string format_labels(const Labels& labels, const std::string& extra = "") {
  if (labels.empty() && extra.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i)
    out += (i ? "," : "") + labels[i].first + "=\"" + escape_label(labels[i].second) + "\"";
  if (!extra.empty()) out += (labels.empty() ? "" : ",") + extra;
  return out + "}";
}

std::string number(double v) {
  std::ostringstream s;
  s.precision(10);
  s << v;
  return s.str();
}

// Splits "name{labels}" keys back into name and label text.
std::pair<std::string, std::string> split_key(const std::string& key) {
  auto brace = key.find('{');
  if (brace == std::string::npos) return {key, ""};
  return {key.substr(0, brace), key.substr(brace)};
}

}  // namespace

std::string Metrics::key(const std::string& name, const Labels& labels) { return name + format_labels(labels); }

void Metrics::add(const std::string& name, double delta, const Labels& labels) {
  std::lock_guard lock(mutex_);
  auto& s = series_[key(name, labels)];
  s.kind = "counter";
  s.value += delta;
}

void Metrics::set(const std::string& name, double value, const Labels& labels) {
  std::lock_guard lock(mutex_);
  auto& s = series_[key(name, labels)];
  s.kind = "gauge";
  s.value = value;
}

void Metrics::observe(const std::string& name, double value, const std::vector<double>& bounds,
                      const Labels& labels) {
  std::lock_guard lock(mutex_);
  auto& h = histograms_[key(name, labels)];
  if (h.bounds.empty()) {
    h.bounds = bounds;
    h.counts.assign(bounds.size() + 1, 0);
  }
  size_t i = 0;
  while (i < h.bounds.size() && value > h.bounds[i]) ++i;
  ++h.counts[i];
  h.sum += value;
  ++h.count;
}

double Metrics::value(const std::string& name, const Labels& labels) const {
  std::lock_guard lock(mutex_);
  auto it = series_.find(key(name, labels));
  return it == series_.end() ? 0.0 : it->second.value;
}

std::string Metrics::prometheus_text() const {
  std::lock_guard lock(mutex_);
  std::ostringstream out;
  std::string last_name;
  for (const auto& [k, s] : series_) {
    auto [name, labels] = split_key(k);
    if (name != last_name) out << "# TYPE " << prefix_ << name << " " << s.kind << "\n";
    last_name = name;
    out << prefix_ << name << labels << " " << number(s.value) << "\n";
  }
  for (const auto& [k, h] : histograms_) {
    auto [name, labels] = split_key(k);
    std::string inner = labels.empty() ? "" : labels.substr(1, labels.size() - 2);
    auto with = [&](const std::string& le) { return "{" + inner + (inner.empty() ? "" : ",") + "le=\"" + le + "\"}"; };
    out << "# TYPE " << prefix_ << name << " histogram\n";
    uint64_t cumulative = 0;
    for (size_t i = 0; i < h.bounds.size(); ++i) {
      cumulative += h.counts[i];
      out << prefix_ << name << "_bucket" << with(number(h.bounds[i])) << " " << cumulative << "\n";
    }
    out << prefix_ << name << "_bucket" << with("+Inf") << " " << h.count << "\n";
    out << prefix_ << name << "_sum" << labels << " " << number(h.sum) << "\n";
    out << prefix_ << name << "_count" << labels << " " << h.count << "\n";
  }
  return out.str();
}

nlohmann::json Metrics::snapshot() const {
  std::lock_guard lock(mutex_);
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [k, s] : series_) out[k] = s.value;
  for (const auto& [k, h] : histograms_) {
    nlohmann::json buckets = nlohmann::json::object();
    for (size_t i = 0; i < h.bounds.size(); ++i) buckets[number(h.bounds[i])] = h.counts[i];
    buckets["+Inf"] = h.counts.back();
    out[k] = {{"count", h.count}, {"sum", h.sum}, {"buckets", buckets}};
  }
  return out;
}

JsonLines::JsonLines(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) throw IoError("cannot open " + path + " for metrics: " + std::strerror(errno));
}

JsonLines::~JsonLines() {
  if (fd_ >= 0) ::close(fd_);
}

void JsonLines::write(const nlohmann::json& record) {
  // One write() per line: with O_APPEND a line is never interleaved or half-written by us.
  std::string line = record.dump() + "\n";
  std::lock_guard lock(mutex_);
  size_t done = 0;
  while (done < line.size()) {
    ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw IoError("writing " + path_ + ": " + std::strerror(errno));
    }
    done += static_cast<size_t>(n);
  }
}

struct MetricsEndpoint::Server {
  httplib::Server http;
};

MetricsEndpoint::MetricsEndpoint(const Metrics& metrics, int port, const std::string& host) {
  if (port <= 0) return;
  server_ = std::make_unique<Server>();
  // httplib's default also sets SO_REUSEPORT, which would let two processes share a port.
  server_->http.set_socket_options([](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  server_->http.Get("/metrics", [&metrics](const httplib::Request&, httplib::Response& response) {
    response.set_content(metrics.prometheus_text(), "text/plain; version=0.0.4");
  });
  if (!server_->http.bind_to_port(host.c_str(), port))
    throw IoError("cannot listen for metrics on " + host + ":" + std::to_string(port) +
                  " (port in use? choose another with --metrics-port)");
  port_ = port;
  thread_ = std::thread([this] { server_->http.listen_after_bind(); });
  // stop() before the loop runs would be lost and the destructor would wait forever.
  while (!server_->http.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

MetricsEndpoint::~MetricsEndpoint() {
  if (server_) server_->http.stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace diloco
