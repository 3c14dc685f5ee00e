#include "core/zmq/curve.h"

#include <sys/stat.h>
#include <zmq_addon.hpp>

#include <algorithm>
#include <array>
#include <cctype>
#include <fstream>
#include <sstream>

#include "core/config/run_config.h"
#include "core/errors.h"
#include "core/files/secret_file.h"

namespace diloco {

namespace {

constexpr size_t kZ85KeyLength = 40;
constexpr const char* kZapEndpoint = "inproc://zeromq.zap.01";

bool is_z85_key(const std::string& key) {
  if (key.size() != kZ85KeyLength) return false;
  uint8_t decoded[32];
  return zmq_z85_decode(decoded, key.c_str()) != nullptr;
}

// The quoted value of the line `name = "..."` in a key file, or empty.
std::string key_field(const std::string& text, const std::string& name) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const auto at = line.find(name);
    if (at == std::string::npos) continue;
    const auto open = line.find('"', at + name.size());
    const auto close = open == std::string::npos ? open : line.find('"', open + 1);
    if (close == std::string::npos) continue;
    return line.substr(open + 1, close - open - 1);
  }
  return {};
}

bool valid_name(const std::string& name) {
  if (name.empty() || name.front() == '.') return false;
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) return false;
  return true;
}

void write_file(const std::filesystem::path& path, const std::string& text, mode_t mode) {
  // Created with its final mode (a secret is never readable by others, not even for a moment).
  std::filesystem::remove(path);
  const mode_t old = ::umask(0077);
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out) {
      ::umask(old);
      throw IoError("cannot write " + path.string());
    }
  }
  ::umask(old);
  if (::chmod(path.c_str(), mode) != 0) throw IoError("cannot set the mode of " + path.string());
}

std::string key_file_text(const CurveKeyPair& keys, bool secret) {
  std::string text = "#   diloco CURVE " + std::string(secret ? "secret " : "public ") +
                     "key (ZeroMQ CURVE, Z85; the layout of czmq's certificates)\n"
                     "metadata\ncurve\n    public-key = \"" + keys.public_key + "\"\n";
  if (secret) text += "    secret-key = \"" + keys.secret_key + "\"\n";
  return text;
}

}  // namespace

CurveKeyPair generate_curve_keys() {
  if (!zmq_has("curve")) throw Error("this libzmq was built without CURVE: install libzmq with libsodium");
  char pub[kZ85KeyLength + 1], sec[kZ85KeyLength + 1];
  if (zmq_curve_keypair(pub, sec) != 0) throw Error(std::string("zmq_curve_keypair: ") + zmq_strerror(zmq_errno()));
  return {pub, sec};
}

void write_curve_keys(const std::filesystem::path& dir, const std::string& name, const CurveKeyPair& keys) {
  if (!valid_name(name)) throw InvalidInput("key name '" + name + "': use letters, digits, '-', '_' or '.'");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw IoError("cannot create " + dir.string() + ": " + ec.message());
  write_file(dir / (name + ".key"), key_file_text(keys, false), 0644);
  write_file(dir / (name + ".key_secret"), key_file_text(keys, true), 0600);
}

CurveKeyPair read_curve_keys(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw IoError("cannot read key file " + file.string());
  std::stringstream text;
  text << in.rdbuf();
  CurveKeyPair keys{key_field(text.str(), "public-key"), key_field(text.str(), "secret-key")};
  if (!is_z85_key(keys.public_key))
    throw InvalidInput(file.string() + ": no public-key of 40 Z85 characters (make keys with diloco-keys)");
  if (file.extension() == ".key_secret") {
    if (!is_z85_key(keys.secret_key))
      throw InvalidInput(file.string() + ": no secret-key of 40 Z85 characters (make keys with diloco-keys)");
    require_owner_only(file, "a CURVE secret key");
  } else {
    keys.secret_key.clear();  // a public key file never lends a secret
  }
  return keys;
}

std::optional<CurveServerOptions> curve_server_options(const SecurityConfig& security) {
  if (!security.curve()) return std::nullopt;
  if (security.merger_secret_key.empty())
    throw InvalidInput("security.merger_public_key is set but security.merger_secret_key is not: a merger needs the "
                       "mergers' NAME.key_secret (diloco-keys) to prove who it is");
  if (security.allowed_learners.empty())
    throw InvalidInput("security.allowed_learners is not set: a merger needs the directory of the learners' .key files");
  CurveServerOptions out{.server = read_curve_keys(security.merger_secret_key), .allowed_dir = security.allowed_learners};
  if (!std::filesystem::is_directory(out.allowed_dir))
    throw InvalidInput("security.allowed_learners: " + out.allowed_dir.string() + " is not a directory");
  if (!security.merger_public_key.empty() &&
      read_curve_keys(security.merger_public_key).public_key != out.server.public_key)
    throw InvalidInput("security.merger_public_key (" + security.merger_public_key +
                       ") is not the public half of security.merger_secret_key (" + security.merger_secret_key + ")");
  return out;
}

std::optional<CurveClientOptions> curve_client_options(const SecurityConfig& security) {
  if (!security.curve()) return std::nullopt;
  if (security.merger_public_key.empty())
    throw InvalidInput("security.merger_secret_key is set but security.merger_public_key is not: a learner needs the "
                       "mergers' NAME.key to know them");
  if (security.learner_key.empty())
    throw InvalidInput("security.learner_key is not set: a learner of a run with CURVE needs its own NAME.key_secret "
                       "(diloco-keys), whose NAME.key the mergers allow");
  const CurveKeyPair client = read_curve_keys(security.learner_key);
  if (client.secret_key.empty())
    throw InvalidInput("security.learner_key (" + security.learner_key + ") holds no secret key: name the .key_secret file");
  return CurveClientOptions{.server_public_key = read_curve_keys(security.merger_public_key).public_key,
                            .client = client};
}

void make_curve_server(zmq::socket_t& socket, const CurveServerOptions& options) {
  socket.set(zmq::sockopt::curve_server, true);
  socket.set(zmq::sockopt::curve_secretkey, options.server.secret_key);
  socket.set(zmq::sockopt::zap_domain, "diloco");
}

void make_curve_client(zmq::socket_t& socket, const CurveClientOptions& options) {
  socket.set(zmq::sockopt::curve_serverkey, options.server_public_key);
  socket.set(zmq::sockopt::curve_publickey, options.client.public_key);
  socket.set(zmq::sockopt::curve_secretkey, options.client.secret_key);
}

ZapHandler::ZapHandler(zmq::context_t& context, std::filesystem::path allowed_dir,
                       std::function<void(const ZapDecision&)> on_decision)
    : dir_(std::move(allowed_dir)), on_decision_(std::move(on_decision)), socket_(context, zmq::socket_type::rep) {
  if (!std::filesystem::is_directory(dir_))
    throw InvalidInput("allowed learner keys: " + dir_.string() + " is not a directory (make one with diloco-keys)");
  reload_if_changed();
  socket_.set(zmq::sockopt::linger, 0);
  try {
    socket_.bind(kZapEndpoint);
  } catch (const zmq::error_t& e) {
    throw Error(std::string("cannot bind the ZAP handler (one per ZeroMQ context): ") + e.what());
  }
  // Bound before the thread starts (a full barrier hands the socket over), so before any server
  // socket of the context binds: there is no moment at which a client key goes unchecked.
  thread_ = std::thread([this] { run(); });
}

ZapHandler::~ZapHandler() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

size_t ZapHandler::allowed_keys() const {
  std::lock_guard lock(mutex_);
  return keys_.size();
}

void ZapHandler::reload_if_changed() {
  const auto now = std::chrono::steady_clock::now();
  std::error_code ec;
  std::filesystem::file_time_type newest = std::filesystem::last_write_time(dir_, ec);
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    if (entry.path().extension() != ".key") continue;
    files.push_back(entry.path());
    newest = std::max(newest, entry.last_write_time(ec));
  }
  std::lock_guard lock(mutex_);
  checked_ = now;
  if (newest == seen_ && !keys_.empty()) return;
  seen_ = newest;
  keys_.clear();
  files_.clear();
  for (const auto& file : files) {
    try {
      const auto key = read_curve_keys(file).public_key;
      keys_.insert(key);
      files_[key] = file.filename().string();
    } catch (const Error&) {
      // A file that is not a key allows nobody; the others still count.
    }
  }
}

void ZapHandler::run() {
  zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
  while (!stop_) {
    try {
      if (zmq::poll(&item, 1, std::chrono::milliseconds(100)) == 0) continue;
      std::vector<zmq::message_t> request;
      if (!zmq::recv_multipart(socket_, std::back_inserter(request), zmq::recv_flags::dontwait)) continue;
      request.resize(std::max<size_t>(request.size(), 6));  // a malformed request is answered (REP) and refused
      ZapDecision d;
      d.address = request[3].to_string();
      const std::string mechanism = request[5].to_string();
      if (mechanism != "CURVE" || request.size() < 7 || request[6].size() != 32) {
        d.reason = "mechanism " + mechanism + " is not CURVE";
      } else {
        char z85[kZ85KeyLength + 1];
        zmq_z85_encode(z85, static_cast<const uint8_t*>(request[6].data()), 32);
        d.client_key = z85;
        if (std::chrono::steady_clock::now() - checked_ >= std::chrono::seconds(1)) reload_if_changed();
        std::lock_guard lock(mutex_);
        auto it = files_.find(d.client_key);
        d.allowed = it != files_.end();
        d.reason = d.allowed ? it->second : "its key is not in " + dir_.string();
      }
      std::array<zmq::const_buffer, 6> reply{zmq::buffer(std::string_view("1.0")),
                                             zmq::buffer(request[1].data(), request[1].size()),
                                             zmq::buffer(std::string_view(d.allowed ? "200" : "400")),
                                             zmq::buffer(std::string_view(d.allowed ? "OK" : "not allowed")),
                                             zmq::buffer(d.client_key),
                                             zmq::const_buffer()};
      zmq::send_multipart(socket_, reply);
      if (on_decision_) on_decision_(d);
    } catch (const std::exception& e) {
      // A failed turn (a malformed request, EINTR) refuses nothing for good: the next one is served.
    }
  }
}

}  // namespace diloco
