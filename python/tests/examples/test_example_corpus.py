"""The corpus port (examples/pytorch/kjv.py): splits, shards and batch streams."""
from __future__ import annotations

import pytest
import torch

import kjv

DATA = {"split": "iid", "heldout_fraction": 0.05}


def test_heldout_batches_are_the_same_in_every_stream_and_after_a_rewind(corpus: kjv.Corpus) -> None:
    first = kjv.heldout_batches(corpus, DATA, 16, 64)
    second = kjv.heldout_batches(corpus, DATA, 16, 64)
    drawn = [first.next() for _ in range(4)]
    for inputs, targets in drawn:
        again = second.next()
        assert torch.equal(inputs, again[0]) and torch.equal(targets, again[1])
        assert inputs.dtype == torch.int64 and inputs.shape == (16, 64)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next characters
    first.sequences = 0
    assert torch.equal(first.next()[0], drawn[0][0])


def test_one_chapter_in_twenty_is_held_out(corpus: kjv.Corpus) -> None:
    held = kjv.heldout_chapters(corpus, DATA)
    assert held[:3] == [19, 39, 59]
    assert len(held) == len(corpus.chapters) // 20


@pytest.mark.parametrize("split, regions", [("iid", 1), ("region", 2), ("region", 3)])
def test_shards_partition_the_training_chapters(corpus: kjv.Corpus, split: str, regions: int) -> None:
    data = {**DATA, "split": split}
    held = set(kjv.heldout_chapters(corpus, data))
    seen: set[int] = set()
    books_of_region = []
    for region in range(regions):
        books: set[int] = set()
        for learner in range(3):
            shard = set(kjv.training_chapters(corpus, data, kjv.ShardSpec(learner, 3, region, regions)))
            assert not shard & held, "a held-out chapter is in a training shard"
            assert not shard & seen, "two shards share a chapter"
            seen |= shard
            books |= {corpus.chapters[i].book for i in shard}
        books_of_region.append(books)
    assert seen | held == set(range(len(corpus.chapters)))
    if split == "region":
        assert all(not a & b for i, a in enumerate(books_of_region) for b in books_of_region[i + 1:])


def test_training_batches_depend_on_seed_and_shard_only(corpus: kjv.Corpus) -> None:
    def first_batch(seed: int, learner: int) -> torch.Tensor:
        return kjv.training_batches(corpus, DATA, kjv.ShardSpec(learner, 2), 4, 32, seed).next()[0]

    assert torch.equal(first_batch(1, 0), first_batch(1, 0))
    assert not torch.equal(first_batch(1, 0), first_batch(2, 0))
    assert not torch.equal(first_batch(1, 0), first_batch(1, 1))


def test_malformed_lines_are_named() -> None:
    good = b"Genesis\t1:1\tIn the beginning.\nGenesis\t1:2\tAnd.\nExodus\t1:1\tNow.\n"
    corpus = kjv.parse_corpus(good, "test")
    assert corpus.books == ["Genesis", "Exodus"] and len(corpus.chapters) == 2
    for text, message in [(b"Genesis 1:1 no tabs\n", r"test:1: missing tab"),
                          (b"Genesis\t1:x\ttext\n", r"test:1: bad reference '1:x'"),
                          (b"Genesis\t1:1\tcaf\xc3\xa9\n", r"test:1: character code 195"),
                          (good + b"Genesis\t2:1\tagain\n", r"test:4: book 'Genesis' continues")]:
        with pytest.raises(ValueError, match=message):
            kjv.parse_corpus(text, "test")
