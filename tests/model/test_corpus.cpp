// The character corpus: parsing, held-out split, per-learner shards, resumable batches.
// Uses a small generated corpus file, not data/kjv.txt, so it runs before scripts/bootstrap.
#include <catch2/catch.hpp>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "core/data/corpus.h"
#include "core/errors.h"

using namespace diloco;
using Catch::Matchers::Contains;

namespace {

constexpr int kBooks = 4;
constexpr int kChaptersPerBook = 10;
constexpr int kVersesPerChapter = 3;

// Every verse's text is unique, so a verse line identifies where it came from.
std::string verse_text(int book, int chapter, int verse) {
  return diloco::detail::concat("Verse ", verse, " of chapter ", chapter, " of book ", book,
                        ": and it was so.");
}

// Book names may contain spaces and digits, as in "1 Samuel".
std::string book_name(int book) {
  return book == 1 ? "1 Second Book" : diloco::detail::concat("Book", book);
}

// Written to a per-process file (ctest may run test cases in parallel), loaded, removed.
Corpus load_test_corpus() {
  const auto path = std::filesystem::temp_directory_path() /
                    diloco::detail::concat("diloco_test_corpus_", getpid(), ".txt");
  {
    std::ofstream out(path);
    for (int b = 0; b < kBooks; ++b)
      for (int c = 1; c <= kChaptersPerBook; ++c)
        for (int v = 1; v <= kVersesPerChapter; ++v)
          out << book_name(b) << '\t' << c << ':' << v << '\t' << verse_text(b, c, v) << '\n';
  }
  Corpus corpus = load_corpus(path);
  std::filesystem::remove(path);
  return corpus;
}

const Corpus& test_corpus() {
  static const Corpus corpus = load_test_corpus();
  return corpus;
}

std::set<std::string> lines(const std::vector<uint8_t>& tokens) {
  std::set<std::string> out;
  std::string line;
  for (uint8_t t : tokens) {
    const char c = decode_token(t);
    if (c == '\n') {
      out.insert(line);
      line.clear();
    } else {
      line += c;
    }
  }
  REQUIRE(line.empty());  // streams end with a newline
  return out;
}

bool disjoint(const std::set<std::string>& a, const std::set<std::string>& b) {
  for (const auto& x : a)
    if (b.count(x)) return false;
  return true;
}

DataConfig data_config(DataSplit split, double heldout_fraction = 0.1) {
  DataConfig d;
  d.split = split;
  d.heldout_fraction = heldout_fraction;
  return d;
}

}  // namespace

TEST_CASE("the vocabulary is newline plus printable ASCII", "[corpus]") {
  CHECK(encode_char('\n') == 0);
  CHECK(encode_char(' ') == 1);
  CHECK(encode_char('~') == kVocabSize - 1);
  for (int c = ' '; c <= '~'; ++c) REQUIRE(decode_token(encode_char(static_cast<char>(c))) == c);
  CHECK_THROWS_AS(encode_char('\t'), InvalidInput);
  CHECK_THROWS_AS(encode_char(static_cast<char>(0xc3)), InvalidInput);
  CHECK_THROWS_AS(decode_token(kVocabSize), InvalidInput);
}

TEST_CASE("the corpus is parsed into books and chapters, references stripped", "[corpus]") {
  const Corpus& corpus = test_corpus();
  REQUIRE(corpus.books.size() == kBooks);
  CHECK(corpus.books[1] == "1 Second Book");
  REQUIRE(corpus.chapters.size() == kBooks * kChaptersPerBook);
  CHECK(corpus.chapters[kChaptersPerBook].book == 1);
  std::string first;
  for (uint8_t t : corpus.chapters[0].tokens) first += decode_token(t);
  CHECK(first == verse_text(0, 1, 1) + "\n" + verse_text(0, 1, 2) + "\n" + verse_text(0, 1, 3) +
                     "\n");
}

TEST_CASE("a missing corpus tells the user to run bootstrap", "[corpus]") {
  CHECK_THROWS_AS(load_corpus("/nonexistent/kjv.txt"), IoError);
  CHECK_THROWS_WITH(load_corpus("/nonexistent/kjv.txt"),
                    Contains("/nonexistent/kjv.txt") && Contains("scripts/bootstrap"));
}

TEST_CASE("malformed corpus lines are errors with the line number", "[corpus]") {
  CHECK_THROWS_WITH(parse_corpus("A\t1:1\tok\nA 1:2 no tabs\n", "c.txt"), Contains("c.txt:2"));
  CHECK_THROWS_WITH(parse_corpus("A\t1-1\tbad ref\n", "c.txt"), Contains("c.txt:1"));
  CHECK_THROWS_WITH(parse_corpus("A\t1:1\tcaf\xc3\xa9\n", "c.txt"),
                    Contains("c.txt:1") && Contains("vocabulary"));
  CHECK_THROWS_WITH(parse_corpus("A\t1:1\tx\nB\t1:1\ty\nA\t2:1\tz\n", "c.txt"),
                    Contains("c.txt:3"));
  CHECK_THROWS_AS(parse_corpus("", "c.txt"), InvalidInput);
}

TEST_CASE("held-out chapters are spread evenly and never trained on", "[corpus]") {
  const Corpus& corpus = test_corpus();
  std::vector<size_t> held;
  for (size_t i = 0; i < corpus.chapters.size(); ++i)
    if (is_heldout_chapter(i, 0.1)) held.push_back(i);
  CHECK(held == std::vector<size_t>({9, 19, 29, 39}));

  for (DataSplit split : {DataSplit::iid, DataSplit::region}) {
    const auto data = data_config(split);
    const auto heldout = lines(heldout_tokens(corpus, data));
    CHECK(heldout.size() == held.size() * kVersesPerChapter);
    const ShardSpec shard{.learner = 0, .num_learners = 1, .region = 0, .num_regions = 1};
    const auto training = lines(training_tokens(corpus, data, shard));
    CHECK(disjoint(training, heldout));
    CHECK(training.size() + heldout.size() == kBooks * kChaptersPerBook * kVersesPerChapter);
  }
}

TEST_CASE("iid shards are disjoint, cover the training set and are deterministic", "[corpus]") {
  const Corpus& corpus = test_corpus();
  const auto data = data_config(DataSplit::iid);
  const auto all = lines(training_tokens(corpus, data, ShardSpec{}));
  std::vector<std::set<std::string>> shards;
  for (uint32_t m = 0; m < 3; ++m) {
    const ShardSpec shard{.learner = m, .num_learners = 3};
    shards.push_back(lines(training_tokens(corpus, data, shard)));
    CHECK(training_tokens(corpus, data, shard) == training_tokens(corpus, data, shard));
  }
  size_t total = 0;
  for (size_t a = 0; a < shards.size(); ++a) {
    total += shards[a].size();
    for (size_t b = a + 1; b < shards.size(); ++b) CHECK(disjoint(shards[a], shards[b]));
  }
  CHECK(total == all.size());
  // Round-robin over chapters: every learner sees every book.
  for (int b = 0; b < kBooks; ++b) {
    bool seen = false;
    const std::string ending = diloco::detail::concat("of book ", b, ": and it was so.");
    for (const auto& l : shards[0]) seen |= l.ends_with(ending);
    CHECK(seen);
  }
  CHECK_THROWS_AS(training_tokens(corpus, data, ShardSpec{.learner = 3, .num_learners = 3}),
                  InvalidInput);
}

TEST_CASE("region shards train on different books", "[corpus]") {
  const Corpus& corpus = test_corpus();
  const auto data = data_config(DataSplit::region);
  std::vector<std::set<std::string>> shards;
  for (uint32_t r = 0; r < 2; ++r)
    for (uint32_t m = 0; m < 2; ++m)
      shards.push_back(lines(training_tokens(
          corpus, data,
          ShardSpec{.learner = m, .num_learners = 2, .region = r, .num_regions = 2})));
  for (size_t a = 0; a < shards.size(); ++a)
    for (size_t b = a + 1; b < shards.size(); ++b) CHECK(disjoint(shards[a], shards[b]));
  // Books are cut into halves of about equal size: books 0-1 in region 0, 2-3 in region 1.
  const auto books_of = [](const std::set<std::string>& shard) {
    std::set<char> books;
    for (const auto& l : shard) books.insert(l[l.find("of book ") + 8]);
    return books;
  };
  CHECK(books_of(shards[0]) == std::set<char>({'0', '1'}));
  CHECK(books_of(shards[1]) == std::set<char>({'0', '1'}));
  CHECK(books_of(shards[2]) == std::set<char>({'2', '3'}));
  CHECK(books_of(shards[3]) == std::set<char>({'2', '3'}));

  CHECK_THROWS_AS(training_tokens(corpus, data, ShardSpec{.region = 2, .num_regions = 2}),
                  InvalidInput);
  CHECK_THROWS_AS(training_tokens(corpus, data, ShardSpec{.region = 0, .num_regions = 5}),
                  InvalidInput);  // 4 books cannot fill 5 regions
}

TEST_CASE("batches are next-character pairs drawn from the shard", "[corpus]") {
  const Corpus& corpus = test_corpus();
  const auto data = data_config(DataSplit::iid);
  auto stream = training_batches(corpus, data, ShardSpec{}, 4, 16, 1);
  const Batch batch = stream.next();
  REQUIRE(batch.input.sizes() == torch::IntArrayRef({4, 16}));
  REQUIRE(batch.target.sizes() == torch::IntArrayRef({4, 16}));
  CHECK(batch.input.scalar_type() == torch::kInt64);
  CHECK(torch::equal(batch.input.narrow(1, 1, 15), batch.target.narrow(1, 0, 15)));
  CHECK(batch.input.min().item<int64_t>() >= 0);
  CHECK(batch.input.max().item<int64_t>() < kVocabSize);
  CHECK(stream.cursor().sequences == 4);
}

TEST_CASE("batch streams are deterministic and resume from a saved cursor", "[corpus]") {
  const Corpus& corpus = test_corpus();
  const auto data = data_config(DataSplit::iid);
  const ShardSpec shard{.learner = 1, .num_learners = 2};
  auto a = training_batches(corpus, data, shard, 3, 8, 42);
  auto b = training_batches(corpus, data, shard, 3, 8, 42);
  for (int i = 0; i < 3; ++i) REQUIRE(torch::equal(a.next().input, b.next().input));

  const DataCursor saved = a.cursor();
  const Batch expected = a.next();
  auto resumed = training_batches(corpus, data, shard, 3, 8, 42);
  resumed.restore(saved);
  const Batch got = resumed.next();
  CHECK(torch::equal(got.input, expected.input));
  CHECK(torch::equal(got.target, expected.target));
  CHECK(resumed.cursor() == a.cursor());

  auto other_seed = training_batches(corpus, data, shard, 3, 8, 43);
  CHECK_FALSE(torch::equal(other_seed.next().input,
                           training_batches(corpus, data, shard, 3, 8, 42).next().input));
}

TEST_CASE("held-out batches do not depend on the learner or seed", "[corpus]") {
  const Corpus& corpus = test_corpus();
  auto a = heldout_batches(corpus, data_config(DataSplit::iid), 2, 8);
  auto b = heldout_batches(corpus, data_config(DataSplit::region), 2, 8);
  const Batch first = a.next();
  CHECK(torch::equal(first.input, b.next().input));
  a.restore({});
  CHECK(torch::equal(a.next().input, first.input));
}

TEST_CASE("a shard shorter than one sequence is an error", "[corpus]") {
  const Corpus corpus = parse_corpus("A\t1:1\tshort\nA\t2:1\tshorter\n", "c.txt");
  CHECK_THROWS_AS(training_batches(corpus, data_config(DataSplit::iid, 0.5), ShardSpec{}, 1, 64, 1),
                  InvalidInput);
}
