"""Each runtime flavor's dependency lock: exact versions and sha256 hashes, made with uv.

The lock's header records a digest of its inputs (the project's runtime dependencies, the flavor's
extra and its target platform), so `inferkiln lock --check` tells offline whether a lock is stale
against pyproject.toml, without asking an index what is newest today.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from factory.errors import CheckFailed, InputError
from factory.image.flavors import FLAVORS, Flavor, lock_file
from factory.paths import repo_root

INPUTS_LINE = re.compile(r"^# inputs: sha256:([0-9a-f]{64})$", re.M)


@dataclass(frozen=True)
class LockInputs:
    requirements: tuple[str, ...]
    python_version: str
    platform: str
    no_emit: tuple[str, ...]

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.__dict__, sort_keys=True).encode()).hexdigest()


def lock_inputs(flavor: Flavor, pyproject: Path | None = None) -> LockInputs:
    """The project's runtime dependencies with the flavor's extra; its pins replace the ranges they name."""
    project = tomllib.loads((pyproject or repo_root() / "pyproject.toml").read_text())["project"]
    extra = project.get("optional-dependencies", {}).get(flavor.name)
    if extra is None:
        raise InputError(f"pyproject.toml: project.optional-dependencies.{flavor.name}: the flavor's extra is missing")
    pinned = {_name(r) for r in extra}
    requirements = [r for r in project["dependencies"] if _name(r) not in pinned] + list(extra)
    return LockInputs(tuple(sorted(requirements)), flavor.python_version, flavor.platform, flavor.no_emit)


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[@]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def recorded_inputs(lock_path: Path) -> str | None:
    if not lock_path.is_file():
        return None
    match = INPUTS_LINE.search(lock_path.read_text())
    return match.group(1) if match else None


def is_current(flavor: Flavor, pyproject: Path | None = None, lock_path: Path | None = None) -> bool:
    return recorded_inputs(lock_path or flavor.lock_path) == lock_inputs(flavor, pyproject).digest()


def find_links() -> list[str]:
    """Where wheels outside the index live (the CPU build of torch): INFERKILN_FIND_LINKS, else pip's
    configured find-links, since uv does not read pip's configuration."""
    configured = os.environ.get("INFERKILN_FIND_LINKS")
    if configured is None:
        result = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                                capture_output=True, text=True)
        configured = result.stdout.strip() if result.returncode == 0 else ""
    return configured.split()


def compile_lock(flavor: Flavor, out: Path | None = None) -> Path:
    """`uv pip compile --generate-hashes` for the flavor's target platform; writes the lock.

    The lock it replaces is uv's output file, whose pins uv keeps as preferences (as pip-tools
    does): a re-lock after a dependency is added moves only what the change needs."""
    inputs = lock_inputs(flavor)
    out = out or flavor.lock_path
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / out.name
        if out.is_file():
            shutil.copyfile(out, staged)
        command = [sys.executable, "-m", "uv", "pip", "compile", "-", "--output-file", str(staged),
                   "--generate-hashes", "--no-header", "--only-binary", ":all:",  # the image installs wheels only
                   "--python-version", inputs.python_version, "--python-platform", inputs.platform, "--quiet",
                   *[arg for link in (find_links() if flavor.local_wheels else []) for arg in ("--find-links", link)],
                   *[arg for name in inputs.no_emit for arg in ("--no-emit-package", name)]]
        result = subprocess.run(command, input="\n".join(inputs.requirements) + "\n", capture_output=True, text=True)
        if result.returncode:
            raise CheckFailed(f"uv could not lock the {flavor.name} flavor: {result.stderr.strip()[-2000:]}")
        locked = staged.read_text()
    header = (f"# The {flavor.name} runtime's locked dependencies: `inferkiln lock {flavor.name}` writes this file\n"
              f"# with uv pip compile --generate-hashes, for Python {inputs.python_version} on {inputs.platform}.\n"
              f"# inputs: sha256:{inputs.digest()}\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + locked)
    return out


def lock_digest(flavor: Flavor, root: Path | None = None) -> str:
    path = lock_file(flavor.name, root)
    if not path.is_file():
        raise InputError(f"dockerfiles/locks/{path.name}: no lock for the {flavor.name} flavor "
                         f"(make it: inferkiln lock {flavor.name})")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def locked_versions(lock_path: Path) -> dict[str, str]:
    """name -> version of every package the lock pins."""
    pins = re.findall(r"^([A-Za-z0-9_.\-\[\]]+)==(\S+)", lock_path.read_text(), re.M)
    return {name.lower(): version for name, version in pins}


def stale_flavors(names: list[str] | None = None) -> list[str]:
    return [name for name in names or list(FLAVORS) if not is_current(FLAVORS[name])]
