#include "core/zmq/params_channel.h"

#include <zmq_addon.hpp>

#include <charconv>
#include <string>
#include <string_view>

#include "core/errors.h"

namespace diloco {

ParamsPublisher::ParamsPublisher(zmq::context_t& context, const std::string& bind, int send_high_water_mark)
    : socket_(context, zmq::socket_type::xpub) {
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
constexpr std::string_view kRoundOpenPrefix = "open.";
constexpr std::string_view kRequestPrefix = "want.";

std::optional<uint32_t> parse_fragment(std::string_view text) {
  uint32_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}
}  // namespace

void ParamsPublisher::publish(uint32_t fragment, std::span<const uint8_t> message) {
  send(std::to_string(fragment), message);
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
    if (m.empty()) {
      out.all = true;
    } else if (m.starts_with(kRequestPrefix)) {
      if (auto p = parse_fragment(m.substr(kRequestPrefix.size()))) out.fragments.insert(*p);
    }
  }
  return out;
}

ParamsSubscriber::ParamsSubscriber(zmq::context_t& context, int receive_high_water_mark)
    : socket_(context, zmq::socket_type::sub) {
  socket_.set(zmq::sockopt::rcvhwm, receive_high_water_mark);
  socket_.set(zmq::sockopt::linger, 0);
  socket_.set(zmq::sockopt::subscribe, "");
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
  const std::string topic = std::string(kRequestPrefix) + std::to_string(fragment);
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
  }
  auto fragment = parse_fragment(topic);
  if (!fragment) return std::nullopt;
  out.fragment = *fragment;
  const auto* bytes = frames[1].data<uint8_t>();
  out.message.assign(bytes, bytes + frames[1].size());
  return out;
}

}  // namespace diloco
