"""Per-model Helm charts rendered from `charts/nim-llm`, linted and packaged with the real helm."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from factory.paths import repo_root
from factory.spec import LoadedSpec
from factory.stack import helm_binary

BASE_CHART = "nim-llm"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


class ChartError(RuntimeError):
    """helm refused the chart (lint, template or package); the message carries helm's output."""


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


def model_values(loaded: LoadedSpec, repository: str, tag: str) -> dict[str, Any]:
    """The chart's defaults for this model: its image, name and resources, then the spec's overrides."""
    spec = loaded.spec
    base = yaml.safe_load((base_chart_dir() / "values.yaml").read_text())
    requests = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    limits: dict[str, Any] = {"memory": spec.resources.memory}
    values: dict[str, Any] = {"image": {"repository": repository, "tag": tag},
                              "model": {"name": spec.served_name},
                              "resources": {"requests": requests, "limits": limits}}
    if spec.resources.gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = spec.resources.gpus
        values["tolerations"] = [GPU_TOLERATION]
    return deep_merge(deep_merge(base, values), spec.chart.values)


def render_chart(loaded: LoadedSpec, repository: str, tag: str, out: Path) -> Path:
    """A chart named for the model (version = spec version, appVersion = image tag) in `out/<name>`."""
    spec = loaded.spec
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


def helm(*args: str) -> str:
    result = subprocess.run([helm_binary(), *args], capture_output=True, text=True)
    if result.returncode:
        raise ChartError(f"helm {args[0]} failed: {(result.stderr or result.stdout).strip()}")
    return result.stdout + result.stderr  # helm reports some results (push) on stderr


def lint(chart_dir: Path, values: list[Path] | None = None) -> str:
    return helm("lint", "--strict", str(chart_dir), *[arg for v in values or [] for arg in ("-f", str(v))])


def package(chart_dir: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    output = helm("package", str(chart_dir), "-d", str(out))
    return Path(re.search(r"saved it to: (\S+)", output).group(1))


def push(package_path: Path, registry: str) -> tuple[str, str]:
    """`helm push` to oci://registry/charts; returns the chart reference and its digest."""
    output = helm("push", str(package_path), f"oci://{registry}/charts", "--plain-http")
    reference = re.search(r"Pushed: (\S+)", output)
    digest = re.search(r"Digest: (sha256:[0-9a-f]+)", output)
    if not (reference and digest):
        raise ChartError(f"helm push gave no reference and digest: {output}")
    return reference.group(1), digest.group(1)
