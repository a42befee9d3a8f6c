"""The nim-llm chart with the real helm: lint, the value matrix against the Kubernetes API schemas,
schema rejection, policy checks, `chart run` in Docker, and deploy without a cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from factory.chart.checks import MATRIX, check_chart, kubernetes_versions, pod_specs, policy_errors, render_objects
from factory.chart.helm import ChartError, helm, lint
from factory.chart.render import render_chart
from factory.spec import load_spec
from service import image_contract as contract
from service.launcher import free_port

SAMPLE = Path(__file__).parents[2] / "pipelines" / "models" / "tiny-llama.yaml"


@pytest.fixture(scope="module")
def spec(tiny_model_dir, tmp_path_factory):
    data = yaml.safe_load(SAMPLE.read_text())
    data["model"]["source"] = f"local://{tiny_model_dir}"
    path = tmp_path_factory.mktemp("spec") / "tiny-llama.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


@pytest.fixture(scope="module")
def chart_dir(spec, tmp_path_factory):
    return render_chart(spec, "registry.local/inferkiln/tiny-llama:0.1.0-abc123", tmp_path_factory.mktemp("chart"))


def test_per_model_chart_metadata_and_defaults(chart_dir):
    meta = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    assert (meta["name"], meta["version"], meta["appVersion"]) == ("tiny-llama", "0.1.0", "0.1.0-abc123")
    values = yaml.safe_load((chart_dir / "values.yaml").read_text())
    assert values["image"]["repository"] == "registry.local/inferkiln/tiny-llama"
    assert values["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}


def test_lint_strict_and_every_value_set_validates(chart_dir, tmp_path):
    lint(chart_dir)
    for name, values in MATRIX.items():
        values_file = tmp_path / f"{name}.yaml"
        values_file.write_text(yaml.safe_dump(values))
        lint(chart_dir, [values_file])
    report = check_chart(chart_dir)
    assert len(report.kubernetes_versions) == 3 and report.kubernetes_versions == kubernetes_versions()
    assert report.passed, report.errors()
    kinds = {name: {o.split("/")[0] for o in r.objects} for name, r in report.value_sets.items()}
    assert "Deployment" in kinds["cpu"] and "StatefulSet" in kinds["persistence"]
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget"} <= kinds["autoscaling"]
    assert "LeaderWorkerSet" in kinds["multiNode"] and "Deployment" not in kinds["multiNode"]
    assert {"Ingress", "NetworkPolicy", "ServiceMonitor", "ConfigMap"} <= kinds["ingress"]


def test_rendered_pod_is_secure_with_probes_and_gpu_toleration(chart_dir):
    objects = render_objects(chart_dir, MATRIX["gpu"])
    pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["livenessProbe"]["httpGet"]["path"] == "/v1/health/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v1/health/ready"
    assert container["startupProbe"]["failureThreshold"] >= 60
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["runtimeClassName"] == "nvidia"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["model-cache"] == "/opt/nim/.cache" and mounts["dshm"] == "/dev/shm"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["NIM_CACHE_PATH"] == "/opt/nim/.cache" and env["NIM_JSONL_LOGGING"] == "1"


def test_adapters_from_a_claim_are_mounted_read_only_at_nim_peft_source(chart_dir):
    pod = next(o for o in render_objects(chart_dir, MATRIX["adapters"]) if o["kind"] == "Deployment")
    spec = pod["spec"]["template"]["spec"]
    container = spec["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert (env["NIM_PEFT_SOURCE"], env["NIM_PEFT_REFRESH_INTERVAL"]) == (contract.PEFT_DIR, "30")
    mount = next(m for m in container["volumeMounts"] if m["name"] == "lora-adapters")
    assert (mount["mountPath"], mount["readOnly"]) == (contract.PEFT_DIR, True)
    volume = next(v for v in spec["volumes"] if v["name"] == "lora-adapters")
    assert volume["persistentVolumeClaim"] == {"claimName": "lora-adapters", "readOnly": True}
    plain = next(o for o in render_objects(chart_dir, MATRIX["cpu"]) if o["kind"] == "Deployment")
    assert "NIM_PEFT_SOURCE" not in str(plain), "without a claim the image's own adapters (and env) stand"


def test_gpu_toleration_is_rendered_once(chart_dir):
    """A toleration for nvidia.com/gpu given in values is not added again; a CPU pod gets none."""
    for name in ("gpu", "multiNode"):
        for obj in render_objects(chart_dir, MATRIX[name]):
            for pod in pod_specs(obj):
                assert [t["key"] for t in pod["tolerations"]] == ["nvidia.com/gpu"], (name, obj["kind"])
    cpu = next(o for o in render_objects(chart_dir, MATRIX["cpu"]) if o["kind"] == "Deployment")
    assert "tolerations" not in cpu["spec"]["template"]["spec"] and "runtimeClassName" not in cpu["spec"]["template"]["spec"]


@pytest.mark.parametrize("values,message", [
    ({"replicaCount": "many"}, "at '/replicaCount': got string, want integer"),
    ({"colour": "blue"}, "additional properties 'colour' not allowed"),
    ({"model": {"logLevel": "LOUD"}}, "/model/logLevel"),
    ({"persistence": {"enabled": "yes"}}, "/persistence/enabled"),
])
def test_schema_rejects_bad_values_with_helms_error(chart_dir, tmp_path, values, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(values))
    with pytest.raises(ChartError) as err:
        helm("template", "x", str(chart_dir), "-f", str(bad))
    assert message in str(err.value)


@pytest.mark.parametrize("override,problem", [
    ({"containerSecurityContext": {"allowPrivilegeEscalation": True, "capabilities": {"drop": ["ALL"]}}},
     "allowPrivilegeEscalation: false"),
    ({"containerSecurityContext": {"privileged": True, "allowPrivilegeEscalation": False,
                                   "capabilities": {"drop": ["ALL"]}}}, "privileged"),
    ({"podSecurityContext": {"runAsUser": 0, "runAsNonRoot": False}}, "non-root"),
    ({"hostPath": "/srv/models"}, "hostPath"),
    ({"containerSecurityContext": {"allowPrivilegeEscalation": False, "capabilities": {"add": ["SYS_ADMIN"]}}},
     "adds capabilities ['SYS_ADMIN']"),
    ({"image": {"tag": "latest"}}, "not pinned"),
    ({"readinessProbe": None}, "no readinessProbe"),
])
def test_policy_checks_fail_on_unsafe_overrides(chart_dir, override, problem):
    errors = policy_errors(render_objects(chart_dir, override))
    assert any(problem in e for e in errors), errors


@pytest.mark.parametrize("override,check", [
    ({"podSecurityContext": {"runAsUser": 1000}}, "CKV_K8S_40"),  # a UID a host account may have
    ({"resources": {"limits": {"cpu": None}}}, "CKV_K8S_11"),
    ({"containerSecurityContext": {"readOnlyRootFilesystem": False}}, "CKV_K8S_22"),
])
def test_checkov_fails_a_chart_on_any_check_not_accepted(chart_dir, override, check):
    report = check_chart(chart_dir, {"unsafe": override})
    assert not report.passed
    assert any(f"checkov {check}" in e for e in report.errors()), report.errors()


def test_every_object_is_placed_in_the_release_namespace(chart_dir):
    for name, values in MATRIX.items():
        for obj in render_objects(chart_dir, values, namespace="models"):
            assert obj["metadata"].get("namespace") == "models", (name, obj["kind"])


def test_network_policy_admits_only_the_peers_it_names(chart_dir, tmp_path):
    def policy(values: dict) -> dict:
        objects = render_objects(chart_dir, {"networkPolicy": {"enabled": True, **values}})
        return next(o for o in objects if o["kind"] == "NetworkPolicy")["spec"]

    assert policy({})["ingress"] == [], "no peer named: nothing admitted, not every pod in the namespace"
    peers = [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    assert policy({"ingressFrom": peers})["ingress"] == [{"ports": [{"port": 8000, "protocol": "TCP"}], "from": peers}]
    values = tmp_path / "np.yaml"
    values.write_text(yaml.safe_dump({"networkPolicy": {"enabled": True}}))
    notes = helm("install", "x", str(chart_dir), "-f", str(values), "--dry-run=client", "--namespace", "models")
    assert "no pod may reach the API" in notes


def test_an_image_digest_pins_the_image(chart_dir, tmp_path):
    digest = "sha256:" + "ab" * 32
    objects = render_objects(chart_dir, {"image": {"digest": digest}})
    pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == f"registry.local/inferkiln/tiny-llama@{digest}"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"image": {"digest": "latest"}}))
    with pytest.raises(ChartError, match="/image/digest"):
        helm("template", "x", str(chart_dir), "-f", str(bad))


def test_the_test_stage_runs_the_charts_pod(chart_dir):
    """What `test` starts the container with comes from the chart (the very options a pod gets)."""
    from factory.chart.run import pod_options
    from service import image_contract

    options = pod_options(chart_dir, "inferkiln/tiny-llama:0.1.0-local", release="t").main
    assert options["user"] == f"{image_contract.UID}:{image_contract.UID}" and options["read_only"]
    assert options["cap_drop"] == ["ALL"] and options["environment"]["NIM_SERVED_MODEL_NAME"] == "tiny-llama"
    assert {image_contract.CACHE_PATH, "/tmp"} <= set(options["tmpfs"])


def test_deploy_without_a_cluster_fails_clearly(spec, tmp_path):
    port = free_port()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "none",
        "clusters": [{"name": "none", "cluster": {"server": f"https://127.0.0.1:{port}", "insecure-skip-tls-verify": True}}],
        "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}],
        "users": [{"name": "none", "user": {"token": "x"}}]}))
    from factory.chart.deploy import DeployError, api_client

    with pytest.raises(DeployError, match=f"no Kubernetes cluster reachable at https://127.0.0.1:{port}"):
        api_client(kubeconfig)
    with pytest.raises(DeployError, match="not a usable kubeconfig"):
        api_client(tmp_path / "missing")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "factory.cli", *args], capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_chart_run_passes_for_the_tiny_model_image(spec):
    result = run_cli("chart", "run", str(spec.path), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    probes = json.loads(result.stdout)
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probes[name].endswith(": ok"), probes


@pytest.mark.slow
@pytest.mark.parametrize("override,message", [
    ("readinessProbe.httpGet.path=/v1/health/wrong", "readinessProbe GET http://<pod>:8000/v1/health/wrong answered 404"),
    ("readinessProbe.httpGet.port=9999", "readinessProbe GET http://<pod>:9999/v1/health/ready failed: ConnectError"),
    ("livenessProbe.httpGet.port=metrics", "probe port 'metrics' is not a named port"),
])
def test_chart_run_fails_clearly_on_a_wrong_probe(spec, override, message):
    result = run_cli("chart", "run", str(spec.path), "--set", override,
                     "--set", "readinessProbe.periodSeconds=1", "--set", "livenessProbe.periodSeconds=1")
    assert result.returncode == 1
    assert message in result.stderr, result.stderr[-2000:]
