"""Chart checks: render a matrix of value sets with helm (through pyhelm3), validate every object
against the Kubernetes API schemas, and apply policy (restricted Pod Security Standard, probes,
resources, a pinned image; then checkov's Kubernetes checks, factory/chart/policy.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from factory.stack import helm_binary

# Value sets every chart must render, lint and validate with.
MATRIX: dict[str, dict[str, Any]] = {
    "cpu": {},
    "gpu": {"resources": {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}},
            "runtimeClassName": "nvidia", "shmSize": "16Gi"},
    "persistence": {"persistence": {"enabled": True, "size": "20Gi"}, "statefulSet": {"enabled": True}},
    "autoscaling": {"autoscaling": {"enabled": True, "metrics": [{"type": "Pods", "pods": {
        "metric": {"name": "num_requests_waiting"}, "target": {"type": "AverageValue", "averageValue": "4"}}}]},
        "podDisruptionBudget": {"enabled": True}},
    "multiNode": {"multiNode": {"enabled": True, "size": 2},
                  "resources": {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}},
                  "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    "ingress": {"ingress": {"enabled": True, "className": "nginx"}, "networkPolicy": {"enabled": True},
                "metrics": {"serviceMonitor": {"enabled": True}}, "grafanaDashboard": {"enabled": True}},
    # the weights pulled by an init container into a cache the replicas share, the key from a ConfigMap
    "modelStore": {"modelStore": {"initContainer": True, "verifyKey": {"configMapName": "model-keys"}},
                   "persistence": {"enabled": True, "existingClaim": "model-cache", "accessMode": "ReadWriteMany"},
                   "replicaCount": 2},
    # the weights mounted as an image volume (a runtime that mounts OCI artifacts), the signature checked
    "imageVolume": {"modelStore": {"initContainer": True, "imageVolume": True,
                                   "source": "oci://registry.local/models/tiny@sha256:" + "0" * 64}},
    "ephemeralCache": {"modelStore": {"initContainer": True}, "ephemeralVolume": {"enabled": True, "size": "30Gi"}},
    # LoRA adapters from a claim the replicas share, rescanned
    "adapters": {"adapters": {"claimName": "lora-adapters", "refreshInterval": 30}, "replicaCount": 2},
}
# Kinds from CRDs: kubernetes-validate has no schema for them; their pod templates are still checked.
CRD_KINDS = {"ServiceMonitor", "LeaderWorkerSet"}
# The restricted Pod Security Standard's volume types. Pod Security admission admits `image` volumes
# under it since Kubernetes 1.33 (kubernetes/kubernetes#130394), though its documentation's list lags.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "image", "persistentVolumeClaim",
                      "projected", "secret"}


def kubernetes_versions(count: int = 3) -> list[str]:
    """The newest `count` minor versions kubernetes-validate ships schemas for."""
    from kubernetes_validate import utils

    minors: dict[str, str] = {}
    for version in utils.all_versions():
        minors[".".join(version.split(".")[:2])] = version
    return [minors[m] for m in sorted(minors, key=lambda v: tuple(map(int, v.split("."))))[-count:]]


CHECK_NAMESPACE = "inferkiln-check"  # as `helm install -n`: the templates must place every object in it


def render_objects(chart_dir: Path, values: dict[str, Any], release: str = "check",
                   namespace: str = CHECK_NAMESPACE) -> list[dict[str, Any]]:
    """`helm template` through pyhelm3; the rendered objects."""
    from pyhelm3 import Client

    async def render() -> list[dict[str, Any]]:
        client = Client(executable=helm_binary())
        chart = await client.get_chart(chart_dir)
        return [obj async for obj in _aiter(await client.template_resources(chart, release, values,
                                                                            namespace=namespace))]

    return asyncio.run(render())


async def _aiter(items):
    if hasattr(items, "__aiter__"):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


def schema_errors(objects: list[dict[str, Any]], versions: list[str]) -> list[str]:
    from kubernetes_validate import utils
    from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

    errors = []
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        for version in versions:
            try:
                utils.validate(obj, version, strict=True)
            except ValidationError as exc:
                errors.append(f"{obj['kind']}/{obj['metadata']['name']} (Kubernetes {version}): {exc.message}")
            except SchemaNotFoundError:
                errors.append(f"{obj['kind']} {obj['apiVersion']}: no schema in Kubernetes {version}")
    return errors


def pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {})
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return [spec["template"]["spec"]]
    if obj["kind"] == "LeaderWorkerSet":
        template = spec["leaderWorkerTemplate"]
        return [template[key]["spec"] for key in ("leaderTemplate", "workerTemplate") if key in template]
    return []


def policy_errors(objects: list[dict[str, Any]]) -> list[str]:
    """The restricted Pod Security Standard, probes, resources and a pinned image, per pod template."""
    errors = []
    for obj in objects:
        for pod in pod_specs(obj):
            where = f"{obj['kind']}/{obj['metadata']['name']}"
            errors += [f"{where}: {e}" for e in _restricted(pod)]
            for container in pod.get("containers", []):
                name = f"{where} container {container['name']}"
                for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                    if not container.get(probe):
                        errors.append(f"{name}: no {probe}")
                resources = container.get("resources") or {}
                if not resources.get("requests") or not (resources.get("limits") or {}).get("memory"):
                    errors.append(f"{name}: resources need requests and a memory limit")
                image = container.get("image", "")
                tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
                if "@sha256:" not in image and tag in ("", "latest"):
                    errors.append(f"{name}: image {image!r} is not pinned by tag or digest")
    return errors


def _restricted(pod: dict[str, Any]) -> list[str]:
    errors = []
    pod_ctx = pod.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            errors.append(f"{flag} is not allowed")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            errors.append(f"volume {volume['name']} uses {', '.join(sorted(kinds - RESTRICTED_VOLUMES))}")
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        ctx = container.get("securityContext") or {}
        name = container["name"]
        if ctx.get("privileged"):
            errors.append(f"container {name} is privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            errors.append(f"container {name} must set allowPrivilegeEscalation: false")
        if "ALL" not in ((ctx.get("capabilities") or {}).get("drop") or []):
            errors.append(f"container {name} must drop ALL capabilities")
        added = set((ctx.get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"}
        if added:
            errors.append(f"container {name} adds capabilities {sorted(added)}")
        if not (ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot"))):
            errors.append(f"container {name} must run as non-root (runAsNonRoot: true)")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            errors.append(f"container {name} runs as uid 0")
        seccomp = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            errors.append(f"container {name} needs seccompProfile RuntimeDefault or Localhost")
    return errors


@dataclass(frozen=True)
class ValueSetResult:
    objects: list[str]  # kind/name of every object the value set renders
    errors: list[str]


@dataclass(frozen=True)
class ChartChecks:
    kubernetes_versions: list[str]
    value_sets: dict[str, ValueSetResult]

    @property
    def passed(self) -> bool:
        return all(not r.errors for r in self.value_sets.values())

    def errors(self) -> list[str]:
        return [f"[{name}] {e}" for name, r in self.value_sets.items() for e in r.errors]


def check_chart(chart_dir: Path, matrix: dict[str, dict[str, Any]] | None = None) -> ChartChecks:
    """Every value set rendered, schema-validated and policy-checked (ours, then checkov's); errors
    per value set."""
    from factory.chart.policy import checkov_failures

    versions = kubernetes_versions()
    rendered = {name: render_objects(chart_dir, values) for name, values in (matrix or MATRIX).items()}
    checkov = checkov_failures(rendered)
    return ChartChecks(versions, {
        name: ValueSetResult(sorted(f"{o['kind']}/{o['metadata']['name']}" for o in objects),
                             schema_errors(objects, versions) + policy_errors(objects) + checkov.get(name, []))
        for name, objects in rendered.items()})
