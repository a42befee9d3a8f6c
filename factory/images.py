"""Building images through the Docker Engine API: base, shared runtime, thin per-model image.

Tags carry a digest over every input (spec, templates, service code, wheel set, weights), so a
build whose inputs have not changed finds its image and returns at once; a change to the weights
alone leaves the runtime image as it is and rebuilds only the model image's layers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from factory.paths import cache_dir, repo_root
from factory.render import (CPU_BASE_IMAGE, RuntimePlan, model_manifest, write_model_context,
                            write_runtime_context)
from factory.spec import LoadedSpec

Progress = Callable[[str], None]
SOURCE_DIRS = ("service", "factory")
IGNORED = {"__pycache__", ".pytest_cache"}


class BuildError(RuntimeError):
    """A build failed: the message names the image, the failing step and the engine's error."""


@dataclass(frozen=True)
class BuiltImage:
    reference: str
    image_id: str
    built: bool  # False when an image with the same inputs existed already
    seconds: float


# -- digests ---------------------------------------------------------------------------------
def tree_digest(root: Path, skip: Callable[[Path], bool] = lambda p: False) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root)
        if IGNORED & set(relative.parts) or skip(relative):
            continue
        digest.update(str(relative).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def source_digest() -> str:
    """The code that goes into the runtime image's inferkiln wheel."""
    root = repo_root()
    parts = [tree_digest(root / name) for name in SOURCE_DIRS]
    parts += [hashlib.sha256((root / "pyproject.toml").read_bytes()).hexdigest(), tree_digest(root / "dockerfiles")]
    return hashlib.sha256("".join(parts).encode()).hexdigest()


def weights_digest(loaded: LoadedSpec) -> str:
    source = loaded.local_source()
    if source is None:
        return hashlib.sha256(loaded.spec.model.source.encode()).hexdigest()
    return tree_digest(source, skip=lambda p: p.name.startswith("."))


# -- the wheelhouse --------------------------------------------------------------------------
def runtime_requirements(plan: RuntimePlan) -> list[str]:
    """The project's dependencies, with torch pinned to the build host's build (the CPU wheel here)."""
    import torch

    deps = tomllib.loads((repo_root() / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = [f"torch=={torch.__version__}" if d.replace(" ", "").startswith("torch") else d for d in deps]
    return sorted(pinned)


def ensure_dependency_wheels(requirements: list[str], progress: Progress) -> Path:
    key = hashlib.sha256(json.dumps([requirements, sys.version_info[:2]]).encode()).hexdigest()[:16]
    target = cache_dir() / "wheelhouse" / key
    if (target / ".complete").is_file():
        return target
    progress(f"downloading the dependency wheelhouse ({len(requirements)} requirements)...")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".wheels-"))
    try:
        _pip(["download", "--quiet", "--only-binary=:all:", "-d", str(staging), *requirements])
        (staging / ".complete").write_text("\n".join(requirements))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_project_wheel(out: Path) -> Path:
    _pip(["wheel", "--quiet", "--no-deps", "-w", str(out), str(repo_root())])
    return next(out.glob("inferkiln-*.whl"))


def _pip(args: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check"],
                            capture_output=True, text=True)
    if result.returncode:
        raise BuildError(f"pip {args[0]} failed: {result.stderr.strip()[-2000:]}")


# -- the base image --------------------------------------------------------------------------
def ensure_base_image(client, progress: Progress, reference: str = CPU_BASE_IMAGE) -> str:
    """Debian bookworm with Python, bootstrapped from Debian packages (no registry to pull from)."""
    import docker

    try:
        client.images.get(reference)
        return reference
    except docker.errors.ImageNotFound:
        pass
    if reference != CPU_BASE_IMAGE:
        progress(f"pulling {reference}...")
        client.images.pull(reference)
        return reference
    if not shutil.which("debootstrap") or os.geteuid() != 0:
        raise BuildError("making the base image needs debootstrap run as root (Debian: apt-get install debootstrap)")
    progress("bootstrapping the base image (Debian bookworm + python3, about a minute)...")
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        rootfs, archive = Path(tmp) / "rootfs", Path(tmp) / "rootfs.tar"
        result = subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv",
                                 "bookworm", str(rootfs)], capture_output=True, text=True)
        if result.returncode:
            raise BuildError(f"debootstrap failed: {result.stdout[-1500:]}{result.stderr[-1500:]}")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(rootfs / junk, ignore_errors=True)
        subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(archive), "."], check=True)
        repository, tag = reference.rsplit(":", 1)
        client.api.import_image(src=str(archive), repository=repository, tag=tag,
                                changes=["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                         'CMD ["/bin/bash"]'])
    return reference


# -- builds ----------------------------------------------------------------------------------
def _existing(client, reference: str) -> str | None:
    import docker

    try:
        return client.images.get(reference).id
    except docker.errors.ImageNotFound:
        return None


def build_context(client, context: Path, reference: str, progress: Progress, no_cache: bool = False) -> str:
    """`docker build` through the Engine API, streaming its steps; the image id, or BuildError."""
    step = "(before the first step)"
    image_id = None
    for chunk in client.api.build(path=str(context), tag=reference, rm=True, forcerm=True, decode=True, pull=False,
                                  nocache=no_cache):
        if "stream" in chunk:
            line = chunk["stream"].rstrip()
            if line.startswith("Step "):
                step = line
                progress(f"  {line}")
        if "error" in chunk:
            detail = chunk.get("errorDetail", {})
            code = f" (exit code {detail['code']})" if detail.get("code") is not None else ""
            raise BuildError(f"building {reference} failed at {step}{code}: {chunk['error'].strip()}")
        if "aux" in chunk and "ID" in chunk["aux"]:
            image_id = chunk["aux"]["ID"]
    return image_id or client.images.get(reference).id


def build_runtime(client, plan: RuntimePlan, progress: Progress, cold: bool = False) -> BuiltImage:
    start = time.perf_counter()
    requirements = runtime_requirements(plan)
    digest = hashlib.sha256(json.dumps([plan.flavor, plan.base_image, plan.requirement, plan.dockerfile(),
                                        requirements, source_digest()]).encode()).hexdigest()
    reference = f"inferkiln/runtime-{plan.flavor}:{digest[:12]}"
    if not cold and (existing := _existing(client, reference)):
        return BuiltImage(reference, existing, False, time.perf_counter() - start)
    if plan.flavor != "cpu":
        raise BuildError(f"the {plan.flavor} runtime renders here but builds only where its base image "
                         f"{plan.base_image} can be pulled")
    ensure_base_image(client, progress, plan.base_image)
    wheels = ensure_dependency_wheels(requirements, progress)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        context = write_runtime_context(plan, Path(tmp) / "runtime", requirements)
        (context / "wheels").mkdir()
        for wheel in wheels.glob("*.whl"):
            os.link(wheel, context / "wheels" / wheel.name)
        build_project_wheel(context / "wheels")
        progress(f"building {reference}...")
        image_id = build_context(client, context, reference, progress, no_cache=cold)
    return BuiltImage(reference, image_id, True, time.perf_counter() - start)


def model_digest(loaded: LoadedSpec, runtime_reference: str) -> str:
    template = (repo_root() / "dockerfiles" / "model.Dockerfile.j2").read_text()
    return hashlib.sha256(json.dumps([runtime_reference, loaded.spec.digest(), template,
                                      weights_digest(loaded)]).encode()).hexdigest()


def model_labels(loaded: LoadedSpec, digest: str) -> dict[str, str]:
    spec = loaded.spec
    return {
        "org.opencontainers.image.title": spec.metadata.name,
        "org.opencontainers.image.version": spec.metadata.version,
        "org.opencontainers.image.revision": digest,
        "org.opencontainers.image.created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "org.opencontainers.image.source": spec.model.source,
        "org.opencontainers.image.licenses": spec.model.license,
        "io.inferkiln.spec-digest": spec.digest(),
        "io.inferkiln.profile-ids": ",".join(p.id for p in model_manifest(loaded).profiles),
        "io.inferkiln.model-source": spec.model.source,
    }


def model_reference(loaded: LoadedSpec, digest: str) -> str:
    return f"inferkiln/{loaded.spec.metadata.name}:{loaded.spec.metadata.version}-{digest[:12]}"


def build_model(client, loaded: LoadedSpec, progress: Progress,
                cold: bool = False) -> tuple[BuiltImage, BuiltImage]:
    """The runtime image (shared) and the model image on top; both return at once when unchanged.

    `cold` rebuilds both from scratch, ignoring existing images and Docker's layer cache (for
    measuring cold builds)."""
    runtime = build_runtime(client, RuntimePlan.for_spec(loaded), progress, cold)
    start = time.perf_counter()
    digest = model_digest(loaded, runtime.reference)
    reference = model_reference(loaded, digest)
    if not cold and (existing := _existing(client, reference)):
        return runtime, BuiltImage(reference, existing, False, time.perf_counter() - start)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        context = write_model_context(loaded, Path(tmp) / "model", runtime.reference, model_labels(loaded, digest))
        progress(f"building {reference}...")
        image_id = build_context(client, context, reference, progress, no_cache=cold)
    return runtime, BuiltImage(reference, image_id, True, time.perf_counter() - start)


