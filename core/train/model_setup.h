// What every process of a run derives identically from the run config: the seeded model, its
// fragment layout and fingerprint, version 0 of every fragment (genesis), and the held-out
// evaluation. Learners, mergers and replay all call these, so they can never disagree.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "core/codec/messages.h"
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

// The layout and fingerprint build_model gives, without allocating or initialising the model.
FragmentLayout build_layout(const RunConfig& config);

// The seeded values of `fragments` (layout order per fragment), bit for bit those of build_model,
// generated tensor by tensor: only the wanted fragments are held, beside one scratch tensor. This
// is how a merger writes version 0 without a model of every fragment (4 bytes per parameter).
std::map<uint32_t, std::vector<DenseTensor>> seeded_fragments(const RunConfig& config, const FragmentLayout& layout,
                                                              std::span<const uint32_t> fragments);

// Fragment p's tensors as dense fp32 with their shapes, in layout order.
std::vector<DenseTensor> fragment_tensors(const Transformer& model, const FragmentLayout& layout, uint32_t p);
// Writes dense tensors (layout order) into fragment p of the model.
void load_fragment(Transformer& model, const FragmentLayout& layout, uint32_t p,
                   const std::vector<DenseTensor>& tensors);

// Version 0 of fragment p: the seeded parameters, zero outer momentum (and a zero outer_state
// when merger.optimizer keeps one), no consumed offsets.
FragmentState genesis_state(const RunConfig& config, const ModelSetup& setup, uint32_t p);
// The same from fragment p's seeded tensors (seeded_fragments).
FragmentState genesis_state(const RunConfig& config, const FragmentLayout& layout, uint32_t p,
                            std::vector<DenseTensor> params);

// Mean held-out loss (nats/char) over `batches` batches; the stream is rewound first, so every
// evaluation sees the same text.
double heldout_loss(const Transformer& model, BatchStream& heldout, int64_t batches);

}  // namespace diloco
