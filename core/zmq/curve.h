// Authenticated parameters: ZeroMQ CURVE on the merger's publisher and the learners' subscribers.
// CURVE alone only encrypts: a server accepts any client key unless a ZAP handler (RFC 27) is
// bound on inproc://zeromq.zap.01 in the same ZeroMQ context before the server socket binds.
// ZapHandler is that handler, with an allow-list of learner public keys read from a directory
// (reloaded when it changes), so that
// - only learners whose public key is listed receive parameters (others fail the handshake and
//   receive nothing), and
// - a learner only completes a handshake with a publisher that holds the merger's secret key (its
//   subscriber names the merger's public key), so nothing else can get it to adopt parameters.
//
// Key files, as czmq's certificates name them: NAME.key holds the public key, NAME.key_secret
// (mode 0600) the public and the secret one, each a line `public-key = "<Z85>"` /
// `secret-key = "<Z85>"` (40 characters of Z85, RFC 32). tools/diloco-keys.cc writes them.
#pragma once

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include <zmq.hpp>

namespace diloco {

struct CurveKeyPair {
  std::string public_key;  // Z85, 40 characters
  std::string secret_key;  // Z85, 40 characters; empty when only the public key is known
};

// A new key pair (zmq_curve_keypair). Throws Error when libzmq was built without CURVE.
CurveKeyPair generate_curve_keys();

// Writes DIR/NAME.key (public, mode 0644) and DIR/NAME.key_secret (both keys, mode 0600).
// Throws IoError; InvalidInput for a name that is not letters, digits, '-', '_' or '.'.
void write_curve_keys(const std::filesystem::path& dir, const std::string& name, const CurveKeyPair& keys);

// Reads a key file: NAME.key gives the public key, NAME.key_secret both. Throws IoError when it
// cannot be read, InvalidInput (naming the file) when a key is missing or not 40 Z85 characters,
// or when a secret key file is readable by others than its owner.
CurveKeyPair read_curve_keys(const std::filesystem::path& file);

// What the processes of a run need (RunConfig's [security] section, resolved to keys).
struct CurveServerOptions {
  CurveKeyPair server;               // the mergers' key pair
  std::filesystem::path allowed_dir;  // *.key files of the learners allowed to subscribe
};
struct CurveClientOptions {
  std::string server_public_key;  // the mergers' public key
  CurveKeyPair client;            // this learner's key pair
};

// One authentication decision, for the caller's log and metrics (called on the handler's thread).
struct ZapDecision {
  bool allowed = false;
  std::string client_key;  // Z85
  std::string address;     // the peer's IP address
  std::string reason;      // why it was refused, or the key file that allowed it
};

class ZapHandler {
 public:
  // Binds inproc://zeromq.zap.01 in `context` (before any CURVE server socket of that context
  // binds) and serves requests on a thread of its own until destroyed. Reads `allowed_dir` now
  // (InvalidInput when it is not a directory) and again, at most once a second, when a request
  // comes and the directory or one of its files changed: adding or removing a key file takes
  // effect for the next handshake.
  ZapHandler(zmq::context_t& context, std::filesystem::path allowed_dir, std::function<void(const ZapDecision&)> on_decision);
  ~ZapHandler();
  ZapHandler(const ZapHandler&) = delete;
  ZapHandler& operator=(const ZapHandler&) = delete;

  size_t allowed_keys() const;

 private:
  void run();
  void reload_if_changed();

  std::filesystem::path dir_;
  std::function<void(const ZapDecision&)> on_decision_;
  zmq::socket_t socket_;
  mutable std::mutex mutex_;
  std::set<std::string> keys_;  // Z85 public keys
  std::map<std::string, std::string> files_;  // key -> the file it came from
  std::filesystem::file_time_type seen_{};
  std::chrono::steady_clock::time_point checked_{};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

struct SecurityConfig;

// The options of each side from a run's [security] settings (core/config/run_config.h): none
// when CURVE is off. Reads the key files now; throws InvalidInput naming the setting that is
// missing for this side, or the file that is wrong (IoError when it cannot be read).
std::optional<CurveServerOptions> curve_server_options(const SecurityConfig& security);
std::optional<CurveClientOptions> curve_client_options(const SecurityConfig& security);

// Socket options of each side (before bind / connect).
void make_curve_server(zmq::socket_t& socket, const CurveServerOptions& options);
void make_curve_client(zmq::socket_t& socket, const CurveClientOptions& options);

}  // namespace diloco
