// The training data: the King James Bible as a character corpus (data/kjv.txt, written by
// scripts/extract-kjv during scripts/bootstrap), its held-out split, per-learner shards and
// resumable batch sampling.
//
// File format: one verse per line, "Book<TAB>chapter:verse<TAB>text". The model sees only the
// verse text, each verse followed by '\n'; references are stripped so that the model learns
// English, not verse numbering.
//
// Splits (all deterministic, the same in every process):
//  - held-out: chapters are numbered in file order and chapter i is held out iff
//    floor((i + 1) * f) > floor(i * f) for f = heldout_fraction, i.e. one chapter in every 1/f,
//    evenly spread over all books (so every region's books are represented in the eval).
//  - iid shard: the training chapters (in file order) are dealt out round-robin, learner m of M
//    gets training chapters m, m + M, m + 2M, ...
//  - region shard: the books are cut into R contiguous groups of about equal size (a book belongs
//    to the region its middle character falls into), and the learners of region r deal out that
//    region's training chapters round-robin as above. Different regions see different books.
// A shard's chapters are concatenated into one token stream; batches are windows of
// context + 1 tokens at pseudo-random offsets in that stream.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "core/config/run_config.h"
#include "core/model/builtin_specs.h"

namespace diloco {

// The fixed vocabulary (kVocabSize): '\n' is token 0, printable ASCII ' '..'~' are tokens 1..95.
uint8_t encode_char(char c);  // throws InvalidInput for a character outside the vocabulary
char decode_token(int64_t token);

struct Chapter {
  uint32_t book = 0;            // index into Corpus::books
  std::vector<uint8_t> tokens;  // the chapter's verses, each ending in '\n'
};

struct Corpus {
  std::vector<std::string> books;  // in file order
  std::vector<Chapter> chapters;   // in file order
};

// Throws IoError (telling the user to run scripts/bootstrap) if the file is missing, InvalidInput
// (with the line number) for a malformed line or a character outside the vocabulary.
Corpus load_corpus(const std::filesystem::path& file);
Corpus parse_corpus(std::string_view text, std::string_view origin);

bool is_heldout_chapter(size_t chapter_index, double heldout_fraction);

// Which learner a shard is for (the split itself is DataConfig::split).
struct ShardSpec {
  uint32_t learner = 0;       // index among the learners sharing the pool: all learners for the
  uint32_t num_learners = 1;  // iid split, the learners of the same region for the region split
  uint32_t region = 0;        // region split only
  uint32_t num_regions = 1;
};

// Token streams of a learner's shard and of the held-out split. Throw InvalidInput if the spec
// is out of range or leaves a learner (or region) without chapters.
std::vector<uint8_t> training_tokens(const Corpus& corpus, const DataConfig& data,
                                     const ShardSpec& shard);
std::vector<uint8_t> heldout_tokens(const Corpus& corpus, const DataConfig& data);

// Inputs and next-character targets, int64 [batch, context].
struct Batch {
  torch::Tensor input;
  torch::Tensor target;
};

// Where a BatchStream is: the number of sequences drawn so far. Saving it and restoring it later
// continues with exactly the batches that would have come next.
struct DataCursor {
  uint64_t sequences = 0;
  bool operator==(const DataCursor&) const = default;
};

// Windows of context + 1 tokens at offsets that are a pure function of (key, sequence number),
// so the position is one counter and resuming costs nothing.
class BatchStream {
 public:
  // Throws InvalidInput if the stream has fewer than context + 1 tokens.
  BatchStream(std::vector<uint8_t> tokens, int64_t batch, int64_t context, uint64_t key);

  Batch next();
  DataCursor cursor() const { return cursor_; }
  void restore(DataCursor cursor) { cursor_ = cursor; }
  size_t num_tokens() const { return tokens_.size(); }

 private:
  std::vector<uint8_t> tokens_;
  int64_t batch_;
  int64_t context_;
  uint64_t key_;
  DataCursor cursor_;
};

// A learner's training batches; the sampling key mixes the seed with the shard, so learners
// with the same seed still draw independently.
BatchStream training_batches(const Corpus& corpus, const DataConfig& data, const ShardSpec& shard,
                             int64_t batch, int64_t context, uint64_t seed);

// Held-out batches drawn with a fixed key, independent of the seed and the learner: restore({})
// before each evaluation and every evaluation, of every learner and run, sees the same text.
BatchStream heldout_batches(const Corpus& corpus, const DataConfig& data, int64_t batch,
                            int64_t context);

}  // namespace diloco
