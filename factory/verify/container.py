"""Running a built model image as the chart's pod would run it, and checking that it answers."""

from __future__ import annotations

from dataclasses import dataclass

from factory.errors import CheckFailed
from service.image_contract import CACHE_PATH, PORT, UID
from service.launcher import wait_until_ready

# What the base chart gives the pod, for an image run without a chart of its own (`test --url`'s
# reference, the benchmarks): non-root, a read-only root filesystem, writable cache and /tmp
# (emptyDirs, which allow exec, unlike Docker's tmpfs default: torch.compile loads kernels from /tmp).
# The test stage runs the pod options of the very chart it validated (factory.chart.run.pod_options).
POD_LIKE = {"user": f"{UID}:{UID}", "read_only": True,
            "tmpfs": {"/tmp": "size=512m,exec", CACHE_PATH: f"size=1g,exec,uid={UID},gid={UID}",
                      "/dev/shm": "size=256m"},
            "cap_drop": ["ALL"], "security_opt": ["no-new-privileges"]}


class ContainerError(CheckFailed):
    """The container exited or never became ready; the message carries its last log lines."""


@dataclass
class RunningModel:
    container: object
    url: str

    def logs(self, tail: int = 60) -> str:
        return self.container.logs(tail=tail).decode(errors="replace")

    def bridge_url(self, port: int = PORT) -> str:
        """A server on the container's own address (Docker's bridge network), as a Kubernetes
        Service reaches a pod: in the kernel, without the userland proxy behind the loopback port."""
        self.container.reload()
        return f"http://{self.container.attrs['NetworkSettings']['IPAddress']}:{port}"

    def engine_url(self) -> str:
        """vLLM's own server inside the container, from the command line the runtime logs when it starts
        it; reachable where NIM_PASSTHROUGH_ARGS gave it `--host 0.0.0.0` (a second door, for comparisons)."""
        import re

        logs = self.container.logs().decode(errors="replace")  # all of it: the line comes early
        return self.bridge_url(int(re.findall(r"starting vLLM: .*?--port (\d+)", logs)[-1]))

    def stop(self) -> None:
        try:
            self.container.stop(timeout=10)
        finally:
            self.container.remove(force=True)


def start_model(client, reference: str, env: dict[str, str] | None = None, timeout: float = 180,
                volumes: dict | None = None, pod: dict | None = None) -> RunningModel:
    """Start `reference` with the pod's settings (`pod`: `docker run` options, POD_LIKE by default)
    on a free loopback port and wait for readiness; `env` and `volumes` add to the pod's."""
    options = dict(pod or POD_LIKE)
    environment = {"NIM_LOG_LEVEL": "INFO", **options.pop("environment", {}), **(env or {})}
    mounts = {**options.pop("volumes", {}), **(volumes or {})}
    container = client.containers.run(reference, detach=True, environment=environment,
                                      ports={f"{PORT}/tcp": ("127.0.0.1", None)}, volumes=mounts, **options)
    container.reload()
    host_port = container.attrs["NetworkSettings"]["Ports"][f"{PORT}/tcp"][0]["HostPort"]
    running = RunningModel(container, f"http://127.0.0.1:{host_port}")
    try:
        wait_ready(running, timeout)
    except ContainerError:
        running.stop()
        raise
    return running


def wait_ready(running: RunningModel, timeout: float) -> None:
    def exited() -> str | None:
        running.container.reload()
        if running.container.status in ("exited", "dead"):
            return f"the container exited ({running.container.attrs['State'].get('ExitCode')})"
        return None

    if reason := wait_until_ready(running.url, exited, timeout):
        raise ContainerError(f"{reason}:\n{running.logs()}")
