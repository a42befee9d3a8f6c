"""Running a built model image as the chart's pod would run it, and checking that it answers."""

from __future__ import annotations

import shlex
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

    def stop(self) -> None:
        try:
            self.container.stop(timeout=10)
        finally:
            self.container.remove(force=True)


def start_model(client, reference: str, env: dict[str, str] | None = None, timeout: float = 180,
                volumes: dict | None = None, pod: dict | None = None) -> RunningModel:
    """Start `reference` with the pod's settings (`pod`: `docker run` options, POD_LIKE by default)
    on a free loopback port and wait for readiness; `env` and `volumes` add to the pod's."""
    return _start(client, reference, env, timeout, volumes, pod, "/v1/health/ready")


def start_vllms_own_server(client, reference: str, env: dict[str, str] | None = None, timeout: float = 600,
                           volumes: dict | None = None) -> RunningModel:
    """vLLM's own OpenAI server in a vLLM model image, started as vLLM documents it, with the very
    command line the runtime would run (`serve --dry-run`: the environment it sets for vLLM's
    processes, then vLLM's arguments) less the contract's middleware: the peer the harness and the
    benchmarks compare the runtime with. Ready when vLLM's /health is."""
    environment, arguments = vllm_command(client, reference, env, volumes)
    return _start(client, reference, {**environment, **(env or {})}, timeout, volumes, None, "/health",
                  entrypoint=["python", "-m", "vllm.entrypoints.openai.api_server", *arguments])


def vllm_command(client, reference: str, env: dict[str, str] | None = None,
                 volumes: dict | None = None) -> tuple[dict[str, str], list[str]]:
    """The environment and vLLM arguments the runtime in `reference` resolves (its `serve --dry-run`
    line, `[NAME=VALUE ...] vllm serve ARGS`), less its middleware."""
    options = dict(POD_LIKE)
    out = client.containers.run(reference, ["--dry-run"], remove=True, environment=env or {},
                                volumes={**options.pop("volumes", {}), **(volumes or {})}, **options).decode()
    words = next((shlex.split(line.removeprefix("engine: ")) for line in out.splitlines()
                  if line.startswith("engine: ") and "vllm serve " in line), None)
    if words is None:
        raise CheckFailed(f"{reference} serves no vLLM profile here: {out.strip()}")
    at = words.index("vllm")
    environment = dict(word.split("=", 1) for word in words[:at])
    args = words[at + 2:]
    while "--middleware" in args:
        at = args.index("--middleware")
        del args[at:at + 2]
    return environment, args


def _start(client, reference: str, env: dict[str, str] | None, timeout: float, volumes: dict | None,
           pod: dict | None, ready_path: str, **run: object) -> RunningModel:
    options = dict(pod or POD_LIKE)
    environment = {"NIM_LOG_LEVEL": "INFO", **options.pop("environment", {}), **(env or {})}
    mounts = {**options.pop("volumes", {}), **(volumes or {})}
    container = client.containers.run(reference, detach=True, environment=environment,
                                      ports={f"{PORT}/tcp": ("127.0.0.1", None)}, volumes=mounts, **options, **run)
    container.reload()
    host_port = container.attrs["NetworkSettings"]["Ports"][f"{PORT}/tcp"][0]["HostPort"]
    running = RunningModel(container, f"http://127.0.0.1:{host_port}")
    try:
        wait_ready(running, timeout, ready_path)
    except ContainerError:
        running.stop()
        raise
    return running


def wait_ready(running: RunningModel, timeout: float, path: str = "/v1/health/ready") -> None:
    def exited() -> str | None:
        running.container.reload()
        if running.container.status in ("exited", "dead"):
            return f"the container exited ({running.container.attrs['State'].get('ExitCode')})"
        return None

    if reason := wait_until_ready(running.url, exited, timeout, path):
        raise ContainerError(f"{reason}:\n{running.logs()}")
