"""Building images through the Docker Engine API: the base, the shared runtime, the thin model image.

References are digests of the contexts' inputs (factory/image/context.py), so a build whose inputs
have not changed finds its images and returns at once; a change to the weights alone leaves the
runtime image as it is and rebuilds only the model image's layers.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from factory.errors import CheckFailed
from factory.image.context import ImagePlan, write_model_context, write_runtime_context
from factory.image.flavors import DEBIAN_BASE_IMAGE, DEBIAN_BASES, Flavor
from factory.image.wheelhouse import ensure_wheelhouse
from factory.locking import exclusive
from factory.paths import cache_dir
from factory.spec import LoadedSpec

Progress = Callable[[str], None]
WHEELS_PORT = 8765  # where the wheelhouse is served during a runtime build (`inferkiln render` names it)


class BuildError(CheckFailed):
    """A build failed: the message names the image, the failing step and the engine's error."""


@dataclass(frozen=True)
class BuiltImage:
    reference: str
    image_id: str  # the local image's content digest (sha256 of its config)
    built: bool  # False when an image with the same inputs existed already
    seconds: float


@dataclass(frozen=True)
class BuiltImages:
    """The build stage's result: the runtime and the model image on top of it."""

    runtime: BuiltImage
    model: BuiltImage


# -- the base image --------------------------------------------------------------------------
def ensure_base_image(client, progress: Progress, reference: str = DEBIAN_BASE_IMAGE) -> str:
    """One of DEBIAN_BASES, bootstrapped from Debian's archive (no registry to pull from); any other
    reference (the CUDA base) is pulled. Under the reference's lock, so that a second caller waits
    for the first's bootstrap and finds its image."""
    with exclusive(base_image_lock(reference)):
        if not _existing(client, reference):
            _pulled_or_bootstrapped(client, progress, reference)
    return reference


def base_image_lock(reference: str) -> Path:
    return cache_dir() / (".base-" + re.sub(r"[^\w.-]", "_", reference) + ".lock")


def _pulled_or_bootstrapped(client, progress: Progress, reference: str) -> None:
    if reference not in DEBIAN_BASES:
        progress(f"pulling {reference}...")
        try:
            client.images.pull(reference)
        except Exception as exc:  # the SDK raises several kinds for an unreachable or unknown image
            raise BuildError(f"the base image {reference} could not be pulled: {exc}") from None
        return
    if not shutil.which("debootstrap") or os.geteuid() != 0:
        raise BuildError("making the base image needs debootstrap run as root (Debian: apt-get install debootstrap)")
    progress(f"bootstrapping {reference} (Debian bookworm + {', '.join(DEBIAN_BASES[reference])}, a minute or two)...")
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        rootfs, archive = Path(tmp) / "rootfs", Path(tmp) / "rootfs.tar"
        result = subprocess.run(["debootstrap", "--variant=minbase", "--include=" + ",".join(DEBIAN_BASES[reference]),
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


# -- builds ----------------------------------------------------------------------------------
def _existing(client, reference: str) -> str | None:
    import docker

    try:
        return client.images.get(reference).id
    except docker.errors.ImageNotFound:
        return None


def build_context(client, context: Path, reference: str, progress: Progress, no_cache: bool = False,
                  wheels: str | None = None) -> str:
    """`docker build` through the Engine API, streaming its steps; the image id, or BuildError.
    `wheels` is a find-links URL on loopback: the build then runs on the host's network to reach it."""
    step = "(before the first step)"
    image_id = None
    network = {"buildargs": {"WHEELS": wheels}, "network_mode": "host"} if wheels else {}
    for chunk in client.api.build(path=str(context), tag=reference, rm=True, forcerm=True, decode=True, pull=False,
                                  nocache=no_cache, **network):
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


def fetch_for_runtime(client, flavor: Flavor, progress: Progress) -> Path:
    """What a runtime build needs from the network, its base image and its wheelhouse (one of
    them 3.7 GB): its wheelhouse's path. Each waits on a lock for a fetch already under way."""
    ensure_base_image(client, progress, flavor.base_image)
    return ensure_wheelhouse(flavor, progress)


def build_runtime(client, flavor: Flavor, reference: str, progress: Progress, cold: bool = False) -> BuiltImage:
    start = time.perf_counter()
    if not cold and (existing := _existing(client, reference)):
        return BuiltImage(reference, existing, False, time.perf_counter() - start)
    wheels = fetch_for_runtime(client, flavor, progress)
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp, serve_directory(wheels) as wheels_url:
        context = write_runtime_context(flavor, Path(tmp) / "runtime")
        progress(f"building {reference}...")
        image_id = build_context(client, context, reference, progress, no_cache=cold, wheels=wheels_url)
    return BuiltImage(reference, image_id, True, time.perf_counter() - start)


@contextmanager
def serve_directory(directory: Path, port: int = WHEELS_PORT) -> Iterator[str]:
    """The directory's listing over HTTP on loopback (the installer's --find-links reads it), while in use.

    On WHEELS_PORT where it is free: the URL is a build argument, part of the install step's cache
    key, so builds by hand that follow `render`'s note reuse the factory's layers (another port
    while a second build holds it, which installs afresh)."""
    handler = partial(_QuietFiles, directory=str(directory))
    try:
        server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    except OSError:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    with server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/"
        finally:
            server.shutdown()
            thread.join()


class _QuietFiles(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        pass


def build_images(client, loaded: LoadedSpec, plan: ImagePlan, progress: Progress, cold: bool = False) -> BuiltImages:
    """The runtime image (shared) and the model image on top; both return at once when unchanged.

    `cold` rebuilds both from scratch, ignoring existing images and Docker's layer cache (for
    measuring cold builds)."""
    runtime = build_runtime(client, plan.flavor, plan.runtime_reference, progress, cold)
    start = time.perf_counter()
    reference = plan.model_reference
    if not cold and (existing := _existing(client, reference)):
        return BuiltImages(runtime, BuiltImage(reference, existing, False, time.perf_counter() - start))
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        context = write_model_context(loaded, Path(tmp) / "model", plan.runtime_reference, plan.model_digest)
        progress(f"building {reference}...")
        image_id = build_context(client, context, reference, progress, no_cache=cold)
    return BuiltImages(runtime, BuiltImage(reference, image_id, True, time.perf_counter() - start))
