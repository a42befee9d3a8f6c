"""The per-model chart: `charts/nim-llm` with the model's name, image, resources and overrides."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import yaml

from factory.paths import repo_root
from factory.spec import LoadedSpec
from service import image_contract as contract

BASE_CHART = "nim-llm"
GPU_SHM_SIZE = "16Gi"  # /dev/shm for NCCL and vLLM's worker processes, as NIM's docs give --shm-size


def base_chart_dir() -> Path:
    return repo_root() / "charts" / BASE_CHART


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def contract_values() -> dict[str, Any]:
    """The values the image contract decides: port, cache path and the user the image runs as."""
    ids = {"runAsUser": contract.UID, "runAsGroup": contract.UID}
    return {"model": {"nimCache": contract.CACHE_PATH, "openaiPort": contract.PORT},
            "service": {"openaiPort": contract.PORT},
            "podSecurityContext": {**ids, "fsGroup": contract.UID}}


def model_values(loaded: LoadedSpec, repository: str, tag: str) -> dict[str, Any]:
    """The chart's defaults for this model: its image, name and resources, then the spec's overrides."""
    spec = loaded.spec
    base = yaml.safe_load((base_chart_dir() / "values.yaml").read_text())
    requests = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    limits: dict[str, Any] = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}  # Guaranteed QoS
    values: dict[str, Any] = {"image": {"repository": repository, "tag": tag},
                              "model": {"name": spec.served_name},
                              "resources": {"requests": requests, "limits": limits}}
    if not spec.model.bake:  # the weights are not in the image: an init container fills the cache
        values["modelStore"] = {"initContainer": True, "source": spec.model.source}
    if spec.resources.gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = spec.resources.gpus
        values["shmSize"] = GPU_SHM_SIZE  # the chart adds the GPU toleration to a pod with a GPU limit
    return deep_merge(deep_merge(deep_merge(base, contract_values()), values), spec.chart.values)


def render_chart(loaded: LoadedSpec, image_reference: str, out: Path) -> Path:
    """A chart named for the model (version = spec version, appVersion = image tag) in `out/<name>`."""
    spec = loaded.spec
    repository, tag = image_reference.rsplit(":", 1)
    target = out / spec.metadata.name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(base_chart_dir(), target)
    chart = yaml.safe_load((target / "Chart.yaml").read_text())
    chart.update(name=spec.metadata.name, version=spec.metadata.version, appVersion=tag,
                 description=f"{spec.served_name}: an OpenAI-compatible inference microservice made by inferkiln")
    (target / "Chart.yaml").write_text(yaml.safe_dump(chart, sort_keys=False))
    header = f"# Defaults for {spec.metadata.name}; every key is documented in the nim-llm chart's values.yaml.\n"
    (target / "values.yaml").write_text(header + yaml.safe_dump(model_values(loaded, repository, tag), sort_keys=False))
    return target
