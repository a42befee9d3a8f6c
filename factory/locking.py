"""One file lock for every cache and state file that two factory processes (or a test session's
threads) may fill at once: the second waits for the first, then finds its result."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Holds an exclusive flock on `path` (made, with its folder, if missing) while in the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
