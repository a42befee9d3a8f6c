"""The wheelhouse: every wheel a flavor's lock names, for its target platform, checked against the
lock's hashes and cached by the lock's digest. Images install from it with no index, with the
factory's own uv served beside the wheels (INSTALLER)."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from factory.errors import CheckFailed
from factory.image.flavors import Flavor
from factory.image.lock import lock_digest
from factory.image.overlaps import check_overlaps
from factory.locking import exclusive, replacing, replacing_dir
from factory.paths import cache_dir

Progress = Callable[[str], None]
INSTALLER = "uv"  # the installer's file name in the wheelhouse, which the runtime's Dockerfile fetches by it


def wheelhouse_dir(flavor: Flavor) -> Path:
    return cache_dir() / "wheelhouse" / f"{flavor.name}-{lock_digest(flavor)[:16]}"


def wheelhouse_lock(flavor: Flavor) -> Path:
    return wheelhouse_dir(flavor).parent / f".{flavor.name}.lock"


def cached_wheelhouse(flavor: Flavor) -> Path | None:
    target = wheelhouse_dir(flavor)
    return with_installer(target) if (target / ".complete").is_file() else None


def with_installer(wheels: Path) -> Path:
    """The wheelhouse with the factory's uv binary beside the wheels. The runtime build fetches it,
    installs the lock with it (every hash checked, bytecode compiled, as pip did: the cuda flavor's
    7 GB in 66 s against pip's 136 s on 2 cores) and deletes it in the same step, so no layer keeps
    it. It is a build tool, like the Docker Engine: what it installs is the lock, whatever its version."""
    from uv import find_uv_bin

    source, target = Path(find_uv_bin()), wheels / INSTALLER
    if not target.is_file() or not filecmp.cmp(source, target, shallow=False):
        with replacing(target) as staged:  # a build may be reading it: cached_wheelhouse's callers hold no lock
            shutil.copy2(source, staged)
    return wheels


def ensure_wheelhouse(flavor: Flavor, progress: Progress) -> Path:
    """The lock's wheels, downloaded once (pip verifies every hash), once the flavor settles every
    file that two of them install (factory.image.overlaps)."""
    wheels = _cached_or_downloaded(flavor, progress)
    check_overlaps(flavor, wheels, progress)
    return wheels


def _cached_or_downloaded(flavor: Flavor, progress: Progress) -> Path:
    """Under the flavor's lock: a second caller (another build, the test suite's early fetch) waits
    for the first's download rather than making one of its own beside it."""
    target = wheelhouse_dir(flavor)
    with exclusive(wheelhouse_lock(flavor)):
        if cached := cached_wheelhouse(flavor):
            return _without_stale(cached, flavor)
        for interrupted in target.parent.glob(f".wheels-{flavor.name}-*"):
            shutil.rmtree(interrupted, ignore_errors=True)
        _download(flavor, target, progress)
        return with_installer(_without_stale(target, flavor))


def _download(flavor: Flavor, target: Path, progress: Progress) -> None:
    progress(f"downloading the {flavor.name} wheelhouse from its lock...")
    with replacing_dir(target, f".wheels-{flavor.name}-") as staging:
        platforms = [arg for tag in flavor.pip_platforms for arg in ("--platform", tag)]
        abi = "cp" + flavor.python_version.replace(".", "")
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--require-hashes", "--only-binary=:all:", *platforms, "--python-version", flavor.python_version,
             "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none",
             "-r", str(flavor.lock_path), "-d", str(staging)], capture_output=True, text=True)
        if result.returncode:
            raise CheckFailed(f"filling the {flavor.name} wheelhouse from its lock failed: "
                              f"{result.stderr.strip()[-2000:]}")
        (staging / ".complete").write_text(lock_digest(flavor))


def _without_stale(current: Path, flavor: Flavor) -> Path:
    """Removes the flavor's wheelhouses of earlier locks (the cuda flavor's are 3.5 GB each)."""
    for stale in current.parent.glob(f"{flavor.name}-*"):
        if stale != current:
            shutil.rmtree(stale, ignore_errors=True)
    return current
