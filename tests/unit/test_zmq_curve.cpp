// Authenticated parameters over loopback TCP (core/zmq/curve.h): a learner whose key is allowed
// receives; one whose key is not, or that speaks no CURVE, receives nothing and the refusal is
// reported; a publisher without the mergers' secret key reaches no learner; a key file added to
// the allowed directory admits its learner at its next handshake; key files are written and read
// back with their modes, and bad ones are refused naming the file.
#include <catch2/catch.hpp>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>
#include <zmq.hpp>

#include "core/errors.h"
#include "core/zmq/curve.h"
#include "core/zmq/params_channel.h"

using namespace diloco;
using namespace std::chrono_literals;

namespace {

std::filesystem::path fresh_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("diloco-curve-" + name + "-" + std::to_string(::getpid()) + "-" + std::to_string(std::rand()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Publishes for up to `limit` until the subscriber receives (PUB/SUB needs the handshake and the
// subscription first); nothing when none arrived.
std::optional<ParamsSubscriber::Received> received_within(ParamsPublisher& pub, ParamsSubscriber& sub,
                                                          std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    pub.publish(1, std::vector<uint8_t>{4, 2});
    if (auto r = sub.receive(50ms)) return r;
  }
  return std::nullopt;
}

struct Decisions {
  std::mutex mutex;
  std::vector<ZapDecision> all;
  std::function<void(const ZapDecision&)> sink() {
    return [this](const ZapDecision& d) {
      std::lock_guard lock(mutex);
      all.push_back(d);
    };
  }
  size_t count(bool allowed) {
    std::lock_guard lock(mutex);
    size_t n = 0;
    for (const auto& d : all) n += d.allowed == allowed;
    return n;
  }
};

}  // namespace

TEST_CASE("key files are written with their modes and read back, and bad ones are refused naming the file",
          "[zmq][curve]") {
  const auto dir = fresh_dir("files");
  const CurveKeyPair keys = generate_curve_keys();
  CHECK(keys.public_key.size() == 40);
  CHECK(keys.secret_key.size() == 40);
  write_curve_keys(dir, "merger", keys);
  struct stat st {};
  REQUIRE(::stat((dir / "merger.key_secret").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  REQUIRE(::stat((dir / "merger.key").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0644);
  const auto both = read_curve_keys(dir / "merger.key_secret");
  CHECK(both.public_key == keys.public_key);
  CHECK(both.secret_key == keys.secret_key);
  const auto pub = read_curve_keys(dir / "merger.key");
  CHECK(pub.public_key == keys.public_key);
  CHECK(pub.secret_key.empty());

  ::chmod((dir / "merger.key_secret").c_str(), 0644);
  CHECK_THROWS_WITH(read_curve_keys(dir / "merger.key_secret"), Catch::Contains("readable by others") &&
                                                                     Catch::Contains("chmod 600"));
  std::ofstream(dir / "bad.key") << "public-key = \"not a key\"\n";
  CHECK_THROWS_WITH(read_curve_keys(dir / "bad.key"), Catch::Contains("bad.key") && Catch::Contains("40 Z85"));
  CHECK_THROWS_AS(read_curve_keys(dir / "missing.key"), IoError);
  CHECK_THROWS_AS(write_curve_keys(dir, "../x", keys), InvalidInput);
  std::filesystem::remove_all(dir);
}

TEST_CASE("only learners with an allowed key receive parameters, and only from the mergers' key", "[zmq][curve]") {
  const auto dir = fresh_dir("allow");
  const auto allowed_dir = dir / "learners";
  std::filesystem::create_directories(allowed_dir);
  const CurveKeyPair merger = generate_curve_keys();
  const CurveKeyPair good = generate_curve_keys();
  const CurveKeyPair stranger = generate_curve_keys();
  write_curve_keys(allowed_dir, "good", good);
  std::filesystem::remove(allowed_dir / "good.key_secret");  // the merger holds public keys only

  Decisions decisions;
  zmq::context_t merger_context;
  const CurveServerOptions server{.server = merger, .allowed_dir = allowed_dir};
  ParamsPublisher pub(merger_context, "tcp://127.0.0.1:*", 64, &server, decisions.sink());

  zmq::context_t learner_context;
  const CurveClientOptions good_client{.server_public_key = merger.public_key, .client = good};
  ParamsSubscriber allowed(learner_context, 256, "good", &good_client);
  allowed.connect(pub.bound_endpoint());
  auto got = received_within(pub, allowed, 10s);
  REQUIRE(got);
  CHECK(got->message == std::vector<uint8_t>{4, 2});
  CHECK(decisions.count(true) >= 1);

  // A key not on the list: the handshake fails, nothing arrives, the refusal is reported.
  const CurveClientOptions stranger_client{.server_public_key = merger.public_key, .client = stranger};
  ParamsSubscriber refused(learner_context, 256, "stranger", &stranger_client);
  refused.connect(pub.bound_endpoint());
  CHECK_FALSE(received_within(pub, refused, 2s));
  CHECK(decisions.count(false) >= 1);
  {
    std::lock_guard lock(decisions.mutex);
    bool named = false;
    for (const auto& d : decisions.all)
      if (!d.allowed && d.client_key == stranger.public_key) named = d.reason.find("not in") != std::string::npos;
    CHECK(named);
  }
  // No CURVE at all: nothing either.
  ParamsSubscriber plain(learner_context, 256, "plain");
  plain.connect(pub.bound_endpoint());
  CHECK_FALSE(received_within(pub, plain, 2s));

  // Its key file added to the directory: admitted at its next handshake (a learner started
  // again; libzmq does not retry a handshake the server refused).
  write_curve_keys(allowed_dir, "stranger", stranger);
  std::this_thread::sleep_for(1100ms);  // the handler looks at the directory at most once a second
  ParamsSubscriber admitted(learner_context, 256, "stranger2", &stranger_client);
  admitted.connect(pub.bound_endpoint());
  CHECK(received_within(pub, admitted, 10s));

  // A publisher without the mergers' secret key (an impostor): an allowed learner that names the
  // mergers' public key completes no handshake with it and receives nothing.
  zmq::context_t impostor_context;
  const CurveServerOptions fake{.server = generate_curve_keys(), .allowed_dir = allowed_dir};
  ParamsPublisher impostor(impostor_context, "tcp://127.0.0.1:*", 64, &fake);
  ParamsSubscriber fooled(learner_context, 256, "fooled", &good_client);
  fooled.connect(impostor.bound_endpoint());
  CHECK_FALSE(received_within(impostor, fooled, 2s));
  std::filesystem::remove_all(dir);
}

TEST_CASE("the ZAP handler refuses to start on a directory that is not there", "[zmq][curve]") {
  zmq::context_t context;
  CHECK_THROWS_WITH(ZapHandler(context, "/nonexistent/keys", {}), Catch::Contains("/nonexistent/keys") &&
                                                                      Catch::Contains("not a directory"));
}
