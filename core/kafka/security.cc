#include "core/kafka/security.h"

#include <fstream>

#include "core/config/run_config.h"
#include "core/errors.h"
#include "core/files/secret_file.h"

namespace diloco {

namespace {

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t\r");
  if (begin == std::string::npos) return {};
  return s.substr(begin, s.find_last_not_of(" \t\r") - begin + 1);
}

}  // namespace

KafkaCredentials read_kafka_credentials(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in) throw IoError("cannot read Kafka credentials " + file.string() + " (security.kafka_credentials)");
  require_owner_only(file, "a password");
  KafkaCredentials out;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    line = trim(line);
    if (line.empty() || line[0] == '#') continue;
    const auto eq = line.find('=');
    const std::string key = eq == std::string::npos ? line : trim(line.substr(0, eq));
    if (eq == std::string::npos || (key != "username" && key != "password"))
      throw InvalidInput(file.string() + ":" + std::to_string(number) +
                         ": expected `username=NAME` or `password=SECRET`, found `" + key + "`");
    (key == "username" ? out.username : out.password) = trim(line.substr(eq + 1));
  }
  if (out.username.empty() || out.password.empty())
    throw InvalidInput(file.string() + ": needs both `username=` and `password=` lines");
  return out;
}

void apply_kafka_security(KafkaOptions& kafka, const SecurityConfig& security) {
  if (security.kafka_protocol == "plaintext") return;
  kafka.security.protocol = security.kafka_protocol;
  kafka.security.ca_file = security.kafka_ca;
  if (!security.kafka_certificate.empty()) {
    const std::filesystem::path file = security.kafka_certificate;
    if (!std::filesystem::is_regular_file(file))
      throw IoError("cannot read the Kafka client certificate " + file.string() +
                    " (security.kafka_certificate; scripts/secure init writes DIR/tls/NAME.pem for each principal)");
    require_owner_only(file, "a private key");
    kafka.security.certificate_file = file.string();
  }
  if (security.kafka_protocol == "sasl_ssl") {
    const KafkaCredentials credentials = read_kafka_credentials(security.kafka_credentials);
    kafka.security.mechanism = security.kafka_mechanism;
    kafka.security.username = credentials.username;
    kafka.security.password = credentials.password;
  }
}

}  // namespace diloco
