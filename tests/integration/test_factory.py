"""The factory with its real parts: Docker Engine, a Distribution registry, helm, the tiny model.

Slow (the first run bootstraps the base image and builds the runtime: a few minutes); CI runs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from openai import OpenAI

from factory import catalog
from factory.chart import helm
from factory.container import start_model
from factory.images import BuildError, build_context, build_model
from factory.publish import PublishError, publish
from factory.spec import load_spec
from factory.stack import REGISTRY, stack_up
from factory.stages import container_test
from factory.tinymodel import memorised_pairs
from service.launcher import free_port

pytestmark = pytest.mark.slow
SAMPLE = Path(__file__).parents[2] / "pipelines" / "models" / "tiny-llama.yaml"
MANIFEST_TYPES = "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"


def progress(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A catalog of the tests' own (the registry and images are shared with the machine)."""
    path = tmp_path_factory.mktemp("inferkiln-home")
    old = os.environ.get("INFERKILN_HOME")
    os.environ["INFERKILN_HOME"] = str(path)
    yield path
    if old is None:
        os.environ.pop("INFERKILN_HOME")
    else:
        os.environ["INFERKILN_HOME"] = old


@pytest.fixture(scope="module")
def client(home):
    import docker

    stack_up()
    return docker.from_env()


def make_spec(directory: Path, model_dir: Path, name: str = "tiny-test", version: str = "0.1.0") -> Path:
    data = yaml.safe_load(SAMPLE.read_text())
    data["metadata"] = {"name": name, "version": version}
    data["model"]["source"] = f"local://{model_dir}"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{version}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def spec(tiny_model_dir, tmp_path_factory):
    return load_spec(make_spec(tmp_path_factory.mktemp("specs"), tiny_model_dir))


@pytest.fixture(scope="module")
def built(client, spec):
    return build_model(client, spec, progress)


def test_image_has_labels_a_non_root_user_and_the_manifest(client, spec, built):
    runtime, model = built
    image = client.images.get(model.reference)
    labels = image.labels
    for key in ("title", "version", "revision", "created", "source", "licenses"):
        assert labels[f"org.opencontainers.image.{key}"], key
    assert labels["org.opencontainers.image.title"] == "tiny-test"
    assert labels["io.inferkiln.spec-digest"] == spec.spec.digest()
    assert len(labels["io.inferkiln.profile-ids"].split(",")) == 2
    assert image.attrs["Config"]["User"] == "1000:1000"
    assert "8000/tcp" in image.attrs["Config"]["ExposedPorts"]
    env = dict(item.split("=", 1) for item in image.attrs["Config"]["Env"])
    assert env["NIM_MANIFEST_PATH"] == "/opt/nim/etc/default/model_manifest.yaml"
    assert model.reference.startswith("inferkiln/tiny-test:0.1.0-") and runtime.reference.startswith("inferkiln/runtime-cpu:")


def test_rebuild_with_nothing_changed_is_a_fast_no_op(client, spec, built):
    runtime, model = build_model(client, spec, progress)
    assert (runtime.built, model.built) == (False, False)
    assert model.reference == built[1].reference and model.image_id == built[1].image_id
    assert runtime.seconds + model.seconds < 2.0


def test_container_runs_like_the_pod_and_answers(client, built):
    running = start_model(client, built[1].reference)
    try:
        prompt, expected = memorised_pairs()[0]
        reply = OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0).completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=30, temperature=0)
        assert reply.choices[0].text == expected
        running.container.reload()
        assert running.container.attrs["HostConfig"]["ReadonlyRootfs"] is True
    finally:
        running.stop()


def test_weights_only_change_rebuilds_only_the_model_layers(client, built, tiny_model_dir, tmp_path):
    weights = tmp_path / "weights"
    shutil.copytree(tiny_model_dir, weights)
    (weights / "NOTICE").write_text(f"changed weights {uuid.uuid4()}\n")  # new on every run: a real rebuild
    changed = load_spec(make_spec(tmp_path, weights))
    runtime, model = build_model(client, changed, progress)
    assert runtime.built is False and runtime.reference == built[0].reference
    assert model.built is True and model.reference != built[1].reference
    runtime_layers = client.images.get(runtime.reference).attrs["RootFS"]["Layers"]
    model_layers = client.images.get(model.reference).attrs["RootFS"]["Layers"]
    assert model_layers[:len(runtime_layers)] == runtime_layers
    assert len(model_layers) - len(runtime_layers) <= 2, "only the manifest and the weights are new"


def test_no_credentials_in_history_labels_or_env(client, tiny_model_dir, tmp_path, monkeypatch):
    secrets = {"HF_TOKEN": "hf_secret_value_7f3a9", "NGC_API_KEY": "ngc_secret_value_19c2"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    # a version of its own on every run: a new digest, so a real build happens with the secrets set
    variant = load_spec(make_spec(tmp_path, tiny_model_dir, version=f"0.1.1-t{uuid.uuid4().hex[:8]}"))
    runtime, model = build_model(client, variant, progress)
    assert model.built
    for reference in (runtime.reference, model.reference):
        image = client.images.get(reference)
        text = " ".join([*(h.get("CreatedBy", "") for h in client.api.history(reference)),
                         *image.labels.values(), *image.attrs["Config"]["Env"]])
        for value in secrets.values():
            assert value not in text, f"{value} leaked into {reference}"


def test_a_failing_build_names_the_step_and_exit_code(client, tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM inferkiln/base:bookworm-py311\nRUN echo preparing\nRUN exit 3\n")
    with pytest.raises(BuildError) as err:
        build_context(client, tmp_path, "inferkiln/should-fail:1", progress)
    assert "Step 3/3 : RUN exit 3" in str(err.value) and "exit code 3" in str(err.value)


@pytest.fixture(scope="module")
def passing_tests(spec, built, tmp_path_factory):
    report = tmp_path_factory.mktemp("report")
    result = container_test(spec, built[1].reference, report, progress)
    assert result["passed"], result["summary"]
    assert (report / "summary.md").is_file() and (report / "container.log").read_text()
    return result


def test_publish_pushes_image_and_chart_and_reads_back(client, spec, built, passing_tests, tmp_path):
    release = publish(client, spec, built[1].reference, REGISTRY, passing_tests, progress)
    assert catalog.releases()[-1] == release and not release.forced
    repository, tag = release.image.reference.split("/", 1)[1].rsplit(":", 1)
    manifest = httpx.get(f"http://{REGISTRY}/v2/{repository}/manifests/{tag}", headers={"Accept": MANIFEST_TYPES})
    assert manifest.status_code == 200 and manifest.headers["docker-content-digest"] == release.image.digest
    config_digest = manifest.json()["config"]["digest"]
    config = httpx.get(f"http://{REGISTRY}/v2/{repository}/blobs/{config_digest}").json()
    assert config["config"]["Labels"]["org.opencontainers.image.title"] == "tiny-test"
    assert config["config"]["User"] == "1000:1000"
    helm("pull", f"oci://{REGISTRY}/charts/tiny-test", "--version", "0.1.0", "--plain-http", "-d", str(tmp_path))
    pulled = tmp_path / "tiny-test-0.1.0.tgz"
    chart = yaml.safe_load(helm("show", "chart", str(pulled)))
    assert chart["name"] == "tiny-test" and chart["appVersion"] == tag
    values = yaml.safe_load(helm("show", "values", str(pulled)).split("\n", 1)[1])
    assert values["image"]["repository"] == f"{REGISTRY}/{repository}" and values["image"]["tag"] == tag


def test_publish_refuses_failed_gates_unless_forced(client, spec, built):
    before = catalog.releases()
    failed = {"passed": False, "summary": "1/2 checks passed"}
    with pytest.raises(PublishError, match="gates failed"):
        publish(client, spec, built[1].reference, REGISTRY, failed, progress)
    assert catalog.releases() == before
    release = publish(client, spec, built[1].reference, REGISTRY, failed, progress, force=True)
    assert release.forced and catalog.releases()[-1].forced


def test_push_to_a_registry_that_is_down_leaves_the_catalog_unchanged(client, spec, built, passing_tests):
    before = catalog.catalog_path().read_bytes() if catalog.catalog_path().exists() else None
    down = f"127.0.0.1:{free_port()}"
    with pytest.raises(PublishError) as err:
        publish(client, spec, built[1].reference, down, passing_tests, progress)
    assert f"pushing the image to {down} failed" in str(err.value)
    after = catalog.catalog_path().read_bytes() if catalog.catalog_path().exists() else None
    assert after == before


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "factory.cli", *args], capture_output=True, text=True,
                          timeout=900, cwd=cwd, env=os.environ.copy())


def test_pipeline_runs_its_stages(spec, built, tmp_path):
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump({"apiVersion": "inferkiln/v1", "kind": "Pipeline", "specs": [str(spec.path)],
                                        "stages": ["validate", "build", "chart", "test"]}))
    result = run_cli("run", str(pipeline), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert [line.split()[2] for line in lines] == ["validate", "build", "chart", "test"]
    assert all(line.startswith("PASS") for line in lines)


def test_catalog_command_lists_releases(home):
    result = run_cli("catalog", "--json")
    assert result.returncode == 0
    import json

    assert [r["name"] for r in json.loads(result.stdout)] == [r.name for r in catalog.releases()]


def test_demo_runs_the_whole_path(client):
    result = run_cli("demo", "--no-keep")
    assert result.returncode == 0, result.stderr[-3000:]
    report = next(line.split("report: ", 1)[1] for line in result.stdout.splitlines() if line.startswith("report: "))
    text = Path(report).read_text()
    assert "## Published" in text and "127.0.0.1:5000/inferkiln/tiny-llama" in text
    assert "published: 127.0.0.1:5000/inferkiln/tiny-llama" in result.stdout
