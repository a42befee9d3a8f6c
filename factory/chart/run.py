"""`inferkiln chart run`: run the pod spec a chart renders in Docker and ask its probes as the
kubelet would (HTTP GET to the pod's own address, success for 200-399), which proves a chart here,
where no cluster can run.

Probes are asked every half second rather than every `periodSeconds`, within each probe's own time
budget (`initialDelaySeconds + periodSeconds * failureThreshold`), so a run takes seconds.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from factory.chart.checks import pod_specs, render_objects
from factory.chart.helm import ChartError

POLL_SECONDS = 0.5


def workload(objects: list[dict[str, Any]]) -> dict[str, Any]:
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet") and pod_specs(obj):
            return obj
    raise ChartError("the chart renders no Deployment or StatefulSet to run")


@dataclass
class PodRun:
    """A pod as Docker runs it: its init containers (image, options), each to completion in order,
    then the server's options. An emptyDir that an init container fills is a Docker volume the
    server mounts too, as containers of one pod share it; so is a generic ephemeral volume. Both are
    removed after the run, as they are with the pod."""

    main: dict[str, Any]
    init: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)
    artifacts: dict[str, Path] = field(default_factory=dict)  # image volumes: reference -> host directory


def pod_run(pod: dict[str, Any], release: str) -> PodRun:
    inits = pod.get("initContainers") or []
    mounted = {m["name"] for c in inits for m in c.get("volumeMounts", [])}
    shared = {v["name"]: f"inferkiln-{release}-{v['name']}-{uuid.uuid4().hex[:8]}" for v in pod.get("volumes", [])
              if ("emptyDir" in v and v["name"] in mounted) or "ephemeral" in v}  # ephemeral: a claim per pod
    artifacts = {v["image"]["reference"]: Path(tempfile.mkdtemp(prefix="inferkiln-image-volume-"))
                 for v in pod.get("volumes", []) if "image" in v}
    # An init container runs on the host's network: the registry it pulls from listens on loopback
    # here, where a pod would reach it over the cluster's network.
    init = [(c["image"], docker_options(pod, release, c, shared, artifacts) | {"network_mode": "host"}) for c in inits]
    return PodRun(docker_options(pod, release, pod["containers"][0], shared, artifacts), init, list(shared.values()),
                  artifacts)


@contextlib.contextmanager
def init_containers_run(client, run: PodRun, timeout: float = 1800) -> Iterator[None]:
    """Run the pod's init containers to completion (a failure raises ChartError with its log);
    remove the volumes they shared once the block ends."""
    try:
        for reference, directory in run.artifacts.items():
            _mount_artifact(reference, directory)
        for image, options in run.init:
            container = client.containers.run(image, detach=True, **options)
            try:
                status = container.wait(timeout=timeout)
                if status.get("StatusCode"):
                    logs = container.logs(tail=20).decode(errors="replace").strip()
                    raise ChartError(f"init container {image} exited {status['StatusCode']}:\n{logs}")
            finally:
                container.remove(force=True)
        yield
    finally:
        for name in run.volumes:
            with contextlib.suppress(Exception):  # absent when no init container got to create it
                client.volumes.get(name).remove(force=True)
        for directory in run.artifacts.values():
            shutil.rmtree(directory, ignore_errors=True)


def _mount_artifact(reference: str, directory: Path) -> None:
    """What a kubelet whose runtime mounts OCI artifacts (CRI-O) does for an image volume, done here
    where no cluster runs: the ModelPack artifact's files, pulled by digest, readable by the pod's user."""
    from service.modelpack import pull_model
    from service.oci import OciError, Ref

    try:
        pull_model(Ref.parse(reference), directory / "files")
    except OciError as exc:
        raise ChartError(f"image volume {reference}: {exc}") from None
    for path in [directory, *directory.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def docker_options(pod: dict[str, Any], release: str, container: dict[str, Any],
                   shared: dict[str, str] | None = None, artifacts: dict[str, Path] | None = None) -> dict[str, Any]:
    """The container's settings as `docker run` options: env, user, filesystem, capabilities, mounts."""
    ctx, pod_ctx = container.get("securityContext") or {}, pod.get("securityContext") or {}
    env = {}
    for item in container.get("env", []):
        if "value" not in item:
            raise ChartError(f"env {item['name']}: only literal values can run here (no valueFrom)")
        env[item["name"]] = str(item["value"])
    user = ctx.get("runAsUser", pod_ctx.get("runAsUser"))
    group = ctx.get("runAsGroup", pod_ctx.get("runAsGroup"))
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    tmpfs, mounts = {}, {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"])
        if volume is None:
            raise ChartError(f"volumeMount {mount['name']} names no volume of the pod")
        if "image" in volume and volume["image"]["reference"] in (artifacts or {}):
            mounts[str(artifacts[volume["image"]["reference"]] / "files")] = {"bind": mount["mountPath"], "mode": "ro"}
        elif volume["name"] in (shared or {}):
            mounts[shared[volume["name"]]] = {"bind": mount["mountPath"], "mode": "rw"}
        elif "emptyDir" in volume:
            # emptyDir directories are world-writable and, unlike Docker's tmpfs default, allow exec
            # (torch.compile loads the kernels it builds from /tmp)
            tmpfs[mount["mountPath"]] = "mode=1777,exec"
        elif "persistentVolumeClaim" in volume:
            mounts[f"inferkiln-{release}-{volume['persistentVolumeClaim']['claimName']}"] = {"bind": mount["mountPath"], "mode": "rw"}
        elif "hostPath" in volume:
            mounts[volume["hostPath"]["path"]] = {"bind": mount["mountPath"], "mode": "rw"}
        else:
            raise ChartError(f"volume {mount['name']}: {', '.join(set(volume) - {'name'})} cannot be mounted here")
    options: dict[str, Any] = {
        "environment": env, "tmpfs": tmpfs, "volumes": mounts,
        "read_only": bool(ctx.get("readOnlyRootFilesystem")),
        "cap_drop": list((ctx.get("capabilities") or {}).get("drop") or []),
        "cap_add": list((ctx.get("capabilities") or {}).get("add") or []),
        "security_opt": ["no-new-privileges"] if ctx.get("allowPrivilegeEscalation") is False else [],
    }
    if user is not None:
        options["user"] = f"{user}:{group}" if group is not None else str(user)
    if container.get("command"):
        options["entrypoint"] = container["command"]
    if container.get("args"):
        options["command"] = container["args"]
    return options


def image_values(image_reference: str) -> dict[str, Any]:
    """Values that run `image_reference` in a chart's pod: the validated chart names the registry's
    copy of the image, a test or `chart run` runs the local one."""
    repository, tag = image_reference.rsplit(":", 1)
    return {"image": {"repository": repository, "tag": tag}}


def pod_options(package: Path, image_reference: str, release: str) -> PodRun:
    """The pod a chart package renders with its own values, running `image_reference`, as Docker runs it."""
    obj = workload(render_objects(package, image_values(image_reference), release))
    return pod_run(pod_specs(obj)[0], release)


def probe_url(container: dict[str, Any], probe: dict[str, Any], address: str) -> str:
    get = probe.get("httpGet")
    if not get:
        raise ChartError("only httpGet probes can be asked here")
    port = get["port"]
    if isinstance(port, str) and not port.isdigit():
        named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        if port not in named:
            raise ChartError(f"probe port {port!r} is not a named port of the container ({sorted(named)})")
        port = named[port]
    return f"http://{address}:{port}{get.get('path', '/')}"


def ask(url: str, probe: dict[str, Any], running) -> str | None:
    """None when the probe succeeds within its budget, else the last failure."""
    budget = probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    deadline, last = time.monotonic() + budget, "never asked"
    while time.monotonic() < deadline:
        running.reload()
        if running.status in ("exited", "dead"):
            return f"the container exited ({running.attrs['State'].get('ExitCode')})"
        try:
            response = httpx.get(url, timeout=probe.get("timeoutSeconds", 1) + 1)
            if 200 <= response.status_code < 400:
                return None
            last = f"answered {response.status_code}"
        except httpx.HTTPError as exc:
            last = f"failed: {type(exc).__name__}: {exc or 'no answer'}"
        time.sleep(POLL_SECONDS)
    return last


def run_chart(client, chart_dir: Path, values: dict[str, Any], release: str = "chart-run") -> dict[str, Any]:
    """Run the rendered pod and ask startup, then readiness and liveness; raise ChartError on failure."""
    obj = workload(render_objects(chart_dir, values, release))
    pod = pod_specs(obj)[0]
    container, run = pod["containers"][0], pod_run(pod, release)
    results: dict[str, Any] = {"workload": f"{obj['kind']}/{obj['metadata']['name']}", "image": container["image"]}
    with init_containers_run(client, run):
        results |= {f"initContainer {c['name']}": "completed" for c in pod.get("initContainers") or []}
        return _run_server(client, container, run, results)


def _run_server(client, container: dict[str, Any], run: PodRun, results: dict[str, Any]) -> dict[str, Any]:
    running = client.containers.run(container["image"], detach=True, **run.main)
    try:
        running.reload()
        address = running.attrs["NetworkSettings"]["IPAddress"]
        for name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(name)
            if not probe:
                results[name] = "absent"
                continue
            url = probe_url(container, probe, address)
            failure = ask(url, probe, running)
            results[name] = f"GET {url.replace(address, '<pod>')}: {failure or 'ok'}"
            if failure:
                logs = running.logs(tail=30).decode(errors="replace")
                raise ChartError(f"{name} GET {url.replace(address, '<pod>')} {failure}\nlast log lines:\n{logs}")
        return results
    finally:
        running.remove(force=True)
