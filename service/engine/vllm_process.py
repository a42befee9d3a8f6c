"""vLLM as a supervised child: its OpenAI server on a private loopback port, fronted by the runtime.

The runtime keeps the contract (health, auth, request ids, metrics with NIM's names, drain) and
passes inference traffic through (service/api/proxy.py). The child's arguments come from the
selected profile, then NIM_* settings, then NIM_PASSTHROUGH_ARGS, last wins. The child runs in a
process group of its own (vLLM starts an engine-core process beside its API server), dies with
the runtime (PR_SET_PDEATHSIG), and is stopped as a group.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

from service.engine.base import EngineError, EngineStats, ProcessEngine
from service.manifest import Profile
from service.settings import SECRET_ENV, Settings

log = logging.getLogger("service.engine.vllm")

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
QUANTIZATION = {"fp8": "fp8"}  # int8 / int4 checkpoints carry their own quantization config
# engine_args the runtime itself consumes rather than passing to vLLM
RUNTIME_ARGS = frozenset({"max_queue", "max_seqs_per_request", "cpu_threads", "kv_cache_tokens"})
START_TIMEOUT_S = 1800.0  # weights download and warm-up compile on big models; the startup probe bounds it
HEALTH_POLL_S = 0.5
STOP_GRACE_S = 20.0
KEEP_ALIVE_ENV, VLLM_KEEP_ALIVE_S = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", 5.0  # vLLM's server closes idle connections after it


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def vllm_arguments(model_dir: Path, served_name: str, profile: Profile, settings: Settings,
                   max_model_len: int, max_num_seqs: int, port: int) -> list[str]:
    """The server's arguments: profile, then NIM_* settings, then NIM_PASSTHROUGH_ARGS (last wins)."""
    tags = profile.tags
    args: dict[str, Any] = {"model": str(model_dir), "served_model_name": served_name, "host": "127.0.0.1",
                            "port": port, "tensor_parallel_size": tags.tp, "pipeline_parallel_size": tags.pp}
    if tags.precision in DTYPES:
        args["dtype"] = DTYPES[tags.precision]
    if tags.precision in QUANTIZATION:
        args["quantization"] = QUANTIZATION[tags.precision]
    args.update({k: v for k, v in profile.engine_args.items() if k not in RUNTIME_ARGS})
    args.update(max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    if settings.tensor_parallel_size:
        args["tensor_parallel_size"] = settings.tensor_parallel_size
    args["enable_prefix_caching"] = settings.enable_kv_cache_reuse
    out: list[str] = []
    for name, value in args.items():
        if value is True:
            out.append(_flag(name))
        elif value is False:
            out.append("--no-" + name.replace("_", "-"))
        elif value is not None:
            out += [_flag(name), json.dumps(value) if isinstance(value, dict | list) else str(value)]
    return out + shlex.split(settings.passthrough_args)


def engine_session(base_url: str, server_keep_alive_s: float):
    """An aiohttp session with the engine's server: no connection limit, and a pool that drops a
    connection once idle for half the server's keep-alive. A request written on a connection as the
    server closes it fails, and a POST that may have reached the server cannot be retried: with
    aiohttp's default pool (15 s) against vLLM's 5 s, the engine benchmark got a 503 ("the engine
    did not answer: ClientOSError") after a quiet spell (tests/integration/test_engine_session.py).

    aiohttp rather than httpx: its C parser and stream reader make the hop cheaper (an SSE relay
    measured here added 2.1 ms to TTFT through aiohttp, 3.25 ms through httpx)."""
    import aiohttp

    return aiohttp.ClientSession(base_url, timeout=aiohttp.ClientTimeout(total=None, connect=5.0),
                                 connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=server_keep_alive_s / 2))


def _timeout(seconds: float):
    import aiohttp

    return aiohttp.ClientTimeout(total=seconds)


def _die_with_parent() -> None:
    """In the child before exec: receive SIGKILL when the runtime dies, however it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class VllmEngine(ProcessEngine):
    def __init__(self, model_dir: Path, served_name: str, profile: Profile, settings: Settings,
                 max_model_len: int, max_num_seqs: int, port: int) -> None:
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.base_url = f"http://127.0.0.1:{port}"
        self.command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                        *vllm_arguments(model_dir, served_name, profile, settings, max_model_len, max_num_seqs, port)]
        self.served_name = served_name
        self._proc: asyncio.subprocess.Process | None = None
        self._client = None
        self._ready = self._stopping = False
        self._stats = EngineStats(0, 0, max_num_seqs, 0.0)
        self._tail: list[str] = []
        self._tasks: list[asyncio.Task] = []

    def describe(self) -> str:
        return shlex.join(self.command)

    @property
    def client(self):
        """An aiohttp session with the child (one pool for proxying and health checks)."""
        return self._client

    @property
    def ready(self) -> bool:
        return self._ready

    def stats(self) -> EngineStats:
        return self._stats

    async def start(self) -> None:
        log.info("starting vLLM: %s", self.describe())
        env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        env.setdefault("VLLM_NO_USAGE_STATS", "1")  # no phoning home, and no writes to ~/.config
        self._proc = await asyncio.create_subprocess_exec(
            *self.command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
            start_new_session=True, preexec_fn=_die_with_parent)
        self._client = engine_session(self.base_url, float(env.get(KEEP_ALIVE_ENV, VLLM_KEEP_ALIVE_S)))
        self._tasks = [asyncio.create_task(self._forward_logs()), asyncio.create_task(self._watch())]
        await self._wait_healthy()
        await self._warm_up()
        self._ready = True

    async def _forward_logs(self) -> None:
        """The child's output joins the runtime's log (JSON lines with NIM_JSONL_LOGGING=1)."""
        assert self._proc and self._proc.stdout
        async for raw in self._proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line:
                self._tail = (self._tail + [line])[-40:]
                log.info("%s", line)

    async def _watch(self) -> None:
        assert self._proc
        code = await self._proc.wait()
        was_ready, self._ready = self._ready, False
        self._kill_group(signal.SIGKILL)
        if not self._stopping and was_ready and self.on_death:
            self.on_death(f"the vLLM process exited with code {code}")

    def _exited(self) -> int | None:
        return self._proc.returncode if self._proc else None

    def _failure(self, what: str) -> EngineError:
        tail = "\n".join(self._tail[-15:])
        return EngineError(f"{what}; last vLLM log lines:\n{tail}")

    async def _wait_healthy(self) -> None:
        """Ready only once vLLM answers its own health check."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if (code := self._exited()) is not None:
                await asyncio.sleep(0.2)  # let the last log lines arrive
                raise self._failure(f"vLLM exited with code {code} while starting")
            try:
                async with self._client.get("/health", timeout=_timeout(2.0)) as response:
                    if response.status == 200:
                        return
            except Exception:  # not listening yet: connection refused, or a time-out
                pass
            await asyncio.sleep(HEALTH_POLL_S)
        raise self._failure(f"vLLM did not become healthy within {START_TIMEOUT_S:.0f}s")

    async def _warm_up(self) -> None:
        """One token through the engine, so a model vLLM cannot run fails here, at start-up,
        rather than at the first client's request."""
        body = {"model": self.served_name, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        try:
            async with self._client.post("/v1/completions", json=body, timeout=_timeout(300.0)) as response:
                status, text = response.status, await response.text()
        except Exception as exc:
            raise self._failure(f"vLLM failed its warm-up request ({type(exc).__name__})") from None
        if status != 200 or self._exited() is not None:
            raise self._failure(f"vLLM cannot run this model: warm-up answered {status} {text[:300]}")

    async def scrape(self) -> bytes:
        """vLLM's own metrics, re-exported as they are, and its gauges under the contract's names."""
        if not self._ready:
            return b""
        try:
            async with self._client.get("/metrics", timeout=_timeout(5.0)) as response:
                text = await response.text()
        except Exception:
            return b""
        self._stats = gauges_from_vllm(text, self.max_num_seqs, self._stats)
        return text.encode()

    def _kill_group(self, sig: int) -> None:
        if self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    async def shutdown(self) -> None:
        self._stopping, self._ready = True, False
        if self._proc and self._proc.returncode is None:
            log.info("stopping vLLM (pid %d)", self._proc.pid)
            self._kill_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self._proc.wait(), STOP_GRACE_S)
            except asyncio.TimeoutError:
                self._kill_group(signal.SIGKILL)
                await self._proc.wait()
        self._kill_group(signal.SIGKILL)  # whatever of the group outlived its leader
        for task in self._tasks:
            task.cancel()
        if self._client:
            await self._client.close()


def gauges_from_vllm(text: str, max_num_seqs: int, previous: EngineStats) -> EngineStats:
    """running, waiting, KV-cache fill and prefix-cache counters from vLLM's exposition (names of vLLM V1
    and before)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    kv = values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc", previous.kv_cache_usage))
    return EngineStats(running=int(values.get("vllm:num_requests_running", previous.running)),
                       waiting=int(values.get("vllm:num_requests_waiting", previous.waiting)),
                       max_num_seqs=max_num_seqs, kv_cache_usage=float(kv),
                       prefix_cache_queries=int(values.get("vllm:prefix_cache_queries_total", previous.prefix_cache_queries)),
                       prefix_cache_hits=int(values.get("vllm:prefix_cache_hits_total", previous.prefix_cache_hits)))
