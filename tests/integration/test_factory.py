"""The factory with its real parts: Docker Engine, a Distribution registry, helm, oras, the tiny model.

Slow (the first run bootstraps the base image and builds the runtime: a few minutes); CI runs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from openai import OpenAI

from factory.chart.helm import helm
from factory.image.build import WHEELS_PORT, BuildError, build_context, ensure_base_image, serve_directory
from factory.image.flavors import DEBIAN_BASE_IMAGE, FLAVORS
from factory.image.lock import locked_versions
from factory.image.wheelhouse import INSTALLER, wheelhouse_dir
from factory.pipeline.runner import RunSettings, Runner
from factory.release import catalog
from factory.release.publish import PublishError, publish
from factory.stack import REGISTRY
from factory.verify.container import start_model
from factory.verify.result import Gate, TestReport
from factory.tinymodel import memorised_pairs
from service import image_contract as contract
from service.engine import cpu_gemm
from service.launcher import free_port
from tests.conftest import wait_for

pytestmark = pytest.mark.slow
SAMPLE = Path(__file__).parents[2] / "pipelines" / "models" / "tiny-llama.yaml"
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json, "
                  "application/vnd.oci.image.index.v1+json")


def progress(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def client(own_catalog):
    import docker

    return docker.from_env()


def make_spec(directory: Path, model_dir: Path, name: str = "tiny-test", version: str = "0.1.0",
              chart_values: dict | None = None) -> Path:
    data = yaml.safe_load(SAMPLE.read_text())
    data["metadata"] = {"name": name, "version": version}
    data["model"]["source"] = f"local://{model_dir}"
    data["chart"] = {"values": chart_values or {}}
    # These tests prove the pipeline's mechanics; a latency SLO on a shared 2-core machine would make
    # them timing tests (the SLO gate's logic is unit-tested in tests/unit/test_slo_gates.py).
    data["tests"]["perf"] = {"concurrency": [1, 8], "requests_per_level": 32}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{version}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def spec_path(tiny_model_dir, tmp_path_factory):
    return make_spec(tmp_path_factory.mktemp("specs"), tiny_model_dir)


@pytest.fixture(scope="module")
def runner(client, spec_path, tmp_path_factory):
    """One runner through every stage, as `inferkiln publish` drives it."""
    return Runner(spec_path, RunSettings(registry=REGISTRY, chart_dir=tmp_path_factory.mktemp("charts"),
                                         report_dir=tmp_path_factory.mktemp("report")), progress)


@pytest.fixture(scope="module")
def built(runner):
    return runner.build()


def test_image_has_labels_a_non_root_user_and_the_manifest(client, runner, built):
    image = client.images.get(built.model.reference)
    labels = image.labels
    for key in ("title", "version", "revision", "created", "source", "licenses"):
        assert labels[f"org.opencontainers.image.{key}"], key
    assert labels["org.opencontainers.image.title"] == "tiny-test"
    assert labels["io.inferkiln.spec-digest"] == runner.validate().spec.digest()
    assert len(labels["io.inferkiln.profile-ids"].split(",")) == 2
    assert image.attrs["Config"]["User"] == f"{contract.UID}:{contract.UID}"
    assert "8000/tcp" in image.attrs["Config"]["ExposedPorts"]
    env = dict(item.split("=", 1) for item in image.attrs["Config"]["Env"])
    assert env["NIM_MANIFEST_PATH"] == "/opt/nim/etc/default/model_manifest.yaml"
    plan = runner.plan()
    assert (built.runtime.reference, built.model.reference) == (plan.runtime_reference, plan.model_reference)
    assert built.model.reference.startswith("inferkiln/tiny-test:0.1.0-")


def test_rebuild_with_nothing_changed_is_a_fast_no_op(spec_path, built):
    again = Runner(spec_path).build()
    assert (again.runtime.built, again.model.built) == (False, False)
    assert again.model == built.model.__class__(built.model.reference, built.model.image_id, False, again.model.seconds)
    assert again.runtime.seconds + again.model.seconds < 2.0


def run_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "factory.cli", *args], capture_output=True, text=True,
                          timeout=900, cwd=cwd, env={**os.environ, **(env or {})})


def test_fetch_names_the_wheelhouse_the_build_installed_from(client, built):
    """`inferkiln fetch cpu`, a no-op once the build has fetched: the complete wheelhouse with its
    installer, and the base image in place."""
    result = run_cli("fetch", "cpu")
    assert result.returncode == 0, result.stderr
    wheels = Path(result.stdout.strip())
    assert wheels == wheelhouse_dir(FLAVORS["cpu"])
    assert (wheels / ".complete").is_file() and (wheels / INSTALLER).is_file()
    assert client.images.get(FLAVORS["cpu"].base_image)


def test_two_hosts_with_different_torch_builds_get_the_same_runtime_image(spec_path, built, tmp_path):
    """The second environment's `torch` is a stand-in for another build (a CUDA build does not fit
    here); an image that depended on the host's torch would get another tag and a new build."""
    fake = tmp_path / "other-env" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "2.99.0+cu999"\n')
    results = []
    for env in ({}, {"PYTHONPATH": str(fake.parent)}):
        result = run_cli("build", str(spec_path), "--json", env=env)
        assert result.returncode == 0, result.stderr[-2000:]
        results.append(json.loads(result.stdout)["runtime"])
    assert results[0]["reference"] == results[1]["reference"] == built.runtime.reference
    assert results[0]["image_id"] == results[1]["image_id"] == built.runtime.image_id


def test_model_image_holds_the_runtime_and_not_the_factory(client, built):
    def python(code: str) -> tuple[int, str]:
        container = client.containers.run(built.model.reference, entrypoint=["python", "-c", code], detach=True)
        code_ = container.wait()["StatusCode"]
        logs = container.logs().decode()
        container.remove(force=True)
        return code_, logs

    assert python("import service, service.app; print(service.__version__)")[0] == 0
    status, logs = python("import factory")
    assert status != 0 and "No module named 'factory'" in logs
    status, logs = python("import importlib.metadata as m; print(m.version('torch'))")
    assert status == 0 and logs.strip() == locked_versions(Path(__file__).parents[2] / "dockerfiles" / "locks" / "cpu.txt")["torch"]


KERNEL_CHECK = """
import torch
from service.engine import cpu_gemm
assert cpu_gemm.library_path().exists(), "not built with the image"
assert cpu_gemm.load()
weight, x = torch.randn(100, 64), torch.randn(5, 64)
assert torch.allclose(torch.ops.inferkiln.linear_fp32(x, cpu_gemm.pack(weight), 100, None), x @ weight.T, atol=1e-4)
print("loaded", cpu_gemm.library_path())
"""


def test_the_cpu_image_carries_its_matmul_kernel_compiled(client, built):
    """Compiled by the image's build, where its user cannot write: a container starts without a compiler run."""
    if not cpu_gemm.runs_here():
        pytest.skip("the AVX2 kernel is for x86 CPUs with AVX2 and FMA: it would not run here")
    logs = client.containers.run(built.model.reference, entrypoint=["python", "-c", KERNEL_CHECK], remove=True,
                                 read_only=True, network_mode="none").decode()
    assert f"loaded {contract.CPU_KERNEL_DIR}/cpu_gemm-" in logs


def test_docker_build_works_on_render_output(client, spec_path, built, tmp_path):
    """By hand, as the CLI's note says: the runtime context builds the factory's very runtime image
    (its steps found in Docker's cache, the wheelhouse served at the same address), the model's too."""
    contexts, _ = Runner(spec_path).render(tmp_path / "render")
    assert contexts.wheels_included, "the build filled the wheelhouse, so render links it in"
    tag = f"inferkiln/render-check:{uuid.uuid4().hex[:8]}"
    try:
        with serve_directory(tmp_path / "render" / "wheels") as wheels:
            assert wheels == f"http://127.0.0.1:{WHEELS_PORT}/"
            runtime = ["--network", "host", "--build-arg", f"WHEELS={wheels}", str(contexts.runtime_dir)]
            ids = []
            for args in (runtime, [str(contexts.model_dir)]):
                result = subprocess.run(["docker", "build", "-q", "-t", tag, *args], capture_output=True, text=True)
                assert result.returncode == 0, result.stderr[-2000:]
                ids.append(result.stdout.strip())
        assert ids[0] == built.runtime.image_id
        model_from = (contexts.model_dir / "Dockerfile").read_text().split("\n", 1)[0]
        assert model_from == f"FROM {built.runtime.reference}"
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


def test_container_runs_like_the_pod_and_answers(client, built):
    running = start_model(client, built.model.reference)
    try:
        prompt, expected = memorised_pairs()[0]
        reply = OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0).completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=30, temperature=0)
        assert reply.choices[0].text == expected
        running.container.reload()
        assert running.container.attrs["HostConfig"]["ReadonlyRootfs"] is True
    finally:
        running.stop()


def test_the_cpu_image_compiles_decode_steps_in_a_pod_like_container(client, built, tmp_path):
    """`compile_decode` in the image's own manifest, mounted: inductor compiles C++ in the container
    (its compiler, a read-only root, the cache path's tmpfs) and the greedy tokens are the same."""
    manifest = yaml.safe_load(client.containers.run(built.model.reference, entrypoint=["cat", contract.MANIFEST_PATH],
                                                    remove=True))
    for profile in manifest["profiles"]:
        if profile["tags"]["engine"] == "torch" and profile["tags"]["gpu"] == "cpu":
            profile.setdefault("engine_args", {})["compile_decode"] = True
    mounted = tmp_path / "manifest"
    mounted.mkdir(mode=0o755)
    (mounted / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    running = start_model(client, built.model.reference, env={"NIM_MANIFEST_PATH": "/opt/compiled/manifest.yaml"},
                          volumes={str(mounted): {"bind": "/opt/compiled", "mode": "ro"}}, timeout=600)
    try:
        prompt, expected = memorised_pairs()[0]
        reply = OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0).completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=30, temperature=0)
        assert reply.choices[0].text == expected
        # The runtime's log writer batches lines for up to 0.1 s, and the reply can come sooner.
        wait_for(lambda: "compiled decode step ready" in running.logs(tail=200) or None, timeout=10,
                 what="the compiled decode step's log line", interval=0.2)
    finally:
        running.stop()


def test_weights_only_change_rebuilds_only_the_model_layers(client, built, tiny_model_dir, tmp_path):
    weights = tmp_path / "weights"
    shutil.copytree(tiny_model_dir, weights)
    (weights / "NOTICE").write_text(f"changed weights {uuid.uuid4()}\n")  # new on every run: a real rebuild
    changed = Runner(make_spec(tmp_path, weights)).build()
    assert changed.runtime.built is False and changed.runtime.reference == built.runtime.reference
    assert changed.model.built is True and changed.model.reference != built.model.reference
    runtime_layers = client.images.get(changed.runtime.reference).attrs["RootFS"]["Layers"]
    model_layers = client.images.get(changed.model.reference).attrs["RootFS"]["Layers"]
    assert model_layers[:len(runtime_layers)] == runtime_layers
    assert len(model_layers) - len(runtime_layers) <= 2, "only the manifest and the weights are new"


def test_no_credentials_in_history_labels_or_env(client, tiny_model_dir, tmp_path, monkeypatch):
    secrets = {"HF_TOKEN": "hf_secret_value_7f3a9", "NGC_API_KEY": "ngc_secret_value_19c2"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    # a version of its own on every run: a new digest, so a real build happens with the secrets set
    images = Runner(make_spec(tmp_path, tiny_model_dir, version=f"0.1.1-t{uuid.uuid4().hex[:8]}")).build()
    assert images.model.built
    for reference in (images.runtime.reference, images.model.reference):
        image = client.images.get(reference)
        text = " ".join([*(h.get("CreatedBy", "") for h in client.api.history(reference)),
                         *image.labels.values(), *image.attrs["Config"]["Env"]])
        for value in secrets.values():
            assert value not in text, f"{value} leaked into {reference}"


def test_a_failing_build_names_the_step_and_exit_code(client, tmp_path):
    ensure_base_image(client, progress)  # the test's own base, whatever ran before it
    (tmp_path / "Dockerfile").write_text(f"FROM {DEBIAN_BASE_IMAGE}\nRUN echo preparing\nRUN exit 3\n")
    with pytest.raises(BuildError) as err:
        build_context(client, tmp_path, "inferkiln/should-fail:1", progress)
    assert "Step 3/3 : RUN exit 3" in str(err.value) and "exit code 3" in str(err.value)


@pytest.fixture(scope="module")
def passing_tests(runner, built):
    report = runner.test()
    assert report.passed, report.summary
    assert (report.report_dir / "summary.md").is_file() and (report.report_dir / "container.log").read_text()
    return report


def oras_pull(reference: str, out: Path) -> list[Path]:
    import oras.client

    return [Path(p) for p in oras.client.OrasClient(insecure=True).pull(target=reference, outdir=str(out))]


def test_publish_pushes_image_sbom_and_the_validated_chart(client, runner, built, passing_tests, tmp_path):
    chart = runner.chart()
    release = runner.publish()
    assert catalog.releases()[-1] == release and not release.forced
    repository, tag = release.image.reference.split("/", 1)[1].rsplit(":", 1)
    manifest = httpx.get(f"http://{REGISTRY}/v2/{repository}/manifests/{tag}", headers={"Accept": MANIFEST_TYPES})
    assert manifest.status_code == 200 and manifest.headers["docker-content-digest"] == release.image.digest
    config_digest = manifest.json()["config"]["digest"]
    config = httpx.get(f"http://{REGISTRY}/v2/{repository}/blobs/{config_digest}").json()
    assert config["config"]["Labels"]["org.opencontainers.image.title"] == "tiny-test"
    assert config["config"]["User"] == f"{contract.UID}:{contract.UID}"
    # the chart in the registry is the very package the chart stage validated
    chart_manifest = httpx.get(f"http://{REGISTRY}/v2/charts/tiny-test/manifests/0.1.0",
                               headers={"Accept": MANIFEST_TYPES}).json()
    [layer] = [entry for entry in chart_manifest["layers"] if entry["mediaType"].endswith("chart.content.v1.tar+gzip")]
    assert layer["digest"] == chart.digest == "sha256:" + hashlib.sha256(chart.path.read_bytes()).hexdigest()
    helm("pull", f"oci://{REGISTRY}/charts/tiny-test", "--version", "0.1.0", "--plain-http", "-d", str(tmp_path))
    pulled = tmp_path / "tiny-test-0.1.0.tgz"
    assert "sha256:" + hashlib.sha256(pulled.read_bytes()).hexdigest() == chart.digest
    values = yaml.safe_load(helm("show", "values", str(pulled)).split("\n", 1)[1])
    assert values["image"]["repository"] == f"{REGISTRY}/{repository}" and values["image"]["tag"] == tag
    # the SBOM refers to the image, under ORAS's referrers tag, and lists the locked torch
    index = httpx.get(f"http://{REGISTRY}/v2/{repository}/manifests/{release.image.digest.replace(':', '-')}",
                      headers={"Accept": MANIFEST_TYPES}).json()
    assert [m["digest"] for m in index["manifests"]] == [release.sbom.digest]
    [sbom_file] = oras_pull(release.sbom.reference, tmp_path / "sbom")
    components = {c["name"]: c["version"] for c in json.loads(sbom_file.read_text())["components"]}
    assert components["torch"] == "2.13.0+cpu"


def failed_report(report_dir: Path) -> TestReport:
    return TestReport.from_gates([Gate(id="accuracy.exact_match", passed=False, detail="0.1 (threshold 0.9)")],
                                 report_dir)


def test_publish_refuses_failed_gates_unless_forced(client, runner, built, tmp_path):
    before = catalog.releases()
    args = (client, runner.validate(), runner.plan().flavor, built, runner.chart(), failed_report(tmp_path), REGISTRY,
            progress)
    with pytest.raises(PublishError, match="gates failed"):
        publish(*args)
    assert catalog.releases() == before
    release = publish(*args, force=True)
    assert release.forced and catalog.releases()[-1].forced


def measured_report(report_dir: Path, tok_s: dict[str, float]) -> TestReport:
    """A passing test run's numbers, as the test stage records them (profile and hardware included)."""
    report_dir.mkdir(parents=True)
    (report_dir / "summary.md").write_text("# Test report\n")
    (report_dir / "index.html").write_text("<h1>report</h1>")
    return TestReport.from_gates([Gate(id="chat.basic", passed=True, detail="")], report_dir, profile="p1",
                                 hardware="a CPU x2; no GPU (CPU only)", output_tokens_per_s=tok_s)


def test_publish_refuses_a_regression_against_the_previous_release_unless_forced(client, runner, built, tmp_path):
    loaded, flavor, chart = runner.validate(), runner.plan().flavor, runner.chart()

    def version(text: str):
        return loaded.model_copy(update={"spec": loaded.spec.model_copy(update={
            "metadata": loaded.spec.metadata.model_copy(update={"version": text})})})

    first = publish(client, version("1.0.0"), flavor, built, chart, measured_report(tmp_path / "a", {"1": 100.0}),
                    REGISTRY, progress)
    assert first.regression is None and not first.forced
    before = catalog.releases()
    slower = (client, version("1.1.0"), flavor, built, chart, measured_report(tmp_path / "b", {"1": 50.0}), REGISTRY,
              progress)
    with pytest.raises(PublishError, match=r"regresses against tiny-test 1\.0\.0 .*output_tokens_per_s@1 50\.0 < 90\.0"):
        publish(*slower)
    assert catalog.releases() == before
    assert "| output_tokens_per_s@1 | 100.000 | 50.000 | 90.000 | FAIL |" in (tmp_path / "b" / "summary.md").read_text()
    forced = publish(*slower, force=True)
    assert forced.forced and not forced.regression.passed and catalog.releases()[-1].forced
    for name in ("summary.md", "index.html"):  # the forced publish replaced the refused one's section
        assert (tmp_path / "b" / name).read_text().count("## Against the previous release") == 1
    assert forced.regression.previous.startswith("tiny-test 1.0.0")


def test_push_to_a_registry_that_is_down_leaves_the_catalog_unchanged(spec_path, built, passing_tests, tmp_path):
    before = catalog.catalog_path().read_bytes() if catalog.catalog_path().exists() else None
    down = f"127.0.0.1:{free_port()}"
    with pytest.raises(Exception) as err:
        Runner(spec_path, RunSettings(registry=down, chart_dir=tmp_path)).publish()
    assert f"publish: pushing the image to {down} failed" in str(err.value)
    after = catalog.catalog_path().read_bytes() if catalog.catalog_path().exists() else None
    assert after == before


def test_pipeline_runs_its_stages(spec_path, built, tmp_path):
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump({"apiVersion": "inferkiln/v1", "kind": "Pipeline", "specs": [str(spec_path)],
                                        "stages": ["validate", "build", "chart", "test"]}))
    result = run_cli("run", str(pipeline), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert [line.split()[2] for line in lines] == ["validate", "build", "chart", "test"]
    assert all(line.startswith("PASS") for line in lines)


def test_a_failing_stage_fails_alike_through_the_cli_a_pipeline_and_the_demo(client, tiny_model_dir, tmp_path):
    bad = make_spec(tmp_path, tiny_model_dir, name="tiny-bad", chart_values={"image": {"pullPolicy": "Sometimes"}})
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump({"apiVersion": "inferkiln/v1", "kind": "Pipeline", "specs": [str(bad)],
                                        "stages": ["validate", "build", "chart", "test"]}))
    runs = {"cli": run_cli("chart", str(bad), cwd=tmp_path), "pipeline": run_cli("run", str(pipeline), cwd=tmp_path),
            "demo": run_cli("demo", "--spec", str(bad), "--no-keep", cwd=tmp_path)}
    errors = {how: [line for line in run.stderr.splitlines() if line.startswith("error: ")] for how, run in runs.items()}
    assert {how: run.returncode for how, run in runs.items()} == {"cli": 1, "pipeline": 1, "demo": 1}
    assert errors["cli"] and errors["cli"] == errors["pipeline"] == errors["demo"], errors
    assert errors["cli"][0].startswith("error: chart: ") and "pullPolicy" in errors["cli"][0]
    assert all("Traceback" not in run.stderr for run in runs.values())


def test_demo_runs_the_whole_path_and_publishes_an_sbom(client, tmp_path):
    result = run_cli("demo", "--no-keep")
    assert result.returncode == 0, result.stderr[-3000:]
    report = next(line.split("report: ", 1)[1] for line in result.stdout.splitlines() if line.startswith("report: "))
    text = Path(report).read_text()
    assert "## Published" in text and "127.0.0.1:5000/inferkiln/tiny-llama" in text
    assert "published: 127.0.0.1:5000/inferkiln/tiny-llama" in result.stdout
    listed = run_cli("catalog", "--json")
    assert listed.returncode == 0
    entries = json.loads(listed.stdout)
    assert [r["name"] for r in entries] == [r.name for r in catalog.releases()]
    sbom = entries[-1]["sbom"]
    assert entries[-1]["name"] == "tiny-llama" and sbom["reference"].endswith(sbom["digest"])
    [sbom_file] = oras_pull(sbom["reference"], tmp_path)
    components = {c["name"]: c["version"] for c in json.loads(sbom_file.read_text())["components"]}
    assert components["torch"] == "2.13.0+cpu" and "fastapi" in components
