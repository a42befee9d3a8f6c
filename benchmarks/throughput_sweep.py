"""Throughput sweep: our continuous-batching engine against plain transformers `generate()`.

In one process run, one system after the other, with a fixed prompt length and a fixed output
length (end-of-sequence ignored), at concurrency 1, 4, 16 and 64 closed-loop clients:
  (a) engine   - our torch engine (continuous batching), requests submitted concurrently;
  (b) sequential - `generate()` one request at a time, in arrival order;
  (c) static   - `generate()` on batches of `concurrency` requests (padding batches).
For (b) and (c) every token is timed by a streamer, and the clients' arrival times follow from the
completion times exactly as closed-loop clients of a FIFO server would see them.
Each level runs the three systems back to back, for `--rounds` rounds, and reports the median
round, so a drift in the machine's speed does not favour one system.
Writes results/throughput_sweep.json and prints tokens/s, TTFT and ITL percentiles per level.

    python -m benchmarks.throughput_sweep [--device cuda --precision bf16]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from benchmarks.common import concurrency_levels, percentile, write_result
from factory.tinymodel import corpus_lines, ensure_tiny_model
from service.engine.base import GenerationRequest, SamplingParams
from service.engine.torch_engine import DTYPES, TorchEngine

LEVELS = (1, 4, 16, 64)


@dataclass
class Timing:
    arrival: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def summarize(timings: list[Timing], wall: float) -> dict:
    tokens = sum(len(t.token_times) for t in timings)
    ttft = [t.ttft for t in timings]
    itl = [gap for t in timings for gap in t.itls]
    return {
        "requests": len(timings), "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
        "ttft_ms": {q: percentile(ttft, int(q[1:])) * 1000 for q in ("p50", "p90", "p99")},
        "itl_ms": {q: percentile(itl, int(q[1:])) * 1000 for q in ("p50", "p90", "p99")},
    }


def requests_for(level: int) -> int:
    return max(16, 2 * level)


# -- (a) our engine ---------------------------------------------------------------------------
async def engine_level(engine: TorchEngine, prompt: list[int], out_len: int, level: int) -> dict:
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    remaining = requests_for(level)
    timings: list[Timing] = []

    async def client() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            timing = Timing(time.perf_counter())
            async for deltas in engine.generate(GenerationRequest(uuid.uuid4().hex, prompt, params)):
                now = time.perf_counter()
                timing.token_times += [now] * sum(len(d.token_ids) for d in deltas)
            timings.append(timing)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(level)))
    return summarize(timings, time.perf_counter() - start)


# -- (b) and (c): transformers generate() -------------------------------------------------------
class TokenClock(BaseStreamer):
    """Records when each generation step's tokens come out (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def generate_batch(model, prompt: list[int], batch: int, out_len: int) -> list[float]:
    ids = torch.tensor([prompt] * batch, device=model.device)
    clock = TokenClock()
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                   min_new_tokens=out_len, do_sample=False, streamer=clock)
    return clock.times


def generate_level(model, prompt: list[int], out_len: int, level: int, batch: int) -> dict:
    """Closed-loop clients of a FIFO server running `generate()` on `batch` requests at a time."""
    total = requests_for(level)
    start = time.perf_counter()
    arrivals = [start] * level  # the first `level` requests arrive at once
    timings: list[Timing] = []
    while len(timings) < total:
        size = min(batch, total - len(timings))
        group = [Timing(arrivals.pop(0)) for _ in range(size)]
        times = generate_batch(model, prompt, size, out_len)
        for timing in group:
            timing.token_times = times
            arrivals.append(times[-1])  # the client sends its next request on the answer
        timings += group
        arrivals.sort()
    return summarize(timings, time.perf_counter() - start)


def median_run(runs: list[dict]) -> dict:
    """The run with the median output throughput, and the spread of all runs."""
    ordered = sorted(runs, key=lambda r: r["output_tokens_per_s"])
    return {**ordered[len(ordered) // 2], "rounds_tokens_per_s": [r["output_tokens_per_s"] for r in runs]}


async def sweep(model_dir: Path, prompt: list[int], out_len: int, device: str, precision: str, rounds: int,
                levels: tuple[int, ...]) -> dict:
    """Every level runs all three systems back to back, for several rounds, so that drifts in the
    machine's speed hit all three alike; each result is the median round."""
    engine = TorchEngine(model_dir, device=device, precision=precision, max_num_seqs=max(levels))
    await engine.start()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[precision]).to(device).eval()
    await engine_level(engine, prompt, out_len, 4)  # warm-up
    # generate() runs one untimed batch of each shape first: on a GPU its first run of a shape
    # builds cuDNN's attention graphs, 10-20x the step time (README, the GPU image)
    for batch in sorted({1, *levels}):
        generate_batch(model, prompt, batch, out_len)
    runs: dict[str, dict[int, list[dict]]] = {name: {level: [] for level in levels}
                                              for name in ("engine", "sequential", "static")}
    for _ in range(rounds):
        for level in levels:
            runs["engine"][level].append(await engine_level(engine, prompt, out_len, level))
            with torch.inference_mode():
                runs["sequential"][level].append(generate_level(model, prompt, out_len, level, batch=1))
                runs["static"][level].append(generate_level(model, prompt, out_len, level, batch=level))
    await engine.shutdown()
    return {name: {level: median_run(r) for level, r in levels.items()} for name, levels in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=3, help="repeat the sweep; report the median round")
    parser.add_argument("--levels", type=concurrency_levels, default=",".join(map(str, LEVELS)),
                        help="concurrency levels, comma-separated (sequential generate() at 64 takes minutes)")
    parser.add_argument("--model", type=Path, help="a Hugging Face model directory; default: the tiny model")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    model_dir = args.model or ensure_tiny_model()
    from transformers import AutoTokenizer

    text_ids = AutoTokenizer.from_pretrained(model_dir)(" ".join(corpus_lines()[:8]))["input_ids"]
    prompt = (text_ids * (args.prompt_tokens // len(text_ids) + 1))[: args.prompt_tokens]

    systems = asyncio.run(sweep(model_dir, prompt, args.output_tokens, args.device, args.precision, args.rounds,
                                args.levels))
    engine = systems["engine"]
    baselines = systems
    levels = {}
    print(f"{'conc':>4} {'system':>10} {'tok/s':>9} {'ttft p50':>9} {'ttft p99':>9} {'itl p50':>8} {'itl p99':>8}")
    for level in args.levels:
        row = {name: results[level] for name, results in systems.items()}
        row["engine_over_sequential_tokens_per_s"] = (engine[level]["output_tokens_per_s"]
                                                      / baselines["sequential"][level]["output_tokens_per_s"])
        row["engine_over_static_tokens_per_s"] = (engine[level]["output_tokens_per_s"]
                                                  / baselines["static"][level]["output_tokens_per_s"])
        row["engine_itl_p50_over_sequential"] = (engine[level]["itl_ms"]["p50"]
                                                 / baselines["sequential"][level]["itl_ms"]["p50"])
        levels[f"concurrency_{level}"] = row
        for name, result in systems.items():
            r = result[level]
            print(f"{level:>4} {name:>10} {r['output_tokens_per_s']:>9.1f} {r['ttft_ms']['p50']:>9.1f}"
                  f" {r['ttft_ms']['p99']:>9.1f} {r['itl_ms']['p50']:>8.2f} {r['itl_ms']['p99']:>8.2f}")
        print(f"     engine/sequential {row['engine_over_sequential_tokens_per_s']:.2f}x tokens/s, "
              f"engine/static {row['engine_over_static_tokens_per_s']:.2f}x, "
              f"ITL p50 ratio {row['engine_itl_p50_over_sequential']:.2f}")
    settings = {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "device": args.device,
                "precision": args.precision, "model": str(model_dir.name), "levels": list(args.levels),
                "rounds": args.rounds}
    print(write_result("throughput_sweep", {"settings": settings, "levels": levels}, args.out))


if __name__ == "__main__":
    main()
