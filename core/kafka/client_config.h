// Internal: building librdkafka configurations from the project's options.
#pragma once

#include <librdkafka/rdkafkacpp.h>

#include <memory>
#include <string>

#include "core/kafka/options.h"

namespace diloco::kafka_detail {

// Sets a property or throws InvalidInput naming it.
void set(RdKafka::Conf& conf, const std::string& key, const std::string& value);

// A global configuration with the options common to every client: bootstrap servers, client id,
// message and fetch size limits consistent with the broker, quiet connection logs, extras.
enum class ClientKind { Producer, Consumer };
std::unique_ptr<RdKafka::Conf> base_config(const KafkaOptions& options, ClientKind kind);

// Headers as librdkafka headers (caller owns the result until produce() succeeds).
RdKafka::Headers* to_rdkafka(const Headers& headers);
Headers from_rdkafka(const RdKafka::Headers* headers);

}  // namespace diloco::kafka_detail
