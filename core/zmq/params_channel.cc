#include "core/zmq/params_channel.h"

#include <zmq_addon.hpp>

#include <cctype>
#include <charconv>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>

#include "core/errors.h"

namespace diloco {

ParamsPublisher::ParamsPublisher(zmq::context_t& context, const std::string& bind, int send_high_water_mark,
                                 const CurveServerOptions* curve, std::function<void(const ZapDecision&)> on_decision)
    : zap_(curve ? std::make_unique<ZapHandler>(context, curve->allowed_dir, std::move(on_decision)) : nullptr),
      socket_(context, zmq::socket_type::xpub) {
  if (curve) make_curve_server(socket_, *curve);
  socket_.set(zmq::sockopt::sndhwm, send_high_water_mark);
  socket_.set(zmq::sockopt::xpub_verbose, true);  // every subscription, also repeated ones, is a request
  socket_.set(zmq::sockopt::linger, 0);
  try {
    socket_.bind(bind);
  } catch (const zmq::error_t& e) {
    throw IoError("cannot bind the parameter publisher to " + bind + ": " + e.what() +
                  " (choose another endpoint with --bind)");
  }
  bound_ = socket_.get(zmq::sockopt::last_endpoint);
}

namespace {
constexpr std::string_view kVersionPrefix = "v.";
constexpr std::string_view kRoundOpenPrefix = "open.";
constexpr std::string_view kSnapshotPrefix = "s.";
constexpr std::string_view kRequestPrefix = "want.";

std::optional<uint32_t> parse_fragment(std::string_view text) {
  uint32_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

bool valid_id(std::string_view id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_')) return false;
  return true;
}

std::string random_id() {
  std::random_device rd;
  const uint64_t value = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(value));
  return text;
}
}  // namespace

void ParamsPublisher::publish(uint32_t fragment, std::span<const uint8_t> message) {
  send(std::string(kVersionPrefix) + std::to_string(fragment), message);
}

void ParamsPublisher::publish_to(const std::string& subscriber, uint32_t fragment, std::span<const uint8_t> message) {
  send(std::string(kSnapshotPrefix) + subscriber + "." + std::to_string(fragment), message);
}

namespace {
// What a zero-copy part keeps alive until ZeroMQ frees it.
struct Held {
  std::shared_ptr<const MessageParts> parts;
  size_t index = 0;
  std::shared_ptr<std::atomic<uint64_t>> queued;
};
void release(void*, void* hint) {
  auto* held = static_cast<Held*>(hint);
  held->queued->fetch_sub((*held->parts)[held->index].size());
  delete held;
}
}  // namespace

void ParamsPublisher::publish_to(const std::string& subscriber, uint32_t fragment,
                                 std::shared_ptr<const MessageParts> parts) {
  if (!parts) return;
  const std::string topic = std::string(kSnapshotPrefix) + subscriber + "." + std::to_string(fragment);
  for (size_t i = 0; i < parts->size(); ++i) {
    queued_->fetch_add((*parts)[i].size());
    auto* held = new Held{parts, i, queued_};
    auto* data = const_cast<uint8_t*>((*parts)[i].data());
    zmq::message_t frame(data, (*parts)[i].size(), release, held);  // owns `held` from here on
    (void)socket_.send(zmq::buffer(topic), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    (void)socket_.send(frame, zmq::send_flags::dontwait);
  }
}

void ParamsPublisher::publish_round_open(uint32_t fragment, std::span<const uint8_t> message) {
  send(std::string(kRoundOpenPrefix) + std::to_string(fragment), message);
}

void ParamsPublisher::send(const std::string& topic, std::span<const uint8_t> message) {
  // PUB never blocks: with the high-water mark reached the message is dropped for that peer.
  (void)socket_.send(zmq::buffer(topic), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
  (void)socket_.send(zmq::buffer(message.data(), message.size()), zmq::send_flags::dontwait);
}

ParamsPublisher::Requests ParamsPublisher::take_requests() {
  Requests out;
  zmq::message_t message;
  // A subscription message is one frame: 1 (subscribe) or 0 (unsubscribe), then the topic.
  while (socket_.recv(message, zmq::recv_flags::dontwait)) {
    ++out.count;
    std::string_view m(message.data<char>(), message.size());
    if (m.empty() || m[0] != 1) continue;
    m.remove_prefix(1);
    if (m.starts_with(kSnapshotPrefix) && m.ends_with(".")) {  // "s.ID.": a hello
      const auto id = m.substr(kSnapshotPrefix.size(), m.size() - kSnapshotPrefix.size() - 1);
      if (valid_id(id)) out.joined.insert(std::string(id));
    } else if (m.starts_with(kRequestPrefix)) {  // "want.P.ID"
      m.remove_prefix(kRequestPrefix.size());
      const auto dot = m.find('.');
      if (dot == std::string_view::npos) continue;
      const auto fragment = parse_fragment(m.substr(0, dot));
      const auto id = m.substr(dot + 1);
      if (fragment && valid_id(id)) out.fragments[std::string(id)].insert(*fragment);
    }
  }
  return out;
}

ParamsSubscriber::ParamsSubscriber(zmq::context_t& context, int receive_high_water_mark, std::string id,
                                   const CurveClientOptions* curve, const std::vector<uint32_t>& fragments)
    : socket_(context, zmq::socket_type::sub),
      id_(id.empty() ? random_id() : std::move(id)),
      fragments_(fragments.begin(), fragments.end()) {
  if (!valid_id(id_))
    throw InvalidInput("subscriber id '" + id_ + "': use 1-64 letters, digits, '-' or '_'");
  if (curve) make_curve_client(socket_, *curve);
  socket_.set(zmq::sockopt::rcvhwm, receive_high_water_mark);
  socket_.set(zmq::sockopt::linger, 0);
  if (fragments_.empty()) {
    socket_.set(zmq::sockopt::subscribe, kVersionPrefix);
    socket_.set(zmq::sockopt::subscribe, kRoundOpenPrefix);
  }
  for (uint32_t p : fragments_) {
    socket_.set(zmq::sockopt::subscribe, std::string(kVersionPrefix) + std::to_string(p));
    socket_.set(zmq::sockopt::subscribe, std::string(kRoundOpenPrefix) + std::to_string(p));
  }
  socket_.set(zmq::sockopt::subscribe, std::string(kSnapshotPrefix) + id_ + ".");
  // Reconnect with exponential back-off up to 5 s when a merger goes away.
  socket_.set(zmq::sockopt::reconnect_ivl, 100);
  socket_.set(zmq::sockopt::reconnect_ivl_max, 5000);
}

void ParamsSubscriber::connect(const std::string& endpoint) {
  if (endpoints_.count(endpoint)) return;
  try {
    socket_.connect(endpoint);
  } catch (const zmq::error_t& e) {
    throw InvalidInput("cannot connect to merger endpoint '" + endpoint + "': " + e.what());
  }
  endpoints_.insert(endpoint);
}

void ParamsSubscriber::request(uint32_t fragment) {
  const std::string topic = std::string(kRequestPrefix) + std::to_string(fragment) + "." + id_;
  // Subscribing sends the request upstream; removing the subscription right after keeps the
  // filter list short (nothing is ever published on that topic).
  socket_.set(zmq::sockopt::subscribe, topic);
  socket_.set(zmq::sockopt::unsubscribe, topic);
}

void ParamsSubscriber::disconnect(const std::string& endpoint) {
  if (!endpoints_.erase(endpoint)) return;
  try {
    socket_.disconnect(endpoint);
  } catch (const zmq::error_t&) {
    // Already gone: nothing to undo.
  }
}

std::optional<ParamsSubscriber::Received> ParamsSubscriber::receive(std::chrono::milliseconds timeout) {
  zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
  if (zmq::poll(&item, 1, timeout) == 0) return std::nullopt;
  std::vector<zmq::message_t> frames;
  if (!zmq::recv_multipart(socket_, std::back_inserter(frames), zmq::recv_flags::dontwait)) return std::nullopt;
  for (const auto& frame : frames) bytes_received_ += frame.size();
  if (frames.size() != 2) return std::nullopt;
  Received out;
  std::string_view topic(frames[0].data<char>(), frames[0].size());
  if (topic.starts_with(kRoundOpenPrefix)) {
    out.round_open = true;
    topic.remove_prefix(kRoundOpenPrefix.size());
  } else if (topic.starts_with(kVersionPrefix)) {
    topic.remove_prefix(kVersionPrefix.size());
  } else if (topic.starts_with(kSnapshotPrefix)) {
    topic.remove_prefix(kSnapshotPrefix.size());
    if (!topic.starts_with(id_) || topic.size() <= id_.size() || topic[id_.size()] != '.') return std::nullopt;
    topic.remove_prefix(id_.size() + 1);
    out.snapshot_for_me = true;
  } else {
    return std::nullopt;
  }
  auto fragment = parse_fragment(topic);
  if (!fragment || (!fragments_.empty() && !fragments_.count(*fragment))) return std::nullopt;
  out.fragment = *fragment;
  const auto* bytes = frames[1].data<uint8_t>();
  out.message.assign(bytes, bytes + frames[1].size());
  return out;
}

}  // namespace diloco
