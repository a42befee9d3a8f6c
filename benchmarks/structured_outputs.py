"""Structured outputs' cost: inter-token latency with a JSON-schema constraint against without, at
c=1 and c=8, in alternating rounds on one server; and what compiling a new 50-property schema adds
to the first request that names it (TTFT with a new schema against the same schema again), with the
grammar compiler's own time beside it; and how much a plain stream slows while other requests'
grammars compile (`--hostile` requests at once, each a JSON schema with an enum of `--enum-values`
new strings: about 2 s of xgrammar's time each at 20000 values on 2 cores, 30-40 s at 25000 six at
once); and a plain stream's longest pause while one request with `--unions` unions of
`--union-width` patterns each is answered (xgrammar's matcher takes time quadratic in a union's
width: the torch runtime refuses more than 1000 branches, vLLM's own server takes them). On the
torch engine (the runtime in-process, tiny model) and
on vLLM's CPU build as its documentation starts it (default configuration, from a host Python that
has it: --vllm-python), the same weights, the same requests. Writes results/structured_outputs.json.

    python -m benchmarks.structured_outputs [--model tiny|76m] [--rounds 3] [--requests 32]
                                            [--hostile 6] [--enum-values 10000] [--unions 50]
                                            [--union-width 200] [--vllm-python VENV/bin/python]

`--model 76m` runs the random-weights ~76M-parameter Llama of the engine benchmarks (the tiny
model's tokenizer), whose decode step is long enough that a mask's fixed cost is a small part of it,
as it is for real models; the tiny model's step is about a millisecond, which a mask's ~0.1 ms of
Python and native calls per step shows plainly. Results go to structured_outputs[_76m].json.

The constrained request is an array of 24 digits (about 48 tokens in the tiny model's vocabulary, a
character at a time); the free one generates as many tokens with ignore_eos. Inter-token latency is
(last token - first token) / (tokens - 1) of each streamed request, as AIPerf defines it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import make_76m_llama, spread, vllm_on_host, write_result
from factory.tinymodel import Recipe, ensure_tiny_model, memorised_pairs
from service.launcher import ServerProcess

MODEL = "tiny-llama"
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 24, "maxItems": 24}
FREE_TOKENS = 48


def wide_schema(tag: str, properties: int = 50) -> dict:
    """A 50-property object, each property named for `tag` so that every tag is a new grammar."""
    kinds = [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}, {"enum": ["a", "b", "c"]}]
    names = [f"{tag}_{i}" for i in range(properties)]
    return {"type": "object", "properties": {n: kinds[i % 3] for i, n in enumerate(names)}, "required": names,
            "additionalProperties": False}


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed completion: its TTFT, inter-token latency, longest gap between tokens and token count."""
    start = time.perf_counter()
    first = last = None
    tokens, gap = 0, 0.0
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True,
                                                                      "stream_options": {"include_usage": True}}) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0].get("text"):
                now = time.perf_counter()
                gap = max(gap, now - last) if last else gap
                last, first = now, first or now
    itl = (last - first) / (tokens - 1) if tokens > 1 and first else None
    return {"ttft_s": (first or time.perf_counter()) - start, "itl_s": itl, "gap_max_s": gap, "tokens": tokens}


def body(constrained: bool, i: int) -> dict:
    prompt = memorised_pairs()[i % 64][0]
    if constrained:
        return {"model": MODEL, "prompt": prompt, "max_tokens": 128, "temperature": 0,
                "structured_outputs": {"json": DIGITS, "disable_any_whitespace": True}}
    return {"model": MODEL, "prompt": prompt, "max_tokens": FREE_TOKENS, "temperature": 0, "ignore_eos": True}


async def level(url: str, constrained: bool, concurrency: int, requests: int) -> dict:
    counter = iter(range(requests))
    results: list[dict] = []

    async def worker(client: httpx.AsyncClient) -> None:
        for i in counter:
            results.append(await stream_one(client, url, body(constrained, i)))

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    itls = [r["itl_s"] for r in results if r["itl_s"]]
    return {"itl_ms_p50": round(statistics.median(itls) * 1000, 3), "tokens_mean": statistics.fmean(r["tokens"] for r in results)}


async def compile_cost(url: str, rounds: int) -> dict:
    """TTFT of a request with a schema the server has not seen, and of the same schema once more."""
    cold, warm = [], []
    async with httpx.AsyncClient(timeout=300) as client:
        for i in range(rounds * 3):
            request = {"model": MODEL, "prompt": "Fill the form:", "max_tokens": 4, "temperature": 0,
                       "structured_outputs": {"json": wide_schema(f"p{os.getpid()}x{i}"), "disable_any_whitespace": True}}
            cold.append((await stream_one(client, url, request))["ttft_s"])
            warm.append((await stream_one(client, url, request))["ttft_s"])
    return {"ttft_new_schema_ms_p50": round(statistics.median(cold) * 1000, 2),
            "ttft_same_schema_ms_p50": round(statistics.median(warm) * 1000, 2),
            "compile_ms_as_seen_by_the_client": round((statistics.median(cold) - statistics.median(warm)) * 1000, 2)}


async def isolation(url: str, hostile: int, values: int) -> dict:
    """A plain stream's inter-token latency while `hostile` requests wait for their grammars (each a
    new enum of `values` strings), against the same stream alone just before; and how long the last
    of those requests took."""
    async with httpx.AsyncClient(timeout=1800) as client:
        alone = [(await stream_one(client, url, body(False, i)))["itl_s"] for i in range(8)]
        began = time.perf_counter()
        requests = [{"model": MODEL, "prompt": "Pick one:", "max_tokens": 2, "temperature": 0,
                     "structured_outputs": {"json": {"enum": [f"{os.getpid()}-{time.time_ns()}-{h}-{v}"
                                                              for v in range(values)]}}} for h in range(hostile)]
        pending = [asyncio.create_task(client.post(f"{url}/v1/completions", json=request)) for request in requests]
        during = []
        while not all(task.done() for task in pending):
            during.append((await stream_one(client, url, body(False, len(during))))["itl_s"])
        statuses = [reply.status_code for reply in await asyncio.gather(*pending)]
        compiles_s = time.perf_counter() - began
    alone_ms, during_ms = statistics.median(alone) * 1000, statistics.median(during) * 1000
    return {"hostile_requests": hostile, "enum_values": values, "statuses": statuses,
            "itl_alone_ms_p50": round(alone_ms, 2), "itl_during_compiles_ms_p50": round(during_ms, 2),
            "itl_during_compiles_ms_p90": round(statistics.quantiles(during, n=10)[-1] * 1000, 2),
            "during_over_alone": round(during_ms / alone_ms, 2), "streams_during": len(during),
            "last_hostile_request_s": round(compiles_s, 1)}


async def wide_union(url: str, unions: int, width: int) -> dict:
    """A plain stream's longest gap between tokens while one request constrained to `unions` unions of
    `width` new patterns each is answered, against the same streams alone just before."""
    async with httpx.AsyncClient(timeout=1800) as client:
        alone = [(await stream_one(client, url, body(False, i)))["gap_max_s"] for i in range(8)]
        tag = f"w{os.getpid()}x{time.time_ns()}"
        schema = {"anyOf": [{"anyOf": [{"type": "string", "pattern": f"{tag}_{u}_{i}"} for i in range(width)]}
                            for u in range(unions)]}
        began = time.perf_counter()
        wide = asyncio.create_task(client.post(f"{url}/v1/completions", json={
            "model": MODEL, "prompt": "Pick one:", "max_tokens": 4, "structured_outputs": {"json": schema}}))
        during = []
        while not wide.done() or not during:
            during.append((await stream_one(client, url, body(False, len(during))))["gap_max_s"])
        reply = await wide
    return {"unions": unions, "union_width": width, "status": reply.status_code,
            "answered_s": round(time.perf_counter() - began, 2), "streams_during": len(during),
            "gap_max_alone_ms_p50": round(statistics.median(alone) * 1000, 1),
            "gap_max_during_ms": round(max(during) * 1000, 1)}


def measure(url: str, rounds: int, requests: int, hostile: int, values: int, unions: int, width: int) -> dict:
    asyncio.run(level(url, True, 2, 4))  # warm both paths
    asyncio.run(level(url, False, 2, 4))
    out = {}
    for concurrency in (1, 8):
        paired = []
        for _ in range(rounds):
            free = asyncio.run(level(url, False, concurrency, requests))
            constrained = asyncio.run(level(url, True, concurrency, requests))
            paired.append({"free": free, "constrained": constrained,
                           "itl_ratio": round(constrained["itl_ms_p50"] / free["itl_ms_p50"], 3)})
            print(concurrency, json.dumps(paired[-1]))
        out[f"c{concurrency}"] = {"constrained_over_free_itl": spread([p["itl_ratio"] for p in paired]), "rounds": paired}
    out["compile"] = asyncio.run(compile_cost(url, rounds))
    if hostile:
        out["isolation"] = asyncio.run(isolation(url, hostile, values))
        print("isolation", json.dumps(out["isolation"]))
    if unions:
        out["wide_union"] = asyncio.run(wide_union(url, unions, width))
        print("wide union", json.dumps(out["wide_union"]))
    return out


def compiler_time(model: Path) -> dict:
    """xgrammar's own time for a new 50-property schema, in-process, with the torch engine's compiler."""
    from transformers import AutoConfig, AutoTokenizer

    from service.engine.grammar import Constraint, GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(model)
    compiler = GrammarCompiler(tokenizer, AutoConfig.from_pretrained(model).vocab_size, [tokenizer.eos_token_id])
    times = []
    for i in range(10):
        start = time.perf_counter()
        compiler.compile(Constraint.json_schema(wide_schema(f"c{i}")))
        times.append(time.perf_counter() - start)
    return {"compile_50_properties_ms_p50": round(statistics.median(times) * 1000, 2)}


def on_vllm_host(python: str, model: Path, log_dir: Path, *measured) -> dict:
    """vLLM's own server as its documentation starts it (default configuration), on this host."""
    with vllm_on_host(python, model, MODEL, log_dir / "vllm-host.log") as server:
        result = measure(server.url, *measured)
    version = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    return {"configuration": "vLLM's own server, default configuration (structured outputs backend auto: "
                             "xgrammar), on the host", "vllm": version.stdout.strip(), **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "76m"), default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--hostile", type=int, default=6, help="requests whose grammars compile at once (0: skip)")
    parser.add_argument("--enum-values", type=int, default=10000)
    parser.add_argument("--unions", type=int, default=50, help="unions in the wide request's schema (0: skip)")
    parser.add_argument("--union-width", type=int, default=200, help="patterns in each of them")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--vllm-python", help="a Python with vLLM's CPU build: vLLM in its default configuration")
    args = parser.parse_args()
    measured = (args.rounds, args.requests, args.hostile, args.enum_values, args.unions, args.union_width)
    with tempfile.TemporaryDirectory() as tmp:
        model = ensure_tiny_model() if args.model == "tiny" else make_76m_llama(Path(tmp) / "llama-76m")
        with ServerProcess(["--model", str(model), "--served-model-name", MODEL],
                           log_path=Path(tmp) / "server.log") as server:
            torch_result = measure(server.url, *measured)
        torch_result |= compiler_time(model)
        vllm = on_vllm_host(args.vllm_python, model, Path(tmp), *measured) if args.vllm_python else None
    result = {"model": args.model, "vocab_size": Recipe().vocab_size, "schema": DIGITS, "free_tokens": FREE_TOKENS,
              "requests_per_level": args.requests, "torch": torch_result, "vllm_cpu_default": vllm}
    print(write_result("structured_outputs" + ("" if args.model == "tiny" else "_76m"), result, args.out))


if __name__ == "__main__":
    main()
