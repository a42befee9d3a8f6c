"""A sampled token's cost in the torch engine: drawn in one call (cpu_sampling.cpp) against the aten
ops that draw it elsewhere (sampling.probabilities and draw), side by side in one process.

Two measures, each alternating the two ways round by round:
- the draw alone (`sample_token`, temperature 1), hot in a loop and just after a weights-sized read
  of memory, which empties the caches as a decode step's forward does;
- the engine's decode step (`TorchEngine._step`, its median over requests of 32 tokens in and 64
  out at temperature 1, as AIPerf sends them) at c=1, 8 and 32, on the 76M shape with the tiny
  model's vocabulary (640 tokens) and padded to 32000 and 128256 rows (Llama 2's and Llama 3's widths).

Writes results/sampling.json: medians, and the median and range of the per-round ratios (native
over aten). vLLM's sampler is not beside it: it runs inside vLLM's own step, which
benchmarks.engine_vs_vllm_cpu measures whole.

    python -m benchmarks.sampling [--rounds 6] [--vocabularies 640,32000,128256] [--concurrency 1,8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import make_76m_llama, write_result
from service.engine import sampling
from service.engine.base import GenerationRequest, SamplingParams
from service.engine.torch_engine import TorchEngine

WAYS = ("native", "aten")
STREAM_BYTES = 300_000_000  # about a 76M fp32 decode step's weights


NATIVE = sampling.native_draw


def way(name: str) -> None:
    """Draw the native way or the aten way from here on (the aten way is the one GPUs take)."""
    sampling.native_draw = NATIVE if name == "native" else (lambda device: False)


def ratio_summary(native: list[float], aten: list[float], unit: float) -> dict:
    ratios = [n / a for n, a in zip(native, aten)]
    return {"native": round(statistics.median(native) * unit, 2), "aten": round(statistics.median(aten) * unit, 2),
            "native_over_aten": round(statistics.median(ratios), 3),
            "range": [round(min(ratios), 3), round(max(ratios), 3)]}


def draw_alone(vocab: int, rounds: int, repeats: int = 40) -> dict:
    """Microseconds a draw, hot and cold, per way."""
    stream = torch.empty(STREAM_BYTES // 4).normal_()
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    params = SamplingParams(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    times = {(w, state): [] for w in WAYS for state in ("hot", "cold")}
    for round_ in range(rounds):
        for name in WAYS if round_ % 2 == 0 else WAYS[::-1]:
            way(name)
            for _ in range(5):
                sampling.sample_token(logits, params, generator)
            hot, cold = [], []
            for _ in range(repeats):
                began = time.perf_counter()
                sampling.sample_token(logits, params, generator)
                hot.append(time.perf_counter() - began)
                stream.sum()
                began = time.perf_counter()
                sampling.sample_token(logits, params, generator)
                cold.append(time.perf_counter() - began)
            times[name, "hot"].append(statistics.median(hot))
            times[name, "cold"].append(statistics.median(cold))
    way("native")
    return {state: ratio_summary(times["native", state], times["aten", state], 1e6) for state in ("hot", "cold")}


async def engine_steps(model_dir: Path, concurrency: list[int], rounds: int) -> dict:
    """Milliseconds a decode step at each concurrency, per way."""
    steps: list[float] = []
    timed_step = TorchEngine._step

    def step(self) -> None:
        began = time.perf_counter()
        try:
            timed_step(self)
        finally:
            steps.append(time.perf_counter() - began)

    engine = TorchEngine(model_dir, precision="fp32", max_model_len=512)
    engine._step = step.__get__(engine)
    await engine.start()
    count = iter(range(10**9))

    async def one(params: SamplingParams) -> None:
        first = next(count) % 7
        request = GenerationRequest(f"r{first}-{time.monotonic_ns()}", list(range(3 + first, 35 + first)), params)
        async for _ in engine.generate(request):
            pass

    params = SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True)
    out = {}
    try:
        await asyncio.gather(*(one(params) for _ in range(max(concurrency))))  # warm
        for c in concurrency:
            times: dict[str, list[float]] = {w: [] for w in WAYS}
            for round_ in range(rounds):
                for name in WAYS if round_ % 2 == 0 else WAYS[::-1]:
                    way(name)
                    steps.clear()
                    await asyncio.gather(*(one(params) for _ in range(c)))
                    times[name].append(statistics.median(steps[4:]))
            out[f"c{c}"] = ratio_summary(times["native"], times["aten"], 1e3)
            print(f"  c={c}: step {out[f'c{c}']}", flush=True)
    finally:
        way("native")
        await engine.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--vocabularies", default="640,32000,128256")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    if not sampling.native_draw(torch.device("cpu")):
        raise SystemExit("the native draw does not run here (x86 with AVX2 and FMA, the kernel library loaded)")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in map(int, args.vocabularies.split(",")):
            print(f"vocabulary {vocab}", flush=True)
            draw = draw_alone(vocab, args.rounds)
            print(f"  the draw alone, us: {draw}", flush=True)
            model_dir = make_76m_llama(Path(tmp) / f"llama-76m-{vocab}", vocab_size=vocab)
            results[str(vocab)] = {"draw_us": draw, "step_ms": asyncio.run(engine_steps(model_dir, concurrency,
                                                                                          args.rounds))}
    result = {"shape": "llama-76m, fp32, 32 tokens in and 64 out at temperature 1", "rounds": args.rounds,
              "vocabularies": results}
    print(write_result("sampling", result, args.out))


if __name__ == "__main__":
    main()
