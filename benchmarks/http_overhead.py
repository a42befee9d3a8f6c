"""What the HTTP layer costs: the same requests through the engine directly and through the server.

Both run in one invocation, one after the other (never at once: they would share the CPU), with
the same prompt, greedy decoding and a fixed output length. Writes results/http_overhead.json.

    python -m benchmarks.http_overhead [--requests 64] [--max-tokens 16] [--levels 1,16]
                                       [--device cuda --precision bf16]

On a GPU machine the server picks its profile itself (the GPU profile of a plain directory, through
NVML); `--device` and `--precision` set the direct engine's, and the JSON records the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from pathlib import Path

import httpx

from benchmarks.common import concurrency_levels, summarize, write_result
from factory.tinymodel import ensure_tiny_model
from service.engine.base import GenerationRequest, SamplingParams
from service.engine.torch_engine import DTYPES, TorchEngine
from service.launcher import ServerProcess

PROMPT = "The capital of France is"
CONCURRENCY = (1, 16)


async def run_level(call, concurrency: int, total: int) -> dict:
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)

    async def worker() -> None:
        while not queue.empty():
            queue.get_nowait()
            start = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summarize(latencies, time.perf_counter() - start)


async def direct(model_dir: Path, max_tokens: int, total: int, levels: tuple[int, ...],
                 device: str, precision: str) -> dict:
    engine = TorchEngine(model_dir, device=device, precision=precision)
    await engine.start()
    prompt = engine.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def call() -> None:
        async for _ in engine.generate(GenerationRequest(uuid.uuid4().hex, prompt, params)):
            pass

    await run_level(call, 1, 8)  # warm-up
    results = {c: await run_level(call, c, total) for c in levels}
    await engine.shutdown()
    return results


async def over_http(model_dir: Path, max_tokens: int, total: int, levels: tuple[int, ...]) -> tuple[dict, str]:
    """The levels' results, and the profile the server chose."""
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with ServerProcess(["--model", str(model_dir), "--log-level", "WARNING"]) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as http:
            async def call() -> None:
                response = await http.post("/v1/completions", json=body)
                response.raise_for_status()

            await run_level(call, 1, 8)
            profile = (await http.get("/v1/metadata")).json()["selectedModelProfileId"]
            return {c: await run_level(call, c, total) for c in levels}, profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--levels", type=concurrency_levels, default=",".join(map(str, CONCURRENCY)),
                        help="concurrency levels, comma-separated")
    parser.add_argument("--device", default="cpu", help="the direct engine's device")
    parser.add_argument("--precision", default="fp32", choices=sorted(DTYPES), help="the direct engine's precision")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    model_dir = ensure_tiny_model()
    engine = asyncio.run(direct(model_dir, args.max_tokens, args.requests, args.levels, args.device, args.precision))
    http, profile = asyncio.run(over_http(model_dir, args.max_tokens, args.requests, args.levels))
    levels = {}
    for c in args.levels:
        d, h = engine[c], http[c]
        levels[f"concurrency_{c}"] = {
            "engine_direct": d, "http": h,
            "http_added_ms_p50": h["latency_ms"]["p50"] - d["latency_ms"]["p50"],
            "http_added_ms_p99": h["latency_ms"]["p99"] - d["latency_ms"]["p99"],
            "http_over_direct_requests_per_s": h["requests_per_s"] / d["requests_per_s"],
        }
        print(f"c={c:>2}  direct {d['requests_per_s']:7.1f} req/s p50 {d['latency_ms']['p50']:7.1f} ms"
              f" p99 {d['latency_ms']['p99']:7.1f} ms | http {h['requests_per_s']:7.1f} req/s"
              f" p50 {h['latency_ms']['p50']:7.1f} ms p99 {h['latency_ms']['p99']:7.1f} ms"
              f" | http adds {levels[f'concurrency_{c}']['http_added_ms_p50']:+.1f} ms at p50")
    settings = {"requests_per_level": args.requests, "max_tokens": args.max_tokens, "prompt": PROMPT,
                "direct_device": args.device, "direct_precision": args.precision, "server_profile": profile}
    print(write_result("http_overhead", {"settings": settings, "levels": levels}, args.out))


if __name__ == "__main__":
    main()
