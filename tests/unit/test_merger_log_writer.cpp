// The merger's transaction timeout grows with the bytes its largest transaction writes, so a
// large checkpoint over a slow link to the broker still commits (a fixed 10 s did not).
#include <catch2/catch.hpp>

#include "core/fragments/partition.h"
#include "merger/log_writer.h"

using namespace diloco;

TEST_CASE("the transaction timeout is the base plus the largest transaction's bytes at the slowest rate, capped",
          "[merger]") {
  // 10 s + 40 MB at 4 MB/s = 20 s.
  CHECK(transaction_timeout_ms(40'000'000, 10, 4e6) == 20000);
  CHECK(transaction_timeout_ms(0, 10, 4e6) == 10000);
  // 1 byte more rounds up to the next millisecond.
  CHECK(transaction_timeout_ms(40'000'001, 10, 4e6) == 20001);
  // A 1B-parameter checkpoint (16 GB) at 4 MB/s would need 4010 s: the broker allows 900.
  CHECK(transaction_timeout_ms(16'000'000'000ull, 10, 4e6) == kMaxTransactionTimeoutMs);
}

TEST_CASE("the largest transaction holds every fragment's checkpoint: parameters, momentum, residual, outer state",
          "[merger]") {
  const std::vector<TensorSpec> tensors{{"a", {1000, 10}}, {"b", {500}}, {"c", {20, 25}}};
  const FragmentLayout layout = partition_tensors(tensors, 2);
  REQUIRE(layout.numel() == 11000);
  CHECK(largest_transaction_bytes(layout, false, false) == 2 * 4 * 11000);
  CHECK(largest_transaction_bytes(layout, true, false) == 3 * 4 * 11000);
  CHECK(largest_transaction_bytes(layout, true, true) == 4 * 4 * 11000);
}

TEST_CASE("a checkpoint in fewer pieces leaves exactly the keys of the earlier pieces it does not overwrite", "[merger][chunks]") {
  using V = std::vector<std::string>;
  CHECK(stale_piece_keys("3", 5, 3) == V{"3/3", "3/4"});
  CHECK(stale_piece_keys("3", 3, 5).empty());      // every earlier key is written again
  CHECK(stale_piece_keys("3", 4, 4).empty());
  CHECK(stale_piece_keys("3", 3, 1) == V{"3/0", "3/1", "3/2"});  // now whole, under "3"
  CHECK(stale_piece_keys("3", 1, 4) == V{"3"});    // was whole, now in pieces
  CHECK(stale_piece_keys("3", 1, 1).empty());
  CHECK(stale_piece_keys("3", 0, 7).empty());      // nothing known of an earlier one
  CHECK(piece_count(4096, 4096) == 1);
  CHECK(piece_count(4097, 4096) == 2);
  CHECK(piece_count(0, 4096) == 1);
  CHECK(piece_count(3 * 4096, 4096) == 3);
}
