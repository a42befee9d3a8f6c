"""One file lock for every cache and state file that two factory processes (or a test session's
threads) may fill at once: the second waits for the first, then finds its result. And one way to
replace such a file that a reader without the lock may have open, and one to replace a folder."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
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


@contextmanager
def replacing(target: Path) -> Iterator[Path]:
    """A path beside `target` for the block to write, renamed over `target` when the block ends: a
    reader finds the old file or the new one, never part of one. If the block fails, `target` stays
    as it was and the partial file goes."""
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-")
    os.close(fd)
    staged = Path(name)
    try:
        yield staged
        staged.replace(target)
    finally:
        staged.unlink(missing_ok=True)


@contextmanager
def replacing_dir(target: Path, prefix: str) -> Iterator[Path]:
    """A new folder beside `target` (named from `prefix`) for the block to fill, put in `target`'s
    place when the block ends: a caller checks a marker file in it, so a reader never takes a half
    filled one for whole. If the block fails, `target` stays as it was and the new folder goes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=target.parent, prefix=prefix))
    try:
        yield staged
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
