"""Model weights as CNCF ModelPack OCI artifacts (github.com/modelpack/model-spec, v1): what each
file's layer is called, the artifact's config, and pulling one into a directory.

Each file is its own raw (untarred) layer, annotated with its path in the model directory, so that
a new version of a model shares every unchanged file's blob with the last one and a registry stores
and sends only what changed. Layers carry `org.opencontainers.image.title` too, so plain `oras pull`
writes the same files.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from service.oci import OciError, Ref, get_manifest, pull_blob, pull_bytes, referrers

ARTIFACT_TYPE = "application/vnd.cncf.model.manifest.v1+json"
CONFIG_TYPE = "application/vnd.cncf.model.config.v1+json"
WEIGHT = "application/vnd.cncf.model.weight.v1.raw"
WEIGHT_CONFIG = "application/vnd.cncf.model.weight.config.v1.raw"
DOC = "application/vnd.cncf.model.doc.v1.raw"
CODE = "application/vnd.cncf.model.code.v1.raw"
FILEPATH = "org.cncf.model.filepath"
TITLE = "org.opencontainers.image.title"
# OpenSSF model-signing writes a Sigstore bundle; stored as a referrer of the model's manifest.
SIGNATURE_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".onnx", ".h5", ".msgpack"}
IGNORED = {".git", ".gitattributes", ".cache", "model.sig"}  # what the signature does not cover either


def media_type(relative: PurePosixPath) -> str:
    name = relative.name.lower()
    if relative.suffix.lower() in WEIGHT_SUFFIXES:
        return WEIGHT
    if name.startswith(("readme", "license", "notice")) or relative.suffix.lower() == ".md":
        return DOC
    if relative.suffix.lower() == ".py":
        return CODE
    return WEIGHT_CONFIG  # config.json, tokenizer files, chat templates, generation config


def model_files(directory: Path) -> list[PurePosixPath]:
    """The files of a model directory, relative and sorted (the order of the layers)."""
    files = []
    for path in sorted(directory.rglob("*")):
        relative = PurePosixPath(path.relative_to(directory).as_posix())
        if path.is_file() and not set(relative.parts) & IGNORED:
            files.append(relative)
    return files


def model_config(name: str, version: str | None, directory: Path, layer_digests: list[str]) -> dict:
    """The artifact's config: what the model is (from its config.json where there is one) and the
    layers' digests (raw layers: a layer's DiffID is its digest)."""
    hf = _read_json(directory / "config.json")
    descriptor = {"name": name} | ({"version": version} if version else {})
    technical = {"architecture": "transformer", "format": _format(directory)}
    if isinstance(hf.get("torch_dtype") or hf.get("dtype"), str):
        technical["precision"] = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(
            hf.get("torch_dtype") or hf.get("dtype"), hf.get("torch_dtype") or hf.get("dtype"))
    return {"descriptor": descriptor, "config": technical, "modelfs": {"type": "layers", "diffIds": layer_digests}}


def _format(directory: Path) -> str:
    suffixes = {p.suffix for p in directory.iterdir() if p.is_file()}
    return "safetensors" if ".safetensors" in suffixes else "gguf" if ".gguf" in suffixes else "pytorch"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@dataclass(frozen=True)
class PulledModel:
    ref: Ref  # pinned to the manifest's digest
    files: int
    bytes: int


def pull_model(ref: Ref, target: Path) -> PulledModel:
    """Write the artifact's files under `target` (which must not exist), each checked against its
    digest; a manifest that is not a ModelPack model, or a file path that would leave `target`, is
    refused before anything is written."""
    manifest, digest, _ = get_manifest(ref)
    if manifest.get("artifactType") != ARTIFACT_TYPE and manifest.get("config", {}).get("mediaType") != CONFIG_TYPE:
        raise OciError(f"{ref}: not a ModelPack model artifact (artifactType {manifest.get('artifactType')!r})")
    layers = manifest.get("layers") or []
    paths = [_safe_path(ref, layer) for layer in layers]
    pinned = ref.at(digest)
    target.mkdir(parents=True)
    config = json.loads(pull_bytes(pinned, manifest["config"], target))
    if config.get("modelfs", {}).get("diffIds") != [layer["digest"] for layer in layers]:
        shutil.rmtree(target)
        raise OciError(f"{pinned}: the config's diffIds do not list the manifest's layers")
    for layer, relative in zip(layers, paths):
        pull_blob(pinned, layer, target / relative)
    return PulledModel(pinned, len(layers), sum(layer["size"] for layer in layers))


def _safe_path(ref: Ref, layer: dict) -> PurePosixPath:
    annotations = layer.get("annotations") or {}
    raw = annotations.get(FILEPATH) or annotations.get(TITLE)
    relative = PurePosixPath(raw or "")
    if not raw or relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise OciError(f"{ref}: layer {layer.get('digest')} has no usable file path ({raw!r})")
    return relative


def signatures(pinned: Ref) -> list[dict]:
    """The model-signing bundles listed as referrers of the artifact, newest last."""
    return referrers(pinned, SIGNATURE_TYPE)
