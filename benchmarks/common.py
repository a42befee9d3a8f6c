"""Helpers the benchmarks share: percentiles, summaries, JSON output, vLLM's own server on the host."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of the samples."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: list[float]) -> dict:
    """Median and quartiles: how paired ratios from rounds on a drifting machine are reported."""
    q1, median, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return {"median": round(median, 3), "q1": round(q1, 3), "q3": round(q3, 3)}


def summarize(latencies: list[float], wall: float) -> dict:
    return {
        "requests": len(latencies),
        "requests_per_s": len(latencies) / wall,
        "latency_ms": {"mean": statistics.fmean(latencies) * 1000, "p50": percentile(latencies, 50) * 1000,
                       "p99": percentile(latencies, 99) * 1000},
    }


def wait_until_quiet(busy_seconds: Callable[[], float], quiet_cores: float = 0.1, window_s: float = 0.25,
                     timeout_s: float = 10.0) -> float:
    """Wait until `busy_seconds` (CPU seconds used so far) grows by less than `quiet_cores` of a core
    over `window_s`; returns the seconds waited. vLLM's CPU build keeps a core busy for 0.1-1 s after
    its last request (its OpenMP threads spin): what is measured in that time shares the cores with it."""
    began = time.perf_counter()
    before, at = busy_seconds(), began
    while time.perf_counter() - began < timeout_s:
        time.sleep(window_s)
        now, now_at = busy_seconds(), time.perf_counter()
        if (now - before) / (now_at - at) < quiet_cores:
            break
        before, at = now, now_at
    return time.perf_counter() - began


# The CPU features that change what an engine computes fast (bf16, int8 and matrix units).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu() -> dict:
    """The CPU's model name and which of CPU_FLAGS it has, from /proc/cpuinfo."""
    fields: dict[str, str] = {}
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.is_file() else []:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name", platform.processor()), "flags": [f for f in CPU_FLAGS if f in flags]}


def machine() -> dict:
    """The machine a result was measured on: cores this process may use, not torch's thread setting
    (a benchmark may have changed that), and the CPU's model and flags."""
    return {"cpu_count": len(os.sched_getaffinity(0)), "cpu": cpu(), "platform": platform.platform(),
            "torch": torch.__version__, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def write_result(name: str, result: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    payload = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
               **result}
    path.write_text(json.dumps(payload, indent=2))
    return path


@contextmanager
def vllm_on_host(python: str, model: Path, served_name: str, log: Path, extra: list[str] = ()) -> Iterator[tuple[str, float]]:
    """vLLM's own OpenAI server as its documentation starts it (default configuration: torch.compile
    on), from a Python environment with vLLM's CPU build on this host; yields its URL and the seconds
    it took to be ready, and stops it afterwards."""
    from service.launcher import free_port, wait_until_ready

    port = free_port()
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", served_name, "--port", str(port), "--host", "127.0.0.1",
               "--max-model-len", "512", "--max-num-seqs", "32", *extra]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1"}
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            url, began = f"http://127.0.0.1:{port}", time.perf_counter()
            if reason := wait_until_ready(url, lambda: None if process.poll() is None else "vLLM exited", 900, "/health"):
                raise RuntimeError(f"{reason}: {log.read_text()[-2000:]}")
            yield url, time.perf_counter() - began
        finally:
            process.terminate()
            process.wait(60)
