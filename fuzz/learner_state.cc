// decode_learner_state on a learner's saved state. An accepted one must survive
// encode_learner_state and decoding again bit for bit.
#include "core/codec/learner_state.h"
#include "fuzz/fuzz.h"

using namespace diloco;
using namespace diloco::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Decoding a saved state needs the layout.
  return message_target(data, size, Layout::Required, "LearnerState", decode_learner_state, encode_learner_state,
                        [](const SavedLearner& s, const DecodeLimits& limits) {
                          expect(s.fragments.size() == limits.layout->num_fragments(),
                                 "a saved state accepted without every fragment");
                        });
}
