#include "core/data/corpus.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "core/errors.h"

namespace diloco {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t mix(uint64_t h, uint64_t v) { return splitmix64(h ^ splitmix64(v)); }

// Fixed, so that held-out batches do not depend on the run's seed.
constexpr uint64_t kHeldoutKey = 0x68656c646f7574ULL;  // "heldout"
constexpr uint64_t kTrainingDomain = 0x747261696eULL;   // "train"

[[noreturn]] void malformed(std::string_view origin, size_t line, std::string_view why) {
  throw InvalidInput(detail::concat(origin, ":", line, ": ", why,
                                    " (expected Book<TAB>chapter:verse<TAB>text)"));
}

bool all_digits(std::string_view s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos;
}

// The region of every book: contiguous groups of about equal size in characters.
std::vector<uint32_t> book_regions(const Corpus& corpus, uint32_t num_regions) {
  std::vector<double> size(corpus.books.size(), 0.0);
  double total = 0;
  for (const auto& c : corpus.chapters) {
    size[c.book] += static_cast<double>(c.tokens.size());
    total += static_cast<double>(c.tokens.size());
  }
  std::vector<uint32_t> region(corpus.books.size());
  std::vector<size_t> books_in_region(num_regions, 0);
  double before = 0;
  for (size_t b = 0; b < size.size(); ++b) {
    const double middle = before + size[b] / 2;
    region[b] = std::min(num_regions - 1, static_cast<uint32_t>(num_regions * middle / total));
    ++books_in_region[region[b]];
    before += size[b];
  }
  for (uint32_t r = 0; r < num_regions; ++r)
    if (books_in_region[r] == 0)
      throw InvalidInput(detail::concat("cannot split the corpus's ", corpus.books.size(),
                                        " books into ", num_regions,
                                        " regions of similar size: region ", r, " gets no book"));
  return region;
}

}  // namespace

uint8_t encode_char(char c) {
  if (c == '\n') return 0;
  if (c >= ' ' && c <= '~') return static_cast<uint8_t>(c - ' ' + 1);
  throw InvalidInput(detail::concat("character code ", static_cast<int>(static_cast<uint8_t>(c)),
                                    " is not in the vocabulary (printable ASCII and newline)"));
}

char decode_token(int64_t token) {
  if (token == 0) return '\n';
  if (token >= 1 && token < kVocabSize) return static_cast<char>(' ' + token - 1);
  throw InvalidInput(detail::concat("token ", token, " is outside the vocabulary of ", kVocabSize));
}

Corpus parse_corpus(std::string_view text, std::string_view origin) {
  Corpus corpus;
  std::string_view chapter_ref;  // "book\tchapter" of the chapter being filled
  size_t line_number = 0;
  while (!text.empty()) {
    const size_t end = std::min(text.find('\n'), text.size());
    const std::string_view line = text.substr(0, end);
    text.remove_prefix(std::min(end + 1, text.size()));
    ++line_number;
    if (line.empty()) continue;

    const size_t tab1 = line.find('\t');
    const size_t tab2 = tab1 == std::string_view::npos ? tab1 : line.find('\t', tab1 + 1);
    if (tab2 == std::string_view::npos) malformed(origin, line_number, "missing tab");
    const std::string_view book = line.substr(0, tab1);
    const std::string_view reference = line.substr(tab1 + 1, tab2 - tab1 - 1);
    const std::string_view verse = line.substr(tab2 + 1);
    const size_t colon = reference.find(':');
    if (book.empty() || colon == std::string_view::npos ||
        !all_digits(reference.substr(0, colon)) || !all_digits(reference.substr(colon + 1)))
      malformed(origin, line_number, detail::concat("bad reference '", reference, "'"));

    const std::string_view this_chapter = line.substr(0, tab1 + 1 + colon);
    if (corpus.chapters.empty() || this_chapter != chapter_ref) {
      if (corpus.books.empty() || corpus.books.back() != book) {
        for (const auto& known : corpus.books)
          if (known == book)
            malformed(origin, line_number,
                      detail::concat("book '", book, "' continues after another book"));
        corpus.books.emplace_back(book);
      }
      corpus.chapters.push_back(Chapter{static_cast<uint32_t>(corpus.books.size() - 1), {}});
      chapter_ref = this_chapter;
    }
    auto& tokens = corpus.chapters.back().tokens;
    try {
      for (char c : verse) tokens.push_back(encode_char(c));
    } catch (const InvalidInput& e) {
      malformed(origin, line_number, e.what());
    }
    tokens.push_back(encode_char('\n'));
  }
  if (corpus.chapters.empty()) throw InvalidInput(detail::concat(origin, ": no verses"));
  return corpus;
}

Corpus load_corpus(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in)
    throw IoError(detail::concat(
        "cannot read the corpus ", file.string(),
        ": run scripts/bootstrap (it writes it with scripts/extract-kjv)"));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw IoError(detail::concat("error reading the corpus ", file.string()));
  return parse_corpus(text.str(), file.string());
}

bool is_heldout_chapter(size_t chapter_index, double heldout_fraction) {
  const double i = static_cast<double>(chapter_index);
  return std::floor((i + 1) * heldout_fraction) > std::floor(i * heldout_fraction);
}

std::vector<uint8_t> training_tokens(const Corpus& corpus, const DataConfig& data,
                                     const ShardSpec& shard) {
  if (shard.num_learners == 0 || shard.learner >= shard.num_learners)
    throw InvalidInput(detail::concat("shard: learner ", shard.learner,
                                      " is not below the number of learners ", shard.num_learners));
  const bool by_region = data.split == DataSplit::region;
  if (by_region && (shard.num_regions == 0 || shard.region >= shard.num_regions))
    throw InvalidInput(detail::concat("shard: region ", shard.region,
                                      " is not below the number of regions ", shard.num_regions));
  const std::vector<uint32_t> regions =
      by_region ? book_regions(corpus, shard.num_regions) : std::vector<uint32_t>{};

  std::vector<uint8_t> tokens;
  size_t pool_index = 0;  // position among the training chapters of this learner's pool
  for (size_t i = 0; i < corpus.chapters.size(); ++i) {
    const Chapter& c = corpus.chapters[i];
    if (is_heldout_chapter(i, data.heldout_fraction)) continue;
    if (by_region && regions[c.book] != shard.region) continue;
    if (pool_index++ % shard.num_learners == shard.learner)
      tokens.insert(tokens.end(), c.tokens.begin(), c.tokens.end());
  }
  if (tokens.empty())
    throw InvalidInput(detail::concat("shard of learner ", shard.learner, " of ",
                                      shard.num_learners, " (", data_split_name(data.split),
                                      " split) has no training chapters"));
  return tokens;
}

std::vector<uint8_t> heldout_tokens(const Corpus& corpus, const DataConfig& data) {
  std::vector<uint8_t> tokens;
  for (size_t i = 0; i < corpus.chapters.size(); ++i)
    if (is_heldout_chapter(i, data.heldout_fraction))
      tokens.insert(tokens.end(), corpus.chapters[i].tokens.begin(),
                    corpus.chapters[i].tokens.end());
  if (tokens.empty())
    throw InvalidInput(detail::concat("held-out fraction ", data.heldout_fraction, " of ",
                                      corpus.chapters.size(), " chapters holds out none"));
  return tokens;
}

BatchStream::BatchStream(std::vector<uint8_t> tokens, int64_t batch, int64_t context,
                         uint64_t key)
    : tokens_(std::move(tokens)), batch_(batch), context_(context), key_(key) {
  if (batch < 1 || context < 1)
    throw InvalidInput(detail::concat("batch (", batch, ") and context (", context,
                                      ") must be positive"));
  if (tokens_.size() < static_cast<size_t>(context) + 1)
    throw InvalidInput(detail::concat("a stream of ", tokens_.size(),
                                      " tokens is too short for sequences of context ", context,
                                      "; use fewer learners or regions or a smaller context"));
}

Batch BatchStream::next() {
  auto input = torch::empty({batch_, context_}, torch::kInt64);
  auto target = torch::empty({batch_, context_}, torch::kInt64);
  int64_t* in = input.data_ptr<int64_t>();
  int64_t* out = target.data_ptr<int64_t>();
  const uint64_t starts = tokens_.size() - static_cast<size_t>(context_);
  for (int64_t b = 0; b < batch_; ++b) {
    const uint8_t* window = tokens_.data() + mix(key_, cursor_.sequences++) % starts;
    for (int64_t t = 0; t < context_; ++t) {
      *in++ = window[t];
      *out++ = window[t + 1];
    }
  }
  return Batch{input, target};
}

BatchStream training_batches(const Corpus& corpus, const DataConfig& data, const ShardSpec& shard,
                             int64_t batch, int64_t context, uint64_t seed) {
  uint64_t key = mix(kTrainingDomain, seed);
  for (uint64_t v : {uint64_t(data.split), uint64_t(shard.learner), uint64_t(shard.num_learners),
                     uint64_t(shard.region), uint64_t(shard.num_regions)})
    key = mix(key, v);
  return BatchStream(training_tokens(corpus, data, shard), batch, context, key);
}

BatchStream heldout_batches(const Corpus& corpus, const DataConfig& data, int64_t batch,
                            int64_t context) {
  return BatchStream(heldout_tokens(corpus, data), batch, context, kHeldoutKey);
}

}  // namespace diloco
