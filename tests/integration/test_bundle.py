"""The air gap: a release of a model-free image, its signed model artifact, SBOM and chart carried
from one registry to another as one OCI image layout, and served from the second alone."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from factory.chart.checks import render_objects
from factory.chart.helm import helm
from factory.chart.run import run_chart
from factory.model.push import push_model
from factory.model.signing import sign_artifact
from factory.pipeline.runner import RunSettings, Runner
from factory.release import catalog
from factory.release.bundle import export_bundle, import_bundle
from factory.release.publish import publish
from factory.stack import REGISTRY_CONFIG, registry_up
from factory.verify.result import Gate, TestReport
from service.launcher import free_port
from service.oci import Ref, get_manifest, referrers
from tests.integration.test_model_artifacts import oci_spec
from tests.unit.test_model_artifacts import key_pair


@contextlib.contextmanager
def registry_at(root: Path):
    """A registry of its own on a free loopback port, stopped when the block ends."""
    address = f"127.0.0.1:{free_port()}"
    root.mkdir(parents=True)
    (root / "config.yml").write_text(REGISTRY_CONFIG.format(root=root / "data", addr=address))
    binary = shutil.which("docker-registry") or shutil.which("registry")
    process = subprocess.Popen([binary, "serve", str(root / "config.yml")], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if registry_up(address):
                break
            subprocess.run(["sleep", "0.1"])
        yield address, process
    finally:
        process.terminate()
        process.wait(10)


def stop(process: subprocess.Popen, address: str) -> None:
    process.terminate()
    process.wait(10)
    assert not registry_up(address)


@pytest.mark.slow
def test_a_release_moves_into_an_air_gapped_registry_and_serves_from_it(own_catalog, tiny_model_dir, tmp_path):
    import docker

    client = docker.from_env()
    private, public = key_pair(tmp_path)
    with registry_at(tmp_path / "a") as (first, first_process), registry_at(tmp_path / "b") as (second, _):
        model = push_model(tiny_model_dir, Ref.parse(f"{first}/models/tiny:0.1.0"), "tiny").ref
        sign_artifact(model, private)
        spec = oci_spec(tmp_path, str(model), public)
        runner = Runner(spec, RunSettings(registry=first, chart_dir=tmp_path / "charts"), lambda _: None)
        loaded, plan, images, chart = runner.validate(), runner.plan(), runner.build(), runner.chart()
        # the harness is tested elsewhere: a forced release (recorded as forced) keeps this test short
        untested = TestReport.from_gates([Gate(id="not.run", passed=False, detail="not run here")], tmp_path / "r")
        release = publish(client, loaded, plan.flavor, images, chart, untested, first, lambda _: None, force=True)
        assert release.model and release.model.digest == model.digest and release.forced

        bundle = tmp_path / "tiny-oci.tar"
        export_bundle(release, bundle)
        with tarfile.open(bundle) as tar:
            names = tar.getnames()
            roles = {m["annotations"]["io.inferkiln.bundle.role"]: m["digest"]
                     for m in json.load(tar.extractfile("index.json"))["manifests"]}
        assert {"oci-layout", "index.json"} <= set(names)
        assert roles == {"image": release.image.digest, "chart": release.chart.digest, "sbom": release.sbom.digest,
                         "model": model.digest, "signature": release.model.signature.rsplit("@", 1)[1]}

        stop(first_process, first)
        imported = import_bundle(bundle, second, tmp_path / "imported-charts").release
        assert imported.image.digest == release.image.digest  # the same bytes: the same digests
        assert imported.model.reference == f"{second}/models/tiny@{model.digest}"
        assert catalog.releases()[-1] == imported
        [sbom] = referrers(Ref.parse(f"{second}/{imported.image.reference.split('/', 1)[1]}").at(imported.image.digest))
        assert sbom["digest"] == release.sbom.digest
        assert get_manifest(Ref.parse(imported.model.signature))[1] == release.model.signature.rsplit("@", 1)[1]

        # the chart names the second registry only, and the pod runs from it: image pulled by digest
        # (no local copy under that name), model pulled and verified by the init container
        helm("pull", f"oci://{second}/charts/tiny-oci", "--version", "0.1.0", "--plain-http", "--untar",
             "-d", str(tmp_path / "pulled"))
        chart_dir = tmp_path / "pulled" / "tiny-oci"
        pod = next(o for o in render_objects(chart_dir, {}, "air") if o["kind"] == "Deployment")
        rendered = json.dumps(pod)
        assert first not in rendered and f"{second}/inferkiln/tiny-oci@{release.image.digest}" in rendered
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.remove(f"{second}/inferkiln/tiny-oci@{release.image.digest}")
        result = run_chart(client, chart_dir, {}, release="air")
        assert result["initContainer download-to-cache"] == "completed"
        assert all(result[p].endswith(": ok") for p in ("startupProbe", "readinessProbe", "livenessProbe"))


def test_a_file_that_is_not_a_bundle_is_bad_input(tmp_path):
    (tmp_path / "x.tar").write_bytes(b"not a tar")
    result = subprocess.run([sys.executable, "-m", "factory.cli", "bundle", "import", str(tmp_path / "x.tar"),
                             "--registry", "127.0.0.1:9"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "not an inferkiln bundle" in result.stderr
