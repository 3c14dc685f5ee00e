// How Kafka clients reach a secured broker (scripts/secure, scripts/broker --secure): TLS to check
// the brokers, and the client's own certificate (mutual TLS) or SASL/SCRAM credentials to name
// its principal, whose ACLs then say what it may read and write. The settings come from the run
// config's [security] section and files, never from the command line, so no secret shows in `ps`.
#pragma once

#include <filesystem>
#include <string>

#include "core/kafka/options.h"

namespace diloco {

struct SecurityConfig;

// A credentials file of a SCRAM principal (mode 0600): `key=value` lines, `#` comments, with
// `username` and `password`.
struct KafkaCredentials {
  std::string username;
  std::string password;
};

// Reads and checks a credentials file. Throws IoError if it cannot be read, InvalidInput if it is
// readable by others than its owner or lacks a username or password (each message names the file).
KafkaCredentials read_kafka_credentials(const std::filesystem::path& file);

// The client side of [security] (kafka_protocol, kafka_ca, kafka_certificate, kafka_mechanism,
// kafka_credentials), credentials read from their file; a certificate file readable by others than
// its owner (it holds the private key) is refused with InvalidInput, one that is missing with IoError. With kafka_protocol = "plaintext" (the default) it leaves
// `kafka` as it is.
void apply_kafka_security(KafkaOptions& kafka, const SecurityConfig& security);

}  // namespace diloco
