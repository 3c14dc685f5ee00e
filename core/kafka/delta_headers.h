// Plain-text Kafka headers carrying a delta's routing metadata, so standard tools (kcat,
// kafka-console-consumer) show who sent what without decoding the payload.
#pragma once

#include "core/codec/messages.h"
#include "core/kafka/options.h"

namespace diloco {

inline Headers delta_headers(const DeltaHeader& h) {
  return {{"run", h.run_id},
          {"learner", h.learner_id},
          {"region", h.region},
          {"fragment", std::to_string(h.fragment)},
          {"seq", std::to_string(h.seq)},
          {"base_version", std::to_string(h.base_version)}};
}

}  // namespace diloco
