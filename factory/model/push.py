"""`inferkiln model push`: a model directory as a CNCF ModelPack artifact (service/modelpack.py).

A blob the repository holds already is not sent again, so a new version of a model costs the
registry, and the push, only the files that changed.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from service.modelpack import ARTIFACT_TYPE, CONFIG_TYPE, FILEPATH, TITLE, media_type, model_config, model_files
from service.oci import MANIFEST_TYPE, Ref, file_descriptor, push_blob, put_manifest


@dataclass(frozen=True)
class PushedModel:
    ref: Ref  # tagged and pinned: REGISTRY/REPO:TAG@sha256:...
    files: int
    bytes_total: int
    bytes_sent: int


def push_model(directory: Path, target: Ref, name: str, version: str | None = None) -> PushedModel:
    """Push every file of `directory` as its own layer, then the config and the manifest (tagged
    `target.tag`, else `version`, else `latest`)."""
    layers, sent = [], 0
    files = model_files(directory)
    for relative in files:
        blob = file_descriptor(directory / relative, media_type(relative))
        blob["annotations"] = {FILEPATH: str(relative), TITLE: str(relative)}
        if push_blob(target, directory / relative, blob):
            sent += blob["size"]
        layers.append(blob)
    config = model_config(name, version, directory, [layer["digest"] for layer in layers])
    with tempfile.TemporaryDirectory() as scratch:
        config_file = Path(scratch) / "config.json"
        config_file.write_bytes(json.dumps(config, separators=(",", ":"), sort_keys=True).encode())
        config_blob = file_descriptor(config_file, CONFIG_TYPE)
        push_blob(target, config_file, config_blob)
    annotations = {"org.opencontainers.image.title": name} | (
        {"org.opencontainers.image.version": version} if version else {})
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": ARTIFACT_TYPE,
                "config": config_blob, "layers": layers, "annotations": annotations}
    tagged = target.tagged(target.tag or version or "latest")
    digest = put_manifest(tagged, manifest)
    return PushedModel(tagged.at(digest), len(layers), sum(layer["size"] for layer in layers), sent)
