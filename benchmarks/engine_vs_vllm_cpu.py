"""The torch engine against vLLM's CPU build at its best, side by side in one run (writes
results/engine_vs_vllm_cpu.json).

The peer is vLLM's own OpenAI server as its documentation starts it: its default configuration
(torch.compile on, prefix caching on), TCMalloc and Intel OpenMP in LD_PRELOAD ("set LD_PRELOAD" in
its CPU install docs; Debian's libtcmalloc-minimal4), from a Python that has vLLM's CPU build
(`--vllm-python`);
`vllm_eager` (`--enforce-eager`, a handicapped peer) is shown beside it, labelled, never alone.
Every server runs on this host at a loopback address, from the same weights in the same dtype; the
client is NVIDIA AIPerf (`.venv-aiperf`, installed by scripts/setup.sh), closed loop (its concurrency
held under a request-rate cap, so that it does not poll a core: benchmarks.common), ignore_eos,
server token counts:
- output tok/s, TTFT p50 and inter-token latency p50 at concurrency 1 and 8;
- a shared-prefix workload (one 480-token prefix prompt before each 8-token prompt) at
  concurrency 4, with the torch engine's prefix caching on and off, and vLLM's on;
- the machine's read bandwidth (the best of torch's sum and a reader of several streams a core,
  benchmarks/stream_read.c, over 1 GiB on 2 MB pages, every core), measured just before and just
  after each c=1 run (their mean is the run's; a run whose two differ by over 15% is run again, twice
  at most, and one that never agrees is left out of the fraction below), and the bytes a c=1 decode
  step reads (every weight but the embedding table, one row of which is gathered, and the KV cache
  at the run's mean context): their quotient bounds decode tokens/s, and each engine's c=1 decode
  rate (1 / inter-token latency) is reported as a fraction of its run's bound (and once, on 4 KB
  pages, what the pages are worth);
- the torch engine with its compiled decode step too (`torch_compiled`: a profile with
  `compile_decode`, inductor's cache cold);
- fp32, and bf16 where the CPU computes it natively (AVX512-BF16 or AMX; elsewhere the run says
  why it was skipped); with both, each engine's c=1 decode rate in bf16 over fp32, its two servers
  measured back to back in each round (`bf16_over_fp32`); on the tiny model, the torch engine at
  its default threads and at every core; on the 76M shape below SPARE_CORE_FROM cores, where the
  default takes every core, the compiled engine with one core left to the HTTP side and the client
  too (`torch_compiled_spare_core`; it starts from the inductor cache `torch_compiled` filled, so
  its start-up time is a warm one);
- the share of the machine's cores AIPerf itself took at each level (the client runs on the same
  cores as the server it measures);
- the KV memory the torch engine holds for 32 sequences of 64 tokens at max_model_len 512.

All configurations run at once, each paused (SIGSTOP, its whole process tree) while another is
measured (an idle server's threads still wake: beside an idle vLLM server a torch c=1 run took
8.4-9.4 ms a token, alone 5.9-7.5), for `--rounds` rounds; in each round every level measures them
back to back, in a balanced order (benchmarks.common.round_order), each once the machine is quiet
(vLLM's OpenMP threads spin after its last request). Values are medians over rounds; ratios
the median and quartiles of the per-round paired ratios.

    python -m benchmarks.engine_vs_vllm_cpu --vllm-python VENV/bin/python [--models llama-76m,tiny]
                                            [--dtypes float32,bfloat16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import functools
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

from benchmarks.common import (AIPERF, ROOT, HostServer, aiperf, make_76m_llama, paused, round_order, settle,
                               spread, vllm_cpu_preload, vllm_on_host, write_result)
from factory.tinymodel import ensure_tiny_model
from service.launcher import ServerProcess
from service.manifest import Manifest, ModelInfo, Profile, ProfileTags
from service.profiles import CPU_PRECISION_FLAGS, SPARE_CORE_FROM, cpu_computes, cpu_cores

NAME = "tiny-llama"  # the served name on every server
LEVELS = (1, 8)
PREFIX_LEVEL = 4
PREFIX_TOKENS = 480
PROMPT_TOKENS, OUTPUT_TOKENS = 32, 64
PRECISIONS = {"float32": "fp32", "bfloat16": "bf16"}


def read_bandwidth(gib: int = 1, tries: int = 7, huge: bool = True) -> float:
    """Bytes per second the machine's memory gives up to a reader on every core: the best of `tries`
    torch sums of a tensor far larger than the caches and of benchmarks/stream_read.c's readers
    (several streams a core, which read faster than torch's sum), on 2 MB pages as the engine's
    weights are where Linux offers them (`huge` False: on 4 KB pages). What a decode step that reads
    every weight can approach."""
    import torch

    from service.engine import huge_pages

    torch.set_num_threads(cpu_cores())
    data = huge_pages.empty((gib * 2**28,), torch.float32).fill_(1) if huge else torch.ones(gib * 2**28)
    best = float("inf")
    for _ in range(tries):
        began = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - began)
    summed = data.numel() * data.element_size() / best
    del data
    return max([summed, *stream_reads(gib, tries, huge).values()])


def stream_reads(gib: int, tries: int, huge: bool) -> dict[int, float]:
    """Bytes per second by streams a core, from benchmarks/stream_read.c compiled here and run in a
    process of its own; empty (with a warning) where no C compiler is at hand."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn("no C compiler: the read bandwidth is torch's sum alone")
        return {}
    out = subprocess.run([str(reader(compiler)), str(gib), str(tries), *([] if huge else ["4k"])], check=True,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(cpu_cores())})
    return {int(streams): float(rate) for streams, rate in (line.split() for line in out.stdout.splitlines())}


@functools.cache
def reader(compiler: str) -> Path:
    """benchmarks/stream_read.c compiled once a process, so that a reading is as short as it can be:
    the closer the readings are to the run they bracket, the likelier they see the run's own state."""
    program = Path(tempfile.mkdtemp(prefix="stream_read-")) / "stream_read"
    atexit.register(shutil.rmtree, program.parent, True)
    subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", str(Path(__file__).with_name("stream_read.c")),
                    "-o", str(program)], check=True, capture_output=True)
    return program


def decode_step_bytes(model_dir: Path, element_size: int, context: int) -> int:
    """Bytes one c=1 decode step reads: every weight, in the run's dtype, but the embedding table (a
    row is gathered; a table tied to the LM head is read once, as the head), and the KV cache of
    `context` positions."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    shapes = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as weights:
            shapes |= {name: weights.get_slice(name).get_shape() for name in weights.keys()}
    count = sum(math.prod(shape) for name, shape in shapes.items() if not name.endswith("embed_tokens.weight"))
    if "lm_head.weight" not in shapes:  # tied: the head is the embedding table
        count += math.prod(next(shape for name, shape in shapes.items() if name.endswith("embed_tokens.weight")))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv = 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    return (count + kv * context) * element_size


def bandwidth_limit(result: dict, model_dir: Path, dtype: str) -> dict:
    """Each engine's c=1 decode rate as a fraction of what the memory allows, run by run against the
    mean of the read bandwidth measured just before and just after that run (this VM's memory moves
    between states of about 35 and 65 GB/s within seconds to minutes; a reading on one side alone
    can land in another state than the run); medians over rounds. `state_changed`: the runs whose
    two readings still differ by over STATE_CHANGE after STATE_RETRIES (run_alone): their limit is
    not known, and the fraction is the median over the others (`runs_of_a_known_state`), over
    every run where none is left (`fraction_of_limit_every_run` gives it for every run anyway)."""
    element = 4 if dtype == "float32" else 2
    step = decode_step_bytes(model_dir, element, PROMPT_TOKENS + OUTPUT_TOKENS // 2)
    runs = result["rounds"]["levels"]
    c1 = [run for by_level in runs.values() for run in by_level[1]]
    bandwidths = [run["read_bandwidth"] for run in c1]
    out = {"read_bandwidth_gb_s": spread([b / 1e9 for b in bandwidths]), "decode_step_mb": round(step / 1e6, 1),
           "limit_tok_s": round(statistics.median(bandwidths) / step, 1),
           "state_changed": sum(changed(run) for run in c1), "c1_runs": len(c1),
           "state_retries": sum(run.get("state_retries", 0) for run in c1)}
    for name, by_level in runs.items():
        known = [run for run in by_level[1] if not changed(run)]
        out[name] = {"decode_tok_s": round(1000 / result["levels"][name][1]["itl_p50_ms"], 1),
                     "fraction_of_limit": spread([share_of_limit(run, step) for run in known or by_level[1]]),
                     "runs_of_a_known_state": len(known),
                     "fraction_of_limit_every_run": spread([share_of_limit(run, step) for run in by_level[1]])}
    return out


def share_of_limit(run: dict, step_bytes: int) -> float:
    """A c=1 run's decode rate over what its memory allows (the mean of its two readings)."""
    return 1000 / run["itl_p50_ms"] / (run["read_bandwidth"] / step_bytes)


STATE_CHANGE = 0.15  # readings on the two sides of a run this far apart: the memory's state changed
STATE_RETRIES = 2  # times a c=1 run is run again while its readings disagree (run_alone)


def changed(run: dict) -> bool:
    """Whether the readings before and after a c=1 run differ by over STATE_CHANGE."""
    low, high = sorted((run["read_bandwidth_before"], run["read_bandwidth_after"]))
    return high > low * (1 + STATE_CHANGE)


def manifest_file(model_dir: Path, path: Path, precision: str, **engine_args) -> Path:
    """A manifest with one torch CPU profile of `precision` and `engine_args`."""
    tags = ProfileTags(engine="torch", precision=precision, gpu="cpu", profile="latency")
    manifest = Manifest(model=ModelInfo(name=NAME, source=f"local://{model_dir.resolve()}"),
                        profiles=[Profile(tags=tags, engine_args={"max_num_seqs": 32, **engine_args})])
    path.write_text(json.dumps(manifest.model_dump(mode="json", exclude_none=True)))
    return path


def servers(stack: contextlib.ExitStack, vllm_python: str, model_dir: Path, dtype: str, tiny: bool,
            work: Path) -> dict[str, HostServer]:
    """Every configuration of one model and dtype, started: their URLs, seconds to ready and pids."""
    precision = PRECISIONS[dtype]
    plain = torch_args(model_dir, precision, work / "manifest.json")
    torch_configs = {"torch": ({}, plain), "torch_no_prefix_cache": ({"NIM_ENABLE_KV_CACHE_REUSE": "0"}, plain)}
    if tiny:  # the tiny model's default leaves one core to HTTP; the 76M model's takes all below SPARE_CORE_FROM
        torch_configs["torch_all_cores"] = ({"NIM_CPU_THREADS": str(cpu_cores())}, plain)
    # the compiled decode step (service.engine.compiled_decode), its cache cold
    compiled = torch_args(model_dir, precision, work / "compiled.json", compile_decode=True)
    torch_configs["torch_compiled"] = ({"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}, compiled)
    if not tiny and cpu_cores() < SPARE_CORE_FROM:  # where the default takes every core: one left to the rest
        torch_configs["torch_compiled_spare_core"] = ({"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
                                                       "NIM_CPU_THREADS": str(max(1, cpu_cores() - 1))}, compiled)
    started = {name: torch_on_host(stack, args, env, work / f"{name}.log")
               for name, (env, args) in torch_configs.items()}
    for name, extra in {"vllm": [], "vllm_eager": ["--enforce-eager"]}.items():
        started[name] = stack.enter_context(
            vllm_on_host(vllm_python, model_dir, NAME, work / f"{name}.log", ["--dtype", dtype, *extra]))
    return started


def torch_on_host(stack: contextlib.ExitStack, args: list[str], env: dict[str, str], log_path: Path) -> HostServer:
    """The runtime (`python -m service serve`) on this host, stopped when `stack` closes."""
    began = time.perf_counter()
    server = stack.enter_context(ServerProcess(args, env=env, log_path=log_path, timeout=900))
    return HostServer(server.url, time.perf_counter() - began, server.proc.pid)


def torch_args(model_dir: Path, precision: str, manifest: Path, **engine_args) -> list[str]:
    """The runtime's arguments for the model in `precision`: fp32 with no engine arguments is its own
    default manifest; anything else one profile written to `manifest`."""
    args = ["--model", str(model_dir), "--served-model-name", NAME, "--max-model-len", "512"]
    if precision == "fp32" and not engine_args:
        return args
    return [*args, "--manifest", str(manifest_file(model_dir, manifest, precision, **engine_args))]


def run_alone(started: dict[str, HostServer], name: str, level: int, model_dir: Path, work: Path,
              **load) -> dict:
    """One AIPerf run against `name`, every other server paused and the machine quiet first; a c=1
    run has the read bandwidth measured on both sides (its limit is their mean), and is run again,
    at most STATE_RETRIES times, while the two differ by over STATE_CHANGE (the memory changed
    state around it, so its limit is not known): the last run is kept, with its retries counted."""
    requests = load.pop("requests", 4 * max(level, 2))
    load = {"prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, **load}
    with paused([server.pid for other, server in started.items() if other != name]):
        waited = settle()
        if level != 1:
            return aiperf(started[name].url, NAME, model_dir, level, requests, work, **load) | {"settle_s": waited}
        for retry in range(STATE_RETRIES + 1):
            before = read_bandwidth(tries=3)
            run = aiperf(started[name].url, NAME, model_dir, level, requests, work / f"try{retry}", **load)
            after = read_bandwidth(tries=3)
            run |= {"settle_s": waited, "read_bandwidth_before": before, "read_bandwidth_after": after,
                    "read_bandwidth": (before + after) / 2, "state_retries": retry}
            if not changed(run):
                break
        return run


def compare(vllm_python: str, model_dir: Path, dtype: str, tiny: bool, rounds: int, work: Path) -> dict:
    """Every configuration running at once, idle while another is measured: in each round each level
    measures them one after another (within a minute), so a pair shares the machine's state (this
    VM's CPU steal drifts over minutes); each ratio is the median over rounds of the paired ratios."""
    runs, waits = itertools.count(), []

    def measured(name: str, level: int, **load) -> dict:
        run = run_alone(started, name, level, model_dir, work / f"run{next(runs)}", **load)
        waits.append(run.pop("settle_s"))
        return run

    with contextlib.ExitStack() as stack:
        started = servers(stack, vllm_python, model_dir, dtype, tiny, work)
        plain = [name for name in started if name != "torch_no_prefix_cache"]
        prefix_engines = ["torch", "torch_no_prefix_cache", "vllm"]
        for name in started:  # warm-up, unmeasured: batch shapes, compiled graphs, first-call costs
            measured(name, max(LEVELS))
        levels = {name: {level: [] for level in LEVELS} for name in plain}
        shared: dict[str, list[dict]] = {name: [] for name in prefix_engines}
        for turn in range(rounds):
            for level in LEVELS:
                for name in round_order(plain, turn):
                    levels[name][level].append(measured(name, level))
            for name in round_order(prefix_engines, turn):
                shared[name].append(measured(name, PREFIX_LEVEL, requests=32, prompt_tokens=8, output_tokens=16,
                                             prefix_tokens=PREFIX_TOKENS))
    engines = [name for name in plain if name != "vllm"]
    return {"dtype": dtype, "start_to_ready_s": {name: round(server.ready_s, 1) for name, server in started.items()},
            "settle_s": {"median": round(statistics.median(waits), 2), "max": round(max(waits), 2)},
            "levels": {name: medians(runs) for name, runs in levels.items()},
            "shared_prefix_c4": {name: medians({PREFIX_LEVEL: runs})[PREFIX_LEVEL] for name, runs in shared.items()},
            "ratios": {**{f"tok_s_{name}_over_vllm": paired(levels[name], levels["vllm"], "output_tok_s")
                          for name in engines},
                       **{f"ttft_p50_{name}_over_vllm": paired(levels[name], levels["vllm"], "ttft_p50_ms")
                          for name in engines},
                       **{f"itl_p50_{name}_over_vllm": paired(levels[name], levels["vllm"], "itl_p50_ms")
                          for name in engines if name.startswith("torch")},
                       "shared_prefix_ttft_p50_cached_over_uncached":
                           spread([a["ttft_p50_ms"] / b["ttft_p50_ms"]
                                   for a, b in zip(shared["torch"], shared["torch_no_prefix_cache"])]),
                       "shared_prefix_ttft_p50_torch_over_vllm":
                           spread([a["ttft_p50_ms"] / b["ttft_p50_ms"] for a, b in zip(shared["torch"], shared["vllm"])])},
            "rounds": {"levels": levels, "shared_prefix_c4": shared}}


def medians(runs: dict[int, list[dict]]) -> dict:
    return {level: {key: statistics.median(run[key] for run in rs) for key in rs[0]} for level, rs in runs.items()}


def paired(a: dict[int, list[dict]], b: dict[int, list[dict]], key: str) -> dict:
    """Per level, the spread over rounds of a/b, each round's pair measured back to back."""
    return {level: spread([x[key] / y[key] for x, y in zip(a[level], b[level])]) for level in a}


def kv_memory() -> dict:
    """In process: blocks held by 32 sequences of 64 tokens, against 32 slots of 512 tokens."""
    from service.engine.base import GenerationRequest, SamplingParams
    from service.engine.torch_engine import BLOCK_SIZE, TorchEngine

    async def held() -> dict:
        engine = TorchEngine(ensure_tiny_model(), max_num_seqs=32, max_model_len=512)
        await engine.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
            streams = [engine.generate(GenerationRequest(f"m{i}", [1] + [10 + i] * 31, params)) for i in range(32)]
            peak = 0
            for stream in streams:  # drain them in turn: all 32 run together until they end
                async for _ in stream:
                    peak = max(peak, engine.pool.num_used)
            per_token = engine.runner.bytes_per_block // BLOCK_SIZE
            return {"peak_blocks": peak, "held_bytes": peak * engine.runner.bytes_per_block,
                    "per_slot_reservation_bytes": 32 * 512 * per_token,
                    "ratio": round(peak * BLOCK_SIZE / (32 * 512), 3), "target": "<= 0.25"}
        finally:
            await engine.shutdown()

    return asyncio.run(held())


def table(name: str, run: dict) -> str:
    """The medians over rounds, and the median [quartiles] of the paired ratios."""
    def ratio(spread: dict) -> str:
        return f"{spread['median']:.2f} [{spread['q1']:.2f}, {spread['q3']:.2f}]"

    if "skipped" in run:
        return f"{name}: skipped: {run['skipped']}"
    levels, ratios, limit = run["levels"], run["ratios"], run["bandwidth"]
    lines = [f"{name} ({run['dtype']}); vllm = vLLM's default configuration (torch.compile on), vllm_eager = "
             f"--enforce-eager (handicapped, for reference)",
             "config  c  tok/s  TTFT p50 ms  ITL p50 ms  tok/s over vllm  TTFT over vllm"]
    for config, by_level in levels.items():
        for level in LEVELS:
            run_ = by_level[level]
            versus = (f"{ratio(ratios[f'tok_s_{config}_over_vllm'][level])}  "
                      f"{ratio(ratios[f'ttft_p50_{config}_over_vllm'][level])}") if config != "vllm" else "-  -"
            lines.append(f"{config}  {level}  {run_['output_tok_s']:.1f}  {run_['ttft_p50_ms']:.1f}  "
                         f"{run_['itl_p50_ms']:.2f}  {versus}")
    lines.append("AIPerf's own share of the cores, c=" + ", c=".join(
        f"{level}: {statistics.median(by_level[level]['client_cpu_share'] for by_level in levels.values()):.0%}"
        for level in LEVELS))
    shared = run["shared_prefix_c4"]
    lines.append(f"shared {PREFIX_TOKENS}-token prefix, c={PREFIX_LEVEL}: TTFT p50 torch {shared['torch']['ttft_p50_ms']:.1f} "
                 f"ms, no prefix cache {shared['torch_no_prefix_cache']['ttft_p50_ms']:.1f} ms, vllm "
                 f"{shared['vllm']['ttft_p50_ms']:.1f} ms; torch/vllm "
                 f"{ratio(ratios['shared_prefix_ttft_p50_torch_over_vllm'])}")
    lines.append(f"read bandwidth {limit['read_bandwidth_gb_s']['median']:.1f} GB/s (the mean of readings before and "
                 f"after each c=1 run, {limit['read_bandwidth_gb_s']['q1']:.1f}-{limit['read_bandwidth_gb_s']['q3']:.1f}; "
                 f"the state changed across {limit['state_changed']} of {limit['c1_runs']} runs after "
                 f"{limit['state_retries']} retries), {limit['decode_step_mb']} MB a c=1 decode step: limit "
                 f"{limit['limit_tok_s']} tok/s; share of each run's limit, runs of a known state (every run): " +
                 ", ".join(f"{config} {limit[config]['decode_tok_s']} tok/s ({ratio(limit[config]['fraction_of_limit'])}"
                           f" of {limit[config]['runs_of_a_known_state']}; "
                           f"{ratio(limit[config]['fraction_of_limit_every_run'])})" for config in levels))
    return "\n".join(lines)


def native(dtype: str) -> str | None:
    """None where the CPU computes `dtype` natively, else why not."""
    precision = PRECISIONS[dtype]
    if cpu_computes(precision):
        return None
    return f"this CPU lacks {' and '.join(CPU_PRECISION_FLAGS[precision])}: {precision} is not native here"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", required=True, help="a Python with vLLM's CPU build (the peer)")
    parser.add_argument("--models", default="llama-76m,tiny")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    names, dtypes = args.models.split(","), args.dtypes.split(",")
    if unknown := set(names) - {"tiny", "llama-76m"}:
        parser.error(f"unknown model(s) {', '.join(sorted(unknown))}: choose from tiny, llama-76m")
    if unknown := set(dtypes) - set(PRECISIONS):
        parser.error(f"unknown dtype(s) {', '.join(sorted(unknown))}: choose from {', '.join(PRECISIONS)}")
    if not AIPERF.is_file():
        parser.error(f"{AIPERF.relative_to(ROOT)} is missing: run scripts/setup.sh")
    version = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    result: dict = {"rounds": args.rounds, "vllm": version,
                    "peer": "vLLM's own server, default configuration (torch.compile on, prefix caching on), "
                            "TCMalloc and Intel OpenMP preloaded as its CPU install docs say; "
                            "vllm_eager: --enforce-eager, shown beside it",
                    "peer_ld_preload": vllm_cpu_preload(args.vllm_python),
                    "workload": {"prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "client": "AIPerf"},
                    "targets_76m": {"fp32 c=1 decode fraction_of_limit": ">= 0.8", "bf16 over fp32 c=1 decode": ">= 1.6",
                                    "c=8 tok/s torch over vllm": ">= 1.3", "c=1 TTFT p50 torch over vllm": "<= 0.8",
                                    "shared prefix TTFT p50 torch over vllm": "<= 0.3"},
                    "kv_memory_32x64_at_512": kv_memory(),
                    "read_bandwidth_gb_s_on_4kb_pages": round(read_bandwidth(huge=False) / 1e9, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model_dir = make_76m_llama(Path(tmp) / name) if name == "llama-76m" else ensure_tiny_model()
            for dtype in dtypes:
                key = f"{name}_{PRECISIONS[dtype]}"
                if reason := native(dtype):
                    result[key] = {"skipped": reason}
                else:
                    work = Path(tmp) / key
                    work.mkdir()
                    result[key] = compare(args.vllm_python, model_dir, dtype, name == "tiny", args.rounds, work)
                    result[key]["bandwidth"] = bandwidth_limit(result[key], model_dir, dtype)
                print(table(key, result[key]), flush=True)
                path = write_result("engine_vs_vllm_cpu", result, args.out)
            if set(PRECISIONS) <= set(dtypes) and native("bfloat16") is None:
                work = Path(tmp) / f"{name}_bf16_over_fp32"
                work.mkdir()
                over = bf16_over_fp32(args.vllm_python, model_dir, args.rounds, work)
                result[f"{name}_bf16_over_fp32_c1_decode"] = over
                print(f"{name} bf16 over fp32, c=1 decode tok/s, paired: " + ", ".join(
                    f"{engine} {r['median']:.2f} [{r['q1']:.2f}, {r['q3']:.2f}]" for engine, r in over["ratio"].items()))
                path = write_result("engine_vs_vllm_cpu", result, args.out)
    print(path)


def bf16_over_fp32(vllm_python: str, model_dir: Path, rounds: int, work: Path) -> dict:
    """Each engine's c=1 decode rate in bf16 over fp32 (inter-token p50 of fp32 over bf16), paired: an
    engine's two servers run at once and are measured back to back in every round (the rest paused),
    so that a pair shares the memory's state; the dtypes' own runs above are minutes apart."""
    runs = itertools.count()
    with contextlib.ExitStack() as stack:
        started = {}
        for dtype, precision in PRECISIONS.items():
            args = torch_args(model_dir, precision, work / f"{precision}.json")
            started[f"torch_{precision}"] = torch_on_host(stack, args, {}, work / f"torch_{precision}.log")
            started[f"vllm_{precision}"] = stack.enter_context(
                vllm_on_host(vllm_python, model_dir, NAME, work / f"vllm_{precision}.log", ["--dtype", dtype]))
        for name in started:  # warm-up, unmeasured
            run_alone(started, name, max(LEVELS), model_dir, work / f"run{next(runs)}")
        c1: dict[str, list[dict]] = {name: [] for name in started}
        for turn in range(rounds):
            for engine in round_order(["torch", "vllm"], turn):
                for precision in round_order(list(PRECISIONS.values()), turn):
                    c1[f"{engine}_{precision}"].append(run_alone(started, f"{engine}_{precision}", 1, model_dir,
                                                                 work / f"run{next(runs)}"))
    return {"ratio": {engine: spread([fp32["itl_p50_ms"] / bf16["itl_p50_ms"]
                                      for fp32, bf16 in zip(c1[f"{engine}_fp32"], c1[f"{engine}_bf16"])])
                      for engine in ("torch", "vllm")},
            "paired": "each round's fp32 and bf16 runs of an engine back to back", "rounds": c1}


if __name__ == "__main__":
    main()
