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
                          // The fragments its learner took part in: some, each of the layout, once.
                          const uint32_t n = limits.layout->num_fragments();
                          expect(!s.fragments.empty() && s.fragments.size() <= n,
                                 "a saved state accepted with no fragment or more than the layout's");
                          std::vector<bool> seen(n, false);
                          for (const auto& f : s.fragments) {
                            expect(f.fragment < n, "a saved state accepted with a fragment the layout lacks");
                            expect(!seen[f.fragment], "a saved state accepted with a fragment twice");
                            seen[f.fragment] = true;
                          }
                        });
}
