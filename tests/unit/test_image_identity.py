"""Locks, image identity and the image contract: pure logic, no Docker, no network."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from factory.chart.render import base_chart_dir, contract_values
from factory.image.context import model_dockerfile, runtime_digest, runtime_dockerfile
from factory.image.flavors import FLAVORS, flavor
from factory.image.lock import is_current, lock_inputs, locked_versions
from factory.paths import repo_root
from factory.spec import load_spec
from service import image_contract as contract
from service.settings import Settings

ROOT = repo_root()
GOLDEN = Path(__file__).parents[1] / "golden"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "factory.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_checked_in_locks_are_current():
    """What CI runs: a lock that no longer matches pyproject.toml fails the suite."""
    result = cli("lock", "--check")
    assert result.returncode == 0, result.stderr


def test_a_changed_dependency_makes_the_lock_stale(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    text = (ROOT / "pyproject.toml").read_text()
    pyproject.write_text(text)
    assert is_current(FLAVORS["cpu"], pyproject)
    pyproject.write_text(text.replace('"httpx>=0.27",', '"httpx>=0.27",\n    "rich>=13",'))
    assert not is_current(FLAVORS["cpu"], pyproject)


def test_flavor_extras_pin_over_the_runtime_ranges():
    requirements = lock_inputs(FLAVORS["cpu"]).requirements
    assert "torch==2.13.0+cpu" in requirements and not any(r.startswith("torch>") for r in requirements)
    assert locked_versions(FLAVORS["cpu"].lock_path)["torch"] == "2.13.0+cpu"
    assert "vllm" in locked_versions(FLAVORS["cuda"].lock_path)


def copy_inputs(target: Path) -> Path:
    """The parts of the tree an identity could depend on: the runtime, templates, locks, the factory."""
    for name in ("service", "dockerfiles", "factory"):
        shutil.copytree(ROOT / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def test_the_runtime_tag_follows_the_lock_and_the_runtime_not_the_factory(tmp_path):
    root = copy_inputs(tmp_path / "tree")
    cpu = FLAVORS["cpu"]
    before = runtime_digest(cpu, root)
    (root / "factory" / "cli.py").write_text((root / "factory" / "cli.py").read_text() + "\n# new help text\n")
    assert runtime_digest(cpu, root) == before, "editing the CLI must not re-tag the runtime"
    lock = root / "dockerfiles" / "locks" / "cpu.txt"
    lock.write_text(lock.read_text().replace("tqdm==", "tqdm===", 1))
    assert runtime_digest(cpu, root) != before, "a changed lock re-tags the runtime"
    lock.write_text((ROOT / "dockerfiles" / "locks" / "cpu.txt").read_text())
    (root / "service" / "app.py").write_text((root / "service" / "app.py").read_text() + "\n")
    assert runtime_digest(cpu, root) != before, "changed runtime code re-tags the runtime"


def test_the_host_torch_does_not_change_the_runtime_reference(tmp_path, tiny_model_dir):
    """A stand-in `torch` (another build's version) shadows the real one: no second real torch build
    fits on this machine, and the factory must not read the host's torch at all."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "2.99.0+cu999"\n')
    spec = tmp_path / "spec.yaml"
    data = yaml.safe_load((ROOT / "pipelines" / "models" / "tiny-llama.yaml").read_text())
    data["model"]["source"] = f"local://{tiny_model_dir}"
    spec.write_text(yaml.safe_dump(data))
    outputs = []
    for env in ({}, {"PYTHONPATH": str(fake.parent)}):
        result = cli("render", str(spec), "-o", str(tmp_path / f"out{len(outputs)}"), env=env)
        assert result.returncode == 0, result.stderr
        outputs.append([line.split(" ", 2)[-1] for line in result.stdout.splitlines()[:2]])
    assert outputs[0] == outputs[1]
    check = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(fake.parent)})
    assert check.stdout.strip() == "2.99.0+cu999", "the stand-in was not the torch that process saw"


def test_the_image_contract_is_the_one_source():
    settings = Settings()
    assert (settings.manifest_path, settings.cache_path, settings.server_port) == (
        contract.MANIFEST_PATH, contract.CACHE_PATH, contract.PORT)
    base = yaml.safe_load((base_chart_dir() / "values.yaml").read_text())
    for section, values in contract_values().items():
        for key, value in values.items():
            assert base[section][key] == value, f"charts/nim-llm/values.yaml {section}.{key} disagrees with the contract"
    env = contract.image_env()
    assert env["NIM_MANIFEST_PATH"] == contract.MANIFEST_PATH and env["PYTHONPATH"] == contract.APP_DIR


def meaningful(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("name", ["runtime-cpu", "runtime-vllm-cpu", "runtime-cuda", "model"])
def test_rendered_dockerfiles_match_their_golden_files(name, tiny_model_dir, tmp_path):
    """Set UPDATE_GOLDEN=1 to rewrite them after an intended change."""
    if name == "model":
        data = yaml.safe_load((ROOT / "pipelines" / "models" / "tiny-llama.yaml").read_text())
        data["model"]["source"] = f"local://{tiny_model_dir}"
        (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
        text = model_dockerfile(load_spec(tmp_path / "spec.yaml"), "inferkiln/runtime-cpu:0123456789ab",
                                {"org.opencontainers.image.title": "tiny-llama"})
    else:
        text = runtime_dockerfile(flavor(name.removeprefix("runtime-")))
    golden = GOLDEN / f"{name}.Dockerfile"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert meaningful(text) == meaningful(golden.read_text())
