"""`inferkiln lock` against the package index (PyPI here), as a platform engineer re-locks a flavor."""

import re

from factory.image.flavors import FLAVORS
from factory.image.lock import compile_lock, locked_versions


def test_a_relock_keeps_the_pins_it_has(tmp_path):
    """uv takes the lock being replaced as its preferences: a re-lock moves only what a change needs.
    An older pin of annotated-types (pydantic accepts it) survives, though the index has a newer one."""
    cpu = FLAVORS["cpu"]
    out = tmp_path / "cpu.txt"
    out.write_text(re.sub(r"^annotated-types==\S+", "annotated-types==0.7.0", cpu.lock_path.read_text(), flags=re.M))
    compile_lock(cpu, out)
    relocked, checked_in = locked_versions(out), locked_versions(cpu.lock_path)
    assert relocked.pop("annotated-types") == "0.7.0" != checked_in.pop("annotated-types")
    assert relocked == checked_in
