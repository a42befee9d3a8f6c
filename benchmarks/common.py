"""Helpers the benchmarks share: percentiles, summaries, JSON output, vLLM's own server on the host."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NamedTuple

import psutil
import torch

from service.profiles import cpu_cores


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


def round_order(names: list[str], turn: int) -> list[str]:
    """The order of `names` (engines, doors) in round `turn`: a Williams design, whose first n
    rounds (2n for an odd n) put each name in each position once and right after each other name
    once (twice), so that neither being measured first nor what ran just before favours one. A
    rotation alone keeps the cycle's order: with three doors A always ran right after C, and B
    after A."""
    n = len(names)
    base = [0] + [k for i in range(1, n // 2 + 1) for k in (i, n - i)][:n - 1]  # 0, 1, n-1, 2, n-2, ...
    square = [[(b + shift) % n for b in base] for shift in range(n)]
    if n % 2:
        square += [row[::-1] for row in square]
    return [names[i] for i in square[turn % len(square)]]


def concurrency_levels(text: str) -> tuple[int, ...]:
    """`--levels 1,16,64` (an argparse type: a bad value is a usage error, not a traceback)."""
    try:
        levels = tuple(int(level) for level in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be at least 1, got {text!r}")
    return levels


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


def settle() -> float:
    """Wait until the whole machine is quiet (`wait_until_quiet`), for benchmarks whose every server
    is their own; returns the seconds waited."""
    def busy() -> float:  # every core's CPU seconds but idle and iowait
        times = psutil.cpu_times()
        return sum(times) - times.idle - times.iowait

    return wait_until_quiet(busy)


ROOT = Path(__file__).parents[1]
AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"  # NVIDIA AIPerf, installed by scripts/setup.sh

# AIPerf's pure concurrency mode polls for a free slot without sleeping: its timing manager took
# 0.95 of a core for a whole c=1 run (py-spy: RequestRateStrategy.execute_phase looping through
# try_issue_credit and yield_to_event_loop), half of a 2-core machine taken from the servers it
# measures. Capped by a constant request rate far above what a server here completes, it stays a
# closed loop at the concurrency asked for (a finished request's successor waits for the next
# tick, 2.5 ms on average, against 1-2 s requests) and wakes only at each tick.
AIPERF_TICKS_PER_S = 200


def aiperf(url: str, name: str, tokenizer: Path, level: int, requests: int, out: Path, *, output_tokens: int,
           prompt_tokens: int = 0, prefix_tokens: int = 0, dataset: Path | None = None,
           ignore_eos: bool = True, greedy: bool = False) -> dict:
    """One AIPerf run of completions at concurrency `level`, streamed, counting the server's tokens:
    synthetic prompts of `prompt_tokens` (after a shared prefix of `prefix_tokens`), or the prompts
    of `dataset` (AIPerf's single_turn JSONL); sampled at the server's default temperature unless
    `greedy`. Returns output tok/s, TTFT p50 and inter-token latency p50 (ms), the mean tokens in
    and out, and the share of the machine's cores AIPerf's own processes took while it ran (on a
    small machine the client competes with the server it measures). The concurrency is held at
    `level` with AIPerf's request rate as its cap (AIPERF_TICKS_PER_S). A failed request fails the
    measurement: the statistics of the others would hide it."""
    command = [str(AIPERF), "profile", "--model", name, "--url", url, "--endpoint-type", "completions", "--streaming",
               "--concurrency", str(level), "--request-rate", str(AIPERF_TICKS_PER_S), "--arrival-pattern", "constant",
               "--request-count", str(requests), "--use-server-token-count",
               "--tokenizer", str(tokenizer), "--random-seed", "0", "--artifact-dir", str(out), "--ui-type", "none",
               "--no-server-metrics", "--no-gpu-telemetry"]
    extra = ["ignore_eos:true"] if ignore_eos else []
    extra += ["temperature:0"] if greedy else []
    if dataset is not None:
        command += ["--input-file", str(dataset), "--custom-dataset-type", "single_turn", "--dataset-sampling-strategy",
                    "sequential"]
        extra.append(f"max_tokens:{output_tokens}")
    else:
        command += ["--isl", str(prompt_tokens), "--isl-stddev", "0", "--osl", str(output_tokens), "--osl-stddev", "0"]
    if prefix_tokens:
        command += ["--num-prefix-prompts", "1", "--prefix-prompt-length", str(prefix_tokens)]
    command += ["--extra-inputs", *extra] if extra else []
    before, began = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - began
    client_cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    export = out / "profile_export_aiperf.json"
    if run.returncode != 0 or not export.is_file():
        raise RuntimeError(f"AIPerf failed against {url} at c={level}: {(run.stdout + run.stderr)[-2000:]}")
    data = json.loads(export.read_text())
    if data.get("error_request_count") or data["request_count"]["avg"] != requests:
        raise RuntimeError(f"{url} at c={level}: {json.dumps(data.get('error_summary'))[:1000]}")
    return {"output_tok_s": round(data["output_token_throughput"]["avg"], 1),
            "ttft_p50_ms": round(data["time_to_first_token"]["p50"], 2),
            "itl_p50_ms": round(data["inter_token_latency"]["p50"], 3),
            "prompt_tokens": round(data["input_sequence_length"]["avg"]),
            "output_tokens": round(data["output_sequence_length"]["avg"], 1),
            "client_cpu_share": round(client_cpu / (wall * cpu_cores()), 3)}


# The ~76M-parameter Llama shape the engine benchmarks measure (head_dim 64; LlamaConfig's arguments).
LLAMA_76M = {"vocab_size": 640, "hidden_size": 768, "intermediate_size": 2304, "num_hidden_layers": 10,
             "num_attention_heads": 12, "num_key_value_heads": 12, "max_position_embeddings": 512}


def make_76m_llama(out: Path, vocab_size: int = LLAMA_76M["vocab_size"]) -> Path:
    """A random-weights Llama of LLAMA_76M's shape with the tiny model's tokenizer; with a larger
    `vocab_size`, the rows past the tokenizer's 640 tokens are padding (as real models pad theirs)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from factory.tinymodel import ensure_tiny_model

    tiny = ensure_tiny_model()
    torch.manual_seed(0)
    config = LlamaConfig(**{**LLAMA_76M, "vocab_size": vocab_size}, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         torch_dtype="float32")
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    subprocess.run(["chmod", "-R", "a+rX", str(out)], check=True)  # the images' user reads it (a bind mount)
    return out


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
    return {"cpu_count": cpu_cores(), "cpu": cpu(), "platform": platform.platform(),
            "torch": torch.__version__, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def write_result(name: str, result: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    payload = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
               **result}
    path.write_text(json.dumps(payload, indent=2))
    return path


def vllm_cpu_preload(python: str) -> str:
    """LD_PRELOAD as vLLM's CPU install docs set it before serving from its wheel, for the
    environment of `python`: what the vllm-cpu image's runtime gives vLLM's processes."""
    from service.engine.vllm_server import cpu_preload

    prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                            check=True).stdout.strip()
    preload = cpu_preload("", Path(prefix))
    if "libtcmalloc" not in preload or "libiomp" not in preload:
        raise SystemExit(f"vLLM's CPU build is served with TCMalloc and Intel OpenMP preloaded, as its docs say; "
                         f"found only {preload or 'neither'}: install TCMalloc (Debian: apt-get install "
                         f"libtcmalloc-minimal4) and vLLM's CPU build with its intel-openmp dependency")
    return preload


class HostServer(NamedTuple):
    url: str
    ready_s: float  # seconds from start to ready
    pid: int


STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def running(process: psutil.Process) -> bool:
    """Whether `process` exists and is not stopped."""
    try:
        return process.status() not in STOPPED
    except psutil.NoSuchProcess:
        return False


@contextmanager
def paused(pids: list[int]) -> Iterator[None]:
    """The process trees of `pids` stopped (SIGSTOP) while the block runs, then continued: an idle
    server's threads still wake (an idle vLLM CPU server's do about 100 times a second each), and on
    a machine of a few cores each wake takes a core from the server being measured."""
    stopped: list[psutil.Process] = []
    for pid in pids:
        with suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            stopped += [root, *root.children(recursive=True)]
    for process in stopped:
        with suppress(psutil.NoSuchProcess):
            process.suspend()
    deadline = time.monotonic() + 5  # a signal lands when its process is next scheduled
    while time.monotonic() < deadline and any(running(process) for process in stopped):
        time.sleep(0.01)
    try:
        yield
    finally:
        for process in stopped:
            with suppress(psutil.NoSuchProcess):
                process.resume()


@contextmanager
def vllm_on_host(python: str, model: Path, served_name: str, log: Path, extra: list[str] = ()) -> Iterator[HostServer]:
    """vLLM's own OpenAI server as its documentation starts it (default configuration: torch.compile
    on, TCMalloc and Intel OpenMP preloaded), from a Python environment with vLLM's CPU build on this
    host; yields its URL, the seconds it took to be ready and its pid, and stops it afterwards."""
    from service.launcher import free_port, wait_until_ready

    port = free_port()
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", served_name, "--port", str(port), "--host", "127.0.0.1",
               "--max-model-len", "512", "--max-num-seqs", "32", *extra]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
           "LD_PRELOAD": vllm_cpu_preload(python)}
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            url, began = f"http://127.0.0.1:{port}", time.perf_counter()
            if reason := wait_until_ready(url, lambda: None if process.poll() is None else "vLLM exited", 900, "/health"):
                raise RuntimeError(f"{reason}: {log.read_text()[-2000:]}")
            yield HostServer(url, time.perf_counter() - began, process.pid)
        finally:
            process.terminate()
            process.wait(60)
