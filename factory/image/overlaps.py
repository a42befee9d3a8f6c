"""Files that two wheels of a lock both install, with different content.

uv installs a lock's wheels side by side, so where two of them carry the same file, which copy the
image keeps is not fixed. The cuda lock has such pairs: FlashInfer pins cuda-python 12.6, whose
cuda.bindings files are also cuda-bindings 13.5's (torch's). Every such file must be settled by the
flavor: pruned from the image (`Flavor.prune`), or owned by exactly one package the flavor installs
again last (`Flavor.install_last`). Otherwise the build stops and names the wheels and files, so a
new lock cannot change an image's files by the order of an install.

Each wheel's RECORD lists what it installs and each file's hash; the overlaps of a wheelhouse are
found once (a second for the cuda flavor's 200 wheels) and kept beside its wheels.
"""

from __future__ import annotations

import csv
import io
import json
import re
import zipfile
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

from factory.errors import CheckFailed
from factory.image.flavors import Flavor

OVERLAPS_FILE = ".overlaps.json"
# A wheel's `NAME-VERSION.data/SCHEME/PATH`: purelib and platlib install into site-packages.
DATA_PATH = re.compile(r"^[^/]+\.data/(purelib|platlib|scripts|headers|data)/(.+)$")


@dataclass(frozen=True)
class Overlap:
    path: str  # under site-packages; another scheme's files as `scripts:PATH`, `data:PATH`, `headers:PATH`
    owners: tuple[str, ...]  # the wheels' distributions (canonical names), sorted


def installed_files(wheel: Path) -> dict[str, str]:
    """Where each file of the wheel installs (as Overlap.path) and its hash, from its RECORD; the
    wheel's own .dist-info, which no other wheel shares, is left out."""
    with zipfile.ZipFile(wheel) as archive:
        record = next(n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.TextIOWrapper(archive.open(record), "utf-8")))
    files = {}
    for row in rows:
        if not row or row[0].split("/", 1)[0].endswith(".dist-info"):
            continue
        path = row[0]
        if match := DATA_PATH.match(path):
            scheme, rest = match.groups()
            path = rest if scheme in ("purelib", "platlib") else f"{scheme}:{rest}"
        files[path] = row[1] if len(row) > 1 else ""
    return files


def find_overlaps(wheels: Iterable[Path]) -> list[Overlap]:
    """The files that more than one wheel installs with different hashes."""
    hashes: dict[str, dict[str, str]] = defaultdict(dict)
    for wheel in wheels:
        owner = canonicalize_name(parse_wheel_filename(wheel.name)[0])
        for path, digest in installed_files(wheel).items():
            hashes[path][owner] = digest
    return [Overlap(path, tuple(sorted(owners))) for path, owners in sorted(hashes.items())
            if len(owners) > 1 and len(set(owners.values())) > 1]


def wheelhouse_overlaps(wheelhouse: Path) -> list[Overlap]:
    """The wheelhouse's overlaps, found once and kept in it (a wheelhouse never changes: its name is
    its lock's digest)."""
    kept = wheelhouse / OVERLAPS_FILE
    if kept.is_file():
        return [Overlap(entry["path"], tuple(entry["owners"])) for entry in json.loads(kept.read_text())]
    found = find_overlaps(sorted(wheelhouse.glob("*.whl")))
    kept.write_text(json.dumps([{"path": o.path, "owners": list(o.owners)} for o in found], indent=1))
    return found


def check_overlaps(flavor: Flavor, wheelhouse: Path, note: Callable[[str], None]) -> None:
    """CheckFailed unless the flavor settles every overlap; `note` hears of install_last entries
    that settle none (a lock that no longer needs them)."""
    last = {canonicalize_name(name) for name in flavor.install_last}
    unsettled: dict[tuple[str, ...], list[str]] = defaultdict(list)
    used: set[str] = set()
    for overlap in wheelhouse_overlaps(wheelhouse):
        if any(fnmatch(overlap.path, glob) or fnmatch(overlap.path, f"{glob}/*") for glob in flavor.prune):
            continue
        winners = last.intersection(overlap.owners)
        if len(winners) == 1:
            used |= winners
        else:
            unsettled[overlap.owners].append(overlap.path)
    if unsettled:
        lines = [f"  {' and '.join(owners)}: {len(paths)} file(s), e.g. {', '.join(paths[:3])}"
                 for owners, paths in sorted(unsettled.items())]
        raise CheckFailed(f"the {flavor.name} lock has wheels that install the same files with different content, "
                          f"so which copy the image keeps would depend on the install's order:\n" + "\n".join(lines)
                          + "\nname the package whose files must win in the flavor's install_last, or add the "
                          "files to its prune (factory/image/flavors.py)")
    for name in sorted(last - used):
        note(f"{flavor.name} flavor: install_last names {name}, whose files no other wheel of the lock carries")
