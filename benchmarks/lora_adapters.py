"""Multi-LoRA throughput on the torch engine: c=16 streams spread over 8 adapters and the base model,
against c=16 on the base model alone, on the same server, in alternating rounds of one run.

Also timed: an adapter's scan and checks (what a refresh costs it before it is listed), its first
load into the engine's pool (what its first request waits for), and the memory it takes (a pool
slot, and its weights in host memory). The adapters are made with peft (rank 8 on q, k, v, o,
gate, up and down, random weights: speed does not depend on what they learned). Writes
results/lora_adapters.json.

    python -m benchmarks.lora_adapters [--rounds 3] [--requests 96] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.common import spread, write_result
from factory.tinymodel import ensure_tiny_model, memorised_pairs
from service.adapters import ModelShape, read_adapter
from service.engine.lora import LoraLimits, LoraPool
from service.launcher import ServerProcess

ADAPTERS = 8
CONCURRENCY = 16
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, source: Path, count: int, rank: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                               LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES, lora_dropout=0.0))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_" in name:
                    parameter.normal_(0, 0.1)
        model.save_pretrained(source / f"lora-{i}")
        paths.append(source / f"lora-{i}")
    return paths


async def load(url: str, models: list[str], total: int, max_tokens: int) -> dict:
    """`total` streamed completions at CONCURRENCY, model i % len(models): output tokens per second."""
    prompts = [prompt for prompt, _ in memorised_pairs()]
    counter = iter(range(total))
    tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        for i in counter:
            body = {"model": models[i % len(models)], "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
                reply.raise_for_status()
                async for line in reply.aiter_lines():
                    if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                        usage = json.loads(line[6:]).get("usage")
                        tokens += usage["completion_tokens"] if usage else 0

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=CONCURRENCY)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))
        wall = time.perf_counter() - start
    return {"output_tokens": tokens, "seconds": round(wall, 3), "tokens_per_s": round(tokens / wall, 1)}


def adapter_costs(base: Path, paths: list[Path], rank: int) -> dict:
    shape = ModelShape.of_model(base)
    scans, loads = [], []
    pool = LoraPool(shape, LoraLimits(len(paths), len(paths), rank), torch.float32, torch.device("cpu"))
    for path in paths:
        start = time.perf_counter()
        adapter = read_adapter(path, shape, rank)
        scans.append(time.perf_counter() - start)
        start = time.perf_counter()
        pool.acquire(adapter)
        loads.append(time.perf_counter() - start)
    return {"scan_and_check_ms": round(statistics.median(scans) * 1000, 2),
            "first_load_into_pool_ms": round(statistics.median(loads) * 1000, 2),
            "pool_slot_bytes": pool.bytes_per_slot, "weights_file_bytes": (paths[0] / "adapter_model.safetensors").stat().st_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    base = ensure_tiny_model()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "peft"
        paths = make_adapters(base, source, ADAPTERS, args.rank)
        costs = adapter_costs(base, paths, args.rank)
        env = {"NIM_PEFT_SOURCE": str(source), "NIM_MAX_LORA_RANK": str(args.rank), "NIM_MAX_GPU_LORAS": str(ADAPTERS)}
        with ServerProcess(["--model", str(base)], env=env, log_path=Path(tmp) / "server.log") as server:
            name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
            mixed_models = [name] + [p.name for p in paths]
            asyncio.run(load(server.url, mixed_models, 2 * len(mixed_models), 8))  # warm-up: every adapter loaded
            rounds = []
            for _ in range(args.rounds):
                base_only = asyncio.run(load(server.url, [name], args.requests, args.max_tokens))
                mixed = asyncio.run(load(server.url, mixed_models, args.requests, args.max_tokens))
                rounds.append({"base_only": base_only, "mixed": mixed,
                               "ratio": round(mixed["tokens_per_s"] / base_only["tokens_per_s"], 3)})
                print(json.dumps(rounds[-1]))
    result = {"model": "tiny-llama", "engine": "torch", "concurrency": CONCURRENCY, "adapters": ADAPTERS,
              "rank": args.rank, "requests_per_round": args.requests, "max_tokens": args.max_tokens,
              "mixed_over_base_tokens_per_s": spread([r["ratio"] for r in rounds]), "rounds": rounds,
              "adapter": costs}
    print(write_result("lora_adapters", result, args.out))


if __name__ == "__main__":
    main()
