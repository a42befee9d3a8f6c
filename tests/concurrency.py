"""A second caller of a cache that a first is filling, for the tests of the factory's locks."""

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from factory.locking import exclusive

T = TypeVar("T")


def after_the_first(lock: Path, second: Callable[[], T], first: Callable[[], object]) -> T:
    """`second` called in a thread while `lock` is held, as by a first caller at work: it must still be
    waiting half a second on; `first` then does the first caller's work and the lock goes. What
    `second` returned."""
    found = []
    with exclusive(lock):
        thread = threading.Thread(target=lambda: found.append(second()))
        thread.start()
        thread.join(0.5)
        assert thread.is_alive(), "the second caller did not wait for the first"
        first()
    thread.join(10)
    assert found, "the second caller failed"
    return found[0]
