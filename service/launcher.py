"""Start `python -m service serve` as a child process on a free loopback port and wait for ready.

Used by the demo, the tests and the benchmarks, like vLLM's `RemoteOpenAIServer`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_ready(url: str, exited: Callable[[], str | None], timeout: float,
                     path: str = "/v1/health/ready") -> str | None:
    """Poll `url` + `path`: None once it answers 200, else why not (exited, or time ran out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if reason := exited():
            return reason
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return None
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return f"not ready after {timeout:.0f}s"


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, port: int | None = None,
                 log_path: Path | None = None, wait_ready: bool = True, timeout: float = 120.0) -> None:
        self.port = port or free_port()
        self.args = ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = log_path
        self.wait_ready, self.timeout = wait_ready, timeout
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerProcess:
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "service", "serve", *self.args], env=self.env,
                                     stdout=out, stderr=subprocess.STDOUT)
        if self.wait_ready:
            self.wait_for_ready()
        return self

    def wait_for_ready(self) -> None:
        def exited() -> str | None:
            return f"server exited with {self.proc.returncode}" if self.proc.poll() is not None else None

        if reason := wait_until_ready(self.url, exited, self.timeout):
            raise RuntimeError(f"{reason}: {self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path and self.log_path.exists() else ""

    def terminate(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __exit__(self, *exc) -> None:
        self.terminate()
