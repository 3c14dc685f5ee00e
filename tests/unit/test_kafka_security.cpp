// The client side of a secured broker (core/kafka/security.h): [security]'s Kafka settings and
// their checks, credentials files (mode, format), and the librdkafka properties a client gets.
// The broker side (TLS, SCRAM, ACLs) is tested on a real secured broker in
// tests/integration/test_secure_kafka.cpp.
#include <catch2/catch.hpp>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "core/config/run_config.h"
#include "core/errors.h"
#include "core/kafka/client_config.h"
#include "core/kafka/security.h"

using namespace diloco;
using Catch::Matchers::Contains;

namespace {

std::filesystem::path write_file(const std::string& name, const std::string& text, mode_t mode) {
  auto dir = std::filesystem::temp_directory_path() / ("diloco-kafka-security-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto path = dir / name;
  std::ofstream(path) << text;
  ::chmod(path.c_str(), mode);
  return path;
}

RunConfig with_security(const std::string& toml) { return parse_run_config("[security]\n" + toml, "s.toml"); }

std::string property(RdKafka::Conf& conf, const std::string& key) {
  std::string value;
  REQUIRE(conf.get(key, value) == RdKafka::Conf::CONF_OK);
  return value;
}

}  // namespace

TEST_CASE("a credentials file gives its username and password, and a bad one is refused naming the file", "[kafka][security]") {
  const auto good = write_file("l0.credentials", "# learner-0\nusername=learner-0\n  password = s3cr=t \n", 0600);
  const KafkaCredentials c = read_kafka_credentials(good);
  CHECK(c.username == "learner-0");
  CHECK(c.password == "s3cr=t");  // only the first '=' separates

  const auto open = write_file("open.credentials", "username=a\npassword=b\n", 0644);
  CHECK_THROWS_WITH(read_kafka_credentials(open), Contains("readable by others") && Contains("chmod 600"));
  const auto no_password = write_file("nopw.credentials", "username=a\n", 0600);
  CHECK_THROWS_WITH(read_kafka_credentials(no_password), Contains("nopw.credentials") && Contains("password="));
  const auto junk = write_file("junk.credentials", "username=a\nuser=b\n", 0600);
  CHECK_THROWS_WITH(read_kafka_credentials(junk), Contains("junk.credentials:2") && Contains("`user`"));
  CHECK_THROWS_AS(read_kafka_credentials("/nonexistent/x.credentials"), IoError);
}

TEST_CASE("[security]'s Kafka settings are checked against each other", "[kafka][security][config]") {
  CHECK_NOTHROW(validate_run_config(RunConfig{}));
  CHECK(RunConfig{}.security.kafka_protocol == "plaintext");
  CHECK_NOTHROW(validate_run_config(with_security("kafka_protocol = \"sasl_ssl\"\nkafka_credentials = \"x\"\n")));
  CHECK_NOTHROW(validate_run_config(with_security("kafka_protocol = \"ssl\"\nkafka_ca = \"ca.pem\"\n")));
  CHECK_THROWS_WITH(validate_run_config(with_security("kafka_protocol = \"tls\"\n")),
                    Contains("security.kafka_protocol must be"));
  CHECK_THROWS_WITH(validate_run_config(with_security("kafka_protocol = \"sasl_ssl\"\n")),
                    Contains("needs security.kafka_credentials"));
  CHECK_THROWS_WITH(validate_run_config(with_security("kafka_credentials = \"x\"\n")),
                    Contains("the password would not be used"));
  CHECK_THROWS_WITH(validate_run_config(with_security("kafka_ca = \"ca.pem\"\n")), Contains("to use TLS"));
  CHECK_THROWS_WITH(validate_run_config(with_security("kafka_certificate = \"tls/l0.pem\"\n")),
                    Contains("to present it"));
  CHECK_THROWS_WITH(
      validate_run_config(with_security("kafka_protocol = \"sasl_ssl\"\nkafka_credentials = \"x\"\nkafka_mechanism = \"PLAIN\"\n")),
      Contains("security.kafka_mechanism must be"));
  // The parameter half's checks (core/zmq/curve.h) in the same section.
  CHECK_THROWS_WITH(validate_run_config(with_security("merger_secret_key = \"m.key_secret\"\n")),
                    Contains("needs security.allowed_learners"));
  CHECK_THROWS_WITH(validate_run_config(with_security("learner_key = \"l.key_secret\"\n")),
                    Contains("needs security.merger_public_key"));
}

TEST_CASE("a client of a secured broker gets TLS, the CA and its SCRAM principal, a plaintext one none", "[kafka][security]") {
  const auto credentials = write_file("m0.credentials", "username=merger-0\npassword=pw-of-merger\n", 0600);
  RunConfig config = with_security("kafka_protocol = \"sasl_ssl\"\nkafka_ca = \"/x/ca.pem\"\nkafka_credentials = \"" +
                                   credentials.string() + "\"\n");
  KafkaOptions kafka;
  apply_kafka_security(kafka, config.security);
  CHECK(kafka.security.protocol == "sasl_ssl");
  CHECK(kafka.security.username == "merger-0");
  CHECK(kafka.security.password == "pw-of-merger");
  // The CA file does not exist: librdkafka checks it when a client is created, not here.
  auto conf = kafka_detail::base_config(kafka, kafka_detail::ClientKind::Consumer);
  CHECK(property(*conf, "security.protocol") == "sasl_ssl");
  CHECK(property(*conf, "ssl.ca.location") == "/x/ca.pem");
  CHECK(property(*conf, "sasl.mechanisms") == "SCRAM-SHA-512");
  CHECK(property(*conf, "sasl.username") == "merger-0");

  KafkaOptions plain;
  apply_kafka_security(plain, RunConfig{}.security);
  CHECK(plain.security.protocol == "plaintext");
  auto plain_conf = kafka_detail::base_config(plain, kafka_detail::ClientKind::Producer);
  CHECK(property(*plain_conf, "security.protocol") == "plaintext");

  // A credentials file that is not there stops the process before it reaches the broker.
  config.security.kafka_credentials = "/nonexistent/m0.credentials";
  CHECK_THROWS_WITH(apply_kafka_security(kafka, config.security), Contains("/nonexistent/m0.credentials"));
}

TEST_CASE("a client of a broker on mutual TLS presents its own key and certificate, kept 0600", "[kafka][security]") {
  const auto pem = write_file("learner-0.pem", "-----BEGIN PRIVATE KEY-----\n", 0600);
  RunConfig config = with_security("kafka_protocol = \"ssl\"\nkafka_ca = \"/x/ca.pem\"\nkafka_certificate = \"" +
                                   pem.string() + "\"\n");
  CHECK_NOTHROW(validate_run_config(config));
  KafkaOptions kafka;
  apply_kafka_security(kafka, config.security);
  CHECK(kafka.security.protocol == "ssl");
  CHECK(kafka.security.certificate_file == pem.string());
  CHECK(kafka.security.username.empty());
  auto conf = kafka_detail::base_config(kafka, kafka_detail::ClientKind::Producer);
  CHECK(property(*conf, "security.protocol") == "ssl");
  CHECK(property(*conf, "ssl.certificate.location") == pem.string());
  CHECK(property(*conf, "ssl.key.location") == pem.string());

  config.security.kafka_certificate = write_file("open.pem", "x", 0644).string();
  CHECK_THROWS_WITH(apply_kafka_security(kafka, config.security), Contains("readable by others") && Contains("open.pem"));
  config.security.kafka_certificate = "/nonexistent/tls/learner-0.pem";
  CHECK_THROWS_AS(apply_kafka_security(kafka, config.security), IoError);
}
