"""Resolving a model source (`local://`, `hf://`, or a plain path) to a directory of weights."""

from __future__ import annotations

import shutil
from pathlib import Path


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
