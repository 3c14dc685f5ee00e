"""Hand-made run folders for the tooling's tests: metrics.jsonl files written line by line."""
import json
import os

import pytest

# A run's first event, in unix microseconds; fixtures place events at T0 + seconds.
T0 = 1_800_000_000_000_000


@pytest.fixture
def at():
    """The time_us of an event `seconds` after T0."""
    return lambda seconds: T0 + int(round(seconds * 1e6))


@pytest.fixture
def write_jsonl():
    """Writes JSON lines to a file (its folder made as needed); `torn` is appended unterminated, as
    a process killed mid-write leaves it."""
    def write(path, records, torn=None):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
            if torn is not None:
                f.write(torn)
        return path
    return write
