"""Resolving a model source (`local://`, `hf://`, `oci://`, or a plain path) to a directory of weights.

An `oci://` source is a ModelPack artifact (service/modelpack.py): pulled once into
`NIM_CACHE_PATH/oci/<registry>/<repository>/<manifest digest>/` with its signature, and checked
against NIM_MODEL_VERIFY_KEY on every start before anything loads it (service/model_signature.py).
Replicas that share the cache volume each pull into a private directory and rename it into place,
so none sees a half-written model.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from service.model_signature import SignatureError, Verification, verify_model

log = logging.getLogger(__name__)


class ModelSourceError(RuntimeError):
    """The weights cannot be found or fetched; the message says which source and why."""


def parse_hf(source: str) -> tuple[str, str | None]:
    """`hf://org/name@rev` -> (`org/name`, `rev`)."""
    body = source.removeprefix("hf://")
    repo, _, revision = body.partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise ModelSourceError(f"{source!r}: expected hf://org/name[@revision]")
    return repo, revision or None


def local_cache_dir(cache_path: Path, name: str) -> Path:
    return cache_path / "local" / name


def resolve_model(source: str, *, cache_path: Path, base_dir: Path | None = None, name: str | None = None,
                  allow_download: bool = True) -> Path:
    """The directory holding the weights of `source`, fetching `hf://` ones into the cache."""
    if source.startswith("hf://"):
        return _resolve_hf(source, cache_path, allow_download)
    raw = source.removeprefix("local://")
    path = Path(raw)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if _is_model_dir(path):
        return path
    cached = local_cache_dir(cache_path, name or path.name)
    if _is_model_dir(cached):
        return cached
    raise ModelSourceError(f"{source!r}: no model directory (config.json) at {path} nor in the cache at {cached}")


def download_to_cache(source: str, *, cache_path: Path, base_dir: Path | None, name: str,
                      allow_download: bool = True) -> Path:
    """Place the weights of `source` inside `cache_path` and return where they are."""
    if source.startswith("hf://"):
        return _resolve_hf(source, cache_path, allow_download)
    origin = resolve_model(source, cache_path=cache_path, base_dir=base_dir, name=name)
    target = local_cache_dir(cache_path, name)
    if origin.resolve() != target.resolve():
        shutil.copytree(origin, target, dirs_exist_ok=True)
    return target


@dataclass(frozen=True)
class Trust:
    """What a model must prove before it is served (NIM_MODEL_VERIFY, NIM_MODEL_VERIFY_KEY)."""

    verify: bool = True
    key: Path | None = None
    mount: Path | None = None  # NIM_MODEL_MOUNT: the artifact's files, mounted by the kubelet (an image volume)


@dataclass(frozen=True)
class Located:
    path: Path
    verification: Verification | None = None  # None: a local or hub model without a signature


def locate_model(source: str, *, cache_path: Path, base_dir: Path | None, name: str, allow_download: bool,
                 trust: Trust, into_cache: bool = False) -> Located:
    """The weights of `source`, checked as `trust` asks; `into_cache` copies local ones into the cache
    (download-to-cache) where serving reads them in place."""
    if source.startswith("oci://"):
        return _resolve_oci(source, cache_path, allow_download, trust)
    if trust.mount is not None:
        raise ModelSourceError(f"{source}: NIM_MODEL_MOUNT names where an oci:// model is mounted; this source is not one")
    fetch = download_to_cache if into_cache else resolve_model
    path = fetch(source, cache_path=cache_path, base_dir=base_dir, name=name, allow_download=allow_download)
    if not trust.verify:
        log.warning("model verification is off (NIM_MODEL_VERIFY=0)")
    return Located(path, None if trust.verify else Verification("disabled"))


def _resolve_oci(source: str, cache_path: Path, allow_download: bool, trust: Trust) -> Located:
    from service.oci import OciError, Ref

    try:
        ref = Ref.parse(source)
        if trust.mount is not None:
            entry = _mounted_entry(ref, trust.mount, cache_path, allow_download)
        else:
            entry = _oci_entry(ref, cache_path, allow_download)
    except OciError as exc:
        raise ModelSourceError(f"{source}: {exc}") from None
    pinned = f"oci://{ref.name}@sha256:{entry.name}"
    model = trust.mount or entry / "model"
    if not trust.verify:
        log.warning("model verification is off (NIM_MODEL_VERIFY=0): serving %s unverified", pinned)
        return Located(model, Verification("disabled", artifact=pinned))
    if trust.key is None:
        raise ModelSourceError(f"{source}: NIM_MODEL_VERIFY_KEY is not set, and a model from an oci:// source must "
                               "verify against it (NIM_MODEL_VERIFY=0 serves it unverified)")
    if not (entry / "model.sig").is_file():
        raise ModelSourceError(f"{pinned}: no signature: the artifact has no model-signing referrer")
    try:
        key = verify_model(model, entry / "model.sig", trust.key)
    except SignatureError as exc:
        raise ModelSourceError(f"{pinned}{f' (mounted at {model})' if trust.mount else ''}: does not verify "
                               f"against {trust.key}: {exc}") from None
    log.info("model %s verified against key %s", pinned, key)
    return Located(model, Verification("verified", key=key, artifact=pinned))


def _mounted_entry(ref, mount: Path, cache_path: Path, allow_download: bool) -> Path:
    """The cache entry that holds the signature of an artifact the kubelet mounted: the source must
    be pinned (the mount is of that digest); only the signature is pulled."""
    if not ref.digest:
        raise ModelSourceError(f"oci://{ref}: NIM_MODEL_MOUNT needs the source pinned by digest (the mounted one)")
    if not mount.is_dir():
        raise ModelSourceError(f"oci://{ref}: NIM_MODEL_MOUNT names no directory ({mount})")
    entry = _cached_repository(cache_path, ref) / ref.digest.removeprefix("sha256:")
    entry.mkdir(parents=True, exist_ok=True)
    if allow_download and not (entry / "model.sig").is_file():
        _pull_signature(ref, entry)
    return entry


def _oci_entry(ref, cache_path: Path, allow_download: bool) -> Path:
    """The cache entry of the artifact `ref` names: reused when `ref` is pinned and present; else
    the manifest is read (a tag may have moved) and, when new, the artifact is pulled. A signature
    is looked for whenever the entry has none and pulling is allowed."""
    from service.oci import get_manifest

    repository = _cached_repository(cache_path, ref)
    entry = repository / ref.digest.removeprefix("sha256:") if ref.digest else None
    if entry is None or not (entry / "model").is_dir():
        if not allow_download:
            raise ModelSourceError(f"oci://{ref}: not in the cache at {cache_path} and NIM_DISABLE_MODEL_DOWNLOAD=1 "
                                   "forbids pulling it")
        _, digest, _ = get_manifest(ref)
        entry = repository / digest.removeprefix("sha256:")
        if not (entry / "model").is_dir():
            _pull_entry(ref.at(digest), entry)
    if allow_download and not (entry / "model.sig").is_file():
        _pull_signature(ref.at("sha256:" + entry.name), entry)
    return entry


def _cached_repository(cache_path: Path, ref) -> Path:
    """Where the cache keeps a repository's artifacts, one directory per manifest digest."""
    return cache_path / "oci" / ref.registry.replace(":", "_") / ref.repository


def _pull_entry(pinned, entry: Path) -> None:
    """Pull into a private directory beside `entry`, then rename it into place."""
    from service.modelpack import pull_model

    entry.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        pulled = pull_model(pinned, partial / "model")
        os.rename(partial, entry)
        log.info("pulled %s (%d files, %d bytes) into %s", pinned, pulled.files, pulled.bytes, entry)
    except OSError as exc:
        if not (entry / "model").is_dir():  # else another replica placed the same digest first
            raise ModelSourceError(f"oci://{pinned}: could not place the model in the cache: {exc}") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _pull_signature(pinned, entry: Path) -> None:
    """The newest model-signing bundle that refers to the artifact, as `model.sig` beside the model."""
    from service.modelpack import signatures
    from service.oci import get_manifest, pull_blob

    found = signatures(pinned)
    if found:
        signed, _, _ = get_manifest(pinned.at(found[-1]["digest"]))
        partial = entry / f".model.sig.{os.getpid()}"
        pull_blob(pinned, signed["layers"][0], partial)
        os.replace(partial, entry / "model.sig")


def _resolve_hf(source: str, cache_path: Path, allow_download: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, revision = parse_hf(source)
    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=cache_path / "huggingface",
                                      local_files_only=not allow_download))
    except LocalEntryNotFoundError:
        if not allow_download:
            raise ModelSourceError(
                f"{source!r} is not in the cache at {cache_path} and NIM_DISABLE_MODEL_DOWNLOAD=1 forbids fetching it"
            ) from None
        raise ModelSourceError(f"{source!r}: could not download (no route to the model hub?)") from None
    except Exception as exc:  # the hub client raises many kinds; all mean "not fetched"
        raise ModelSourceError(f"{source!r}: could not download: {type(exc).__name__}: {exc}") from None


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()
