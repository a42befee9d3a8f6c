"""The torch engine in bf16 against fp32 on a CPU that computes bf16 natively (AVX512-BF16 or AMX),
in process, side by side in one run (writes results/cpu_bf16.json).

For the 76M Llama shape (random weights) and the bundled tiny model (trained), each precision's
engine decodes the same greedy requests (the tiny model's prompts, 64 tokens, ignore_eos):
- c=1: decode tokens/s (1 / the median gap between tokens) and its fraction of the memory-bandwidth
  limit (the machine's read bandwidth over the bytes a decode step reads in that precision);
- c=8: output tokens/s of 8 requests at once;
- greedy agreement of bf16 with fp32: the share of requests whose 64 tokens are the same, and the
  mean share of tokens before the first that differs.
Each precision runs twice: on the TorchScript graph, and with its decode steps compiled
(`compile_decode`, `_compiled` in the names; `--no-compile` leaves those out). Each engine runs in a
process of its own, as a server would (two engines in one process
would be two OpenMP teams, which libgomp throttles); all are loaded at once and measured in
rotation for `--rounds` rounds (medians), each once the machine is quiet. GOMP_SPINCOUNT is
taken from the environment and recorded (`serve` sets 1000 unless it is set). On a CPU without
native bf16 the engine refuses bf16 weights packing (it would emulate), so the run
writes why it was skipped instead.

    python -m benchmarks.cpu_bf16 [--models llama-76m,tiny] [--rounds 3] [--threads N] [--no-compile]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

from benchmarks.common import ROOT, make_76m_llama, settle, write_result
from benchmarks.engine_vs_vllm_cpu import decode_step_bytes, native, read_bandwidth
from factory.tinymodel import ensure_tiny_model, memorised_pairs
from service.engine.base import GenerationRequest, SamplingParams
from service.engine.torch_engine import TorchEngine

OUTPUT_TOKENS = 64
PROMPTS = 8
_ids = itertools.count()


async def stream(engine: TorchEngine, prompt: str) -> tuple[list[int], list[float]]:
    """One greedy request: its tokens and the times each step's tokens arrived."""
    ids = engine.tokenizer(prompt)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    tokens, times = [], []
    async for deltas in engine.generate(GenerationRequest(f"b{next(_ids)}", ids, params)):
        tokens += [t for d in deltas for t in d.token_ids]
        times.append(time.perf_counter())
    return tokens, times


async def measure(engine: TorchEngine, prompts: list[str]) -> dict:
    """c=1 over the prompts one by one, then c=8 over the first 8 at once."""
    gaps, outputs = [], []
    for prompt in prompts:
        tokens, times = await stream(engine, prompt)
        outputs.append(tokens)
        gaps += [b - a for a, b in zip(times, times[1:])]
    began = time.perf_counter()
    batch = await asyncio.gather(*(stream(engine, prompt) for prompt in prompts[:8]))
    wall = time.perf_counter() - began
    return {"c1_decode_tok_s": 1 / statistics.median(gaps),
            "c8_output_tok_s": sum(len(tokens) for tokens, _ in batch) / wall, "outputs": outputs}


def agreement(fp32: list[list[int]], bf16: list[list[int]]) -> dict:
    def prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    return {"identical_requests": sum(a == b for a, b in zip(fp32, bf16)) / len(fp32),
            "mean_agreeing_prefix": round(statistics.fmean(prefix(a, b) / len(a) for a, b in zip(fp32, bf16)), 3)}


def engine_process(model_dir: Path, precision: str, compiled: bool, threads: int | None, prompts: list[str],
                   conn: Connection) -> None:
    """One engine in a process of its own, as a server runs it, measuring on each request of the
    pipe. Two engines in one process are two OpenMP teams: libgomp then counts more threads than
    cores and all but stops spinning between parallel regions, which slows both."""
    async def serve() -> None:
        engine = TorchEngine(model_dir, precision=precision, max_num_seqs=8, max_model_len=512, cpu_threads=threads,
                             compile_decode=compiled)
        await engine.start()
        conn.send(engine.cpu_threads)
        try:
            while conn.recv():
                conn.send(await measure(engine, prompts))
        finally:
            await engine.shutdown()

    asyncio.run(serve())


def configs(compile_decode: bool) -> dict[str, tuple[str, bool]]:
    """name: (precision, compile_decode)."""
    plain = {"fp32": ("fp32", False), "bf16": ("bf16", False)}
    return plain | ({"fp32_compiled": ("fp32", True), "bf16_compiled": ("bf16", True)} if compile_decode else {})


def compare(model_dir: Path, rounds: int, bandwidth: float, threads: int | None, compile_decode: bool) -> dict:
    prompts = [prompt for prompt, _ in memorised_pairs()[:PROMPTS]]
    spawn = multiprocessing.get_context("spawn")
    pipes, processes = {}, []
    engines = configs(compile_decode)
    for name, (precision, compiled) in engines.items():
        pipes[name], child = spawn.Pipe()
        processes.append(spawn.Process(target=engine_process, daemon=True,
                                       args=(model_dir, precision, compiled, threads, prompts, child)))
        processes[-1].start()
    try:
        used_threads = {name: pipe.recv() for name, pipe in pipes.items()}
        runs: dict[str, list[dict]] = {name: [] for name in pipes}
        names = list(pipes)
        for turn in range(rounds + 1):  # the first round warms up, unmeasured; the order rotates
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                settle()  # the other engines' threads have stopped spinning
                pipes[name].send(True)
                result = pipes[name].recv()
                if turn:
                    runs[name].append(result)
    finally:
        for pipe in pipes.values():
            pipe.send(False)
        for process in processes:
            process.join(60)
    out: dict = {}
    for name, results in runs.items():
        rate = statistics.median(r["c1_decode_tok_s"] for r in results)
        element = 2 if engines[name][0] == "bf16" else 4
        limit = bandwidth / decode_step_bytes(model_dir, element, 8 + OUTPUT_TOKENS // 2)
        out[name] = {"c1_decode_tok_s": round(rate, 1), "c1_fraction_of_bandwidth_limit": round(rate / limit, 3),
                     "c8_output_tok_s": round(statistics.median(r["c8_output_tok_s"] for r in results), 1),
                     "threads": used_threads[name]}
    pairs = {"bf16_over_fp32": ("bf16", "fp32")}
    if compile_decode:
        pairs |= {"bf16_compiled_over_fp32_compiled": ("bf16_compiled", "fp32_compiled"),
                  "bf16_compiled_over_fp32": ("bf16_compiled", "fp32"),
                  "fp32_compiled_over_fp32": ("fp32_compiled", "fp32"),
                  "bf16_compiled_over_bf16": ("bf16_compiled", "bf16")}
    for label, (a, b) in pairs.items():
        out[label] = {key: round(out[a][key] / out[b][key], 3) for key in ("c1_decode_tok_s", "c8_output_tok_s")}
    first = {name: results[0]["outputs"] for name, results in runs.items()}
    out["greedy_agreement"] = {"bf16_with_fp32": agreement(first["fp32"], first["bf16"])}
    for precision in ("fp32", "bf16") if compile_decode else ():
        out["greedy_agreement"][f"{precision}_compiled_with_graph"] = agreement(first[precision],
                                                                                first[f"{precision}_compiled"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama-76m,tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, help="the forward pass's threads (default: the engine's, NIM_CPU_THREADS)")
    parser.add_argument("--no-compile", dest="compile_decode", action="store_false",
                        help="leave out the compiled decode step's engines")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    if reason := native("bfloat16"):
        print(f"skipped: {reason}")
        print(f"wrote {write_result('cpu_bf16', {'skipped': reason}, args.out)}")
        return
    bandwidth = read_bandwidth()
    result: dict = {"read_bandwidth_gb_s": round(bandwidth / 1e9, 2), "rounds": args.rounds,
                    "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", "libgomp's default"), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model_dir = make_76m_llama(Path(tmp) / name) if name == "llama-76m" else ensure_tiny_model()
            result["models"][name] = compare(model_dir, args.rounds, bandwidth, args.threads, args.compile_decode)
            print(name, result["models"][name], flush=True)
    print(f"wrote {write_result('cpu_bf16', result, args.out)}")


if __name__ == "__main__":
    main()
