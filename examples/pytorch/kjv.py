"""The King James Bible as a character corpus, in Python: a port of core/data/corpus.{h,cc}.

A Python learner that shares a run with diloco-learner must see the same held-out text and the
same kind of training shard, so everything here follows the C++ code step by step:

- the vocabulary: '\\n' is token 0, printable ASCII ' '..'~' are tokens 1..95;
- the file (data/kjv.txt, written by scripts/bootstrap): one verse per line,
  "Book<TAB>chapter:verse<TAB>text"; the model sees only the text, each verse followed by '\\n';
- the held-out split: chapter i (in file order) is held out iff
  floor((i + 1) * f) > floor(i * f) for f = data.heldout_fraction;
- data.split = "iid": learner m of M takes training chapters m, m + M, m + 2M, ...;
  data.split = "region": books are cut into R contiguous groups of about equal size (a book goes
  to the region its middle character falls into) and the learners of a region deal out that
  region's training chapters the same way;
- batches: windows of context + 1 tokens at offsets mix(key, sequence number) modulo the number
  of start positions, mix being C++'s hash of two splitmix64 rounds.

Held-out batches are the C++ ones exactly (same text, same order). Training batches match C++ bit
for bit too, for the same seed, split, learner index, number of learners, region index and
number of regions: the key and the offset generator are the C++ ones (python/tests/examples
checks both against diloco-learner).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VOCAB_SIZE = 96

# Byte -> token; 255 marks a byte outside the vocabulary.
_ENCODE = np.full(256, 255, dtype=np.uint8)
_ENCODE[ord("\n")] = 0
_ENCODE[ord(" "):ord("~") + 1] = np.arange(1, VOCAB_SIZE, dtype=np.uint8)

_MASK64 = (1 << 64) - 1
# Fixed, so that held-out batches do not depend on the run's seed.
_HELDOUT_KEY = 0x68656C646F7574  # "heldout"
_TRAINING_DOMAIN = 0x747261696E  # "train"
_SPLITS = {"iid": 0, "region": 1}  # the values of the C++ enum DataSplit, part of the sampling key


@dataclass
class Chapter:
    book: int            # index into Corpus.books
    tokens: np.ndarray   # uint8: the chapter's verses, each ending in '\n'


@dataclass
class Corpus:
    books: list[str]        # in file order
    chapters: list[Chapter]  # in file order


def load_corpus(path: str | Path) -> Corpus:
    """Reads data/kjv.txt; raises FileNotFoundError (pointing at scripts/bootstrap) or ValueError."""
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"cannot read the corpus {path}: run scripts/bootstrap (it writes it with scripts/extract-kjv)"
        ) from None
    return parse_corpus(text, str(path))


def parse_corpus(text: bytes, origin: str) -> Corpus:
    """Parses the corpus file's bytes; `origin` names it in error messages (with the line number)."""
    def malformed(line_number: int, why: str) -> ValueError:
        return ValueError(f"{origin}:{line_number}: {why} (expected Book<TAB>chapter:verse<TAB>text)")

    books: list[str] = []
    chapter_books: list[int] = []
    chapter_pieces: list[list[np.ndarray]] = []  # per chapter: its verses and their newlines
    chapter_ref = b""  # b"book\tchapter" of the chapter being filled
    newline = np.zeros(1, dtype=np.uint8)
    for line_number, line in enumerate(text.split(b"\n"), start=1):
        if not line:
            continue
        fields = line.split(b"\t", 2)
        if len(fields) < 3:
            raise malformed(line_number, "missing tab")
        book, reference, verse = fields
        chapter, colon, number = reference.partition(b":")
        if not book or not colon or not chapter.isdigit() or not number.isdigit():
            raise malformed(line_number, f"bad reference '{reference.decode(errors='replace')}'")

        this_chapter = book + b"\t" + chapter
        if not chapter_pieces or this_chapter != chapter_ref:
            name = book.decode("latin-1")
            if not books or books[-1] != name:
                if name in books:
                    raise malformed(line_number, f"book '{name}' continues after another book")
                books.append(name)
            chapter_books.append(len(books) - 1)
            chapter_pieces.append([])
            chapter_ref = this_chapter
        tokens = _ENCODE[np.frombuffer(verse, dtype=np.uint8)]
        bad = np.flatnonzero(tokens == 255)
        if bad.size:
            raise malformed(line_number, f"character code {verse[bad[0]]} is not in the vocabulary "
                                         "(printable ASCII and newline)")
        chapter_pieces[-1] += [tokens, newline]
    if not chapter_pieces:
        raise ValueError(f"{origin}: no verses")
    return Corpus(books, [Chapter(b, np.concatenate(p)) for b, p in zip(chapter_books, chapter_pieces)])


def is_heldout_chapter(chapter_index: int, heldout_fraction: float) -> bool:
    """One chapter in every 1/heldout_fraction, evenly spread over all books."""
    return math.floor((chapter_index + 1) * heldout_fraction) > math.floor(chapter_index * heldout_fraction)


@dataclass(frozen=True)
class ShardSpec:
    """Which learner a shard is for (the split itself is data.split)."""
    learner: int = 0       # index among the learners sharing the pool: all learners for the iid
    num_learners: int = 1  # split, the learners of the same region for the region split
    region: int = 0        # region split only (still part of the sampling key with iid)
    num_regions: int = 1


def _book_regions(corpus: Corpus, num_regions: int) -> list[int]:
    """The region of every book: contiguous groups of about equal size in characters."""
    size = [0.0] * len(corpus.books)
    for chapter in corpus.chapters:
        size[chapter.book] += len(chapter.tokens)
    total = sum(size)
    regions, before = [], 0.0
    for book_size in size:
        middle = before + book_size / 2
        regions.append(min(num_regions - 1, int(num_regions * middle / total)))
        before += book_size
    for r in range(num_regions):
        if r not in regions:
            raise ValueError(f"cannot split the corpus's {len(corpus.books)} books into {num_regions} "
                             f"regions of similar size: region {r} gets no book")
    return regions


def heldout_chapters(corpus: Corpus, data: dict) -> list[int]:
    """Indices of the held-out chapters; `data` is the run config's [data] section."""
    chosen = [i for i in range(len(corpus.chapters)) if is_heldout_chapter(i, data["heldout_fraction"])]
    if not chosen:
        raise ValueError(f"held-out fraction {data['heldout_fraction']} of {len(corpus.chapters)} "
                         "chapters holds out none")
    return chosen


def training_chapters(corpus: Corpus, data: dict, shard: ShardSpec) -> list[int]:
    """Indices of the chapters of a learner's shard, in file order."""
    if not 0 <= shard.learner < shard.num_learners:
        raise ValueError(f"shard: learner {shard.learner} is not below the number of learners {shard.num_learners}")
    by_region = data["split"] == "region"
    if by_region and not 0 <= shard.region < shard.num_regions:
        raise ValueError(f"shard: region {shard.region} is not below the number of regions {shard.num_regions}")
    regions = _book_regions(corpus, shard.num_regions) if by_region else []
    chosen, pool_index = [], 0  # pool_index: position among the training chapters of this pool
    for i, chapter in enumerate(corpus.chapters):
        if is_heldout_chapter(i, data["heldout_fraction"]):
            continue
        if by_region and regions[chapter.book] != shard.region:
            continue
        if pool_index % shard.num_learners == shard.learner:
            chosen.append(i)
        pool_index += 1
    if not chosen:
        raise ValueError(f"shard of learner {shard.learner} of {shard.num_learners} ({data['split']} split) "
                         "has no training chapters")
    return chosen


def _tokens(corpus: Corpus, chapters: list[int]) -> np.ndarray:
    return np.concatenate([corpus.chapters[i].tokens for i in chapters])


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(h: int, v: int) -> int:
    return _splitmix64(h ^ _splitmix64(v))


class BatchStream:
    """Windows of context + 1 tokens at offsets that are a pure function of (key, sequence number).

    `sequences` (the number of sequences drawn so far) is the whole position: set it back to 0
    before each evaluation, or to step * batch to continue a learner's stream after a restart.
    """

    def __init__(self, tokens: np.ndarray, batch: int, context: int, key: int):
        if batch < 1 or context < 1:
            raise ValueError(f"batch ({batch}) and context ({context}) must be positive")
        if len(tokens) < context + 1:
            raise ValueError(f"a stream of {len(tokens)} tokens is too short for sequences of context "
                             f"{context}; use fewer learners or regions or a smaller context")
        self.tokens = torch.from_numpy(tokens)
        self.batch = batch
        self.context = context
        self.key = key
        self.sequences = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-character targets, int64 [batch, context]."""
        starts = len(self.tokens) - self.context
        offsets = torch.tensor([_mix(self.key, s) % starts
                                for s in range(self.sequences, self.sequences + self.batch)])
        self.sequences += self.batch
        windows = self.tokens[offsets[:, None] + torch.arange(self.context + 1)].long()
        return windows[:, :-1], windows[:, 1:]


def training_batches(corpus: Corpus, data: dict, shard: ShardSpec, batch: int, context: int,
                     seed: int) -> BatchStream:
    """A learner's training batches; the key mixes the seed with the shard, as in C++."""
    key = _mix(_TRAINING_DOMAIN, seed)
    for v in (_SPLITS[data["split"]], shard.learner, shard.num_learners, shard.region, shard.num_regions):
        key = _mix(key, v)
    return BatchStream(_tokens(corpus, training_chapters(corpus, data, shard)), batch, context, key)


def heldout_batches(corpus: Corpus, data: dict, batch: int, context: int) -> BatchStream:
    """Held-out batches with a fixed key: every learner and run sees the same evaluation text."""
    return BatchStream(_tokens(corpus, heldout_chapters(corpus, data)), batch, context, _HELDOUT_KEY)
