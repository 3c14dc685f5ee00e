// The built-in model as a run config describes it: initialised from config.run.seed, with its
// fragment layout (core/model/builtin_specs.h), and its held-out evaluation.
#pragma once

#include <cstdint>

#include "core/config/run_config.h"
#include "core/data/corpus.h"
#include "core/fragments/layout.h"
#include "core/model/transformer.h"

namespace diloco {

struct ModelSetup {
  Transformer model;
  FragmentLayout layout;
};

// The model initialised from config.run.seed and its layout over config.diloco.fragments.
ModelSetup build_model(const RunConfig& config);

// Mean held-out loss (nats/char) over `batches` batches; the stream is rewound first, so every
// evaluation sees the same text.
double heldout_loss(const Transformer& model, BatchStream& heldout, int64_t batches);

}  // namespace diloco
