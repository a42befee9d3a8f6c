"""Multi-LoRA throughput: c=16 streams spread over 8 adapters and the base model, against c=16 on the
base model alone, on the same server, in alternating rounds of one run; on the torch engine (the
runtime in-process) and on vLLM's CPU build (its own OpenAI server in the vllm-cpu image, started
as vLLM documents it with the arguments the runtime resolves, the adapters as --lora-modules).

Also timed: an adapter's scan and checks (what a refresh costs it before it is listed), its first
load into the engine's pool (what its first request waits for), and the memory it takes (a pool
slot, and its weights in host memory). The adapters are made with peft (rank 8 on q, k, v, o,
gate, up and down, random weights: speed does not depend on what they learned). Writes
results/lora_adapters.json.

    python -m benchmarks.lora_adapters [--rounds 3] [--requests 96] [--max-tokens 64] [--no-vllm]
                                       [--vllm-python VENV/bin/python]

In the vllm-cpu image vLLM runs with the sample spec's `enforce_eager` (the spec's choice, for
start-up time), labelled so in the JSON; `--vllm-python` adds vLLM in its default configuration
(torch.compile on) from a host environment.
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

from benchmarks.common import spread, vllm_on_host, write_result
from factory.tinymodel import ensure_tiny_model, memorised_pairs
from factory.tinymodel.adapter import random_adapter
from service.adapters import ModelShape, read_adapter
from service.engine.lora import LoraLimits, LoraPool
from service.launcher import ServerProcess

ADAPTERS = 8
CONCURRENCY = 16
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, source: Path, count: int, rank: int) -> list[Path]:
    return [random_adapter(base, source / f"lora-{i}", rank, MODULES, seed=i, std=0.1) for i in range(count)]


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


def rounds_on(url: str, base_name: str, adapters: list[str], rounds: int, requests: int, max_tokens: int) -> list[dict]:
    """Warm every adapter, then base-only and mixed load back to back, `rounds` times."""
    mixed_models = [base_name, *adapters]
    asyncio.run(load(url, mixed_models, 2 * len(mixed_models), 8))
    results = []
    for _ in range(rounds):
        base_only = asyncio.run(load(url, [base_name], requests, max_tokens))
        mixed = asyncio.run(load(url, mixed_models, requests, max_tokens))
        results.append({"base_only": base_only, "mixed": mixed,
                        "ratio": round(mixed["tokens_per_s"] / base_only["tokens_per_s"], 3)})
        print(json.dumps(results[-1]))
    return results


def on_vllm(source: Path, adapters: list[str], args) -> dict:
    """vLLM's own server in the vllm-cpu image of the sample spec, the adapters mounted."""
    import subprocess

    import yaml

    from factory.pipeline.runner import Runner
    from factory.stack import docker_client, stack_up
    from factory.verify.container import start_vllms_own_server

    stack_up()
    data = yaml.safe_load((Path(__file__).parents[1] / "pipelines" / "models" / "tiny-llama-vllm.yaml").read_text())
    data["model"]["source"] = f"local://{ensure_tiny_model()}"
    spec = source.parent / "tiny-llama-vllm.yaml"
    spec.write_text(yaml.safe_dump(data))
    image = Runner(spec).build().model.reference
    subprocess.run(["chmod", "-R", "a+rX", str(source.parent)], check=True)  # the image's user reads the mount
    env = {"NIM_PEFT_SOURCE": "/opt/peft", "NIM_MAX_LORA_RANK": str(args.rank), "NIM_MAX_GPU_LORAS": str(ADAPTERS),
           "VLLM_NO_USAGE_STATS": "1"}
    running = start_vllms_own_server(docker_client(), image, env, 900, {str(source): {"bind": "/opt/peft", "mode": "ro"}})
    try:
        rounds = rounds_on(running.url, "tiny-llama", adapters, args.rounds, args.requests, args.max_tokens)
    finally:
        running.stop()
    return {"image": image, "configuration": "vLLM's own server, enforce_eager (the sample spec's)",
            "mixed_over_base_tokens_per_s": spread([r["ratio"] for r in rounds]), "rounds": rounds}


def on_vllm_host(python: str, source: Path, adapters: list[str], args) -> dict:
    """vLLM's own server as its documentation starts it, default configuration (torch.compile on),
    from a Python environment with vLLM's CPU build on this host, the same adapters as --lora-modules."""
    lora = ["--enable-lora", "--max-lora-rank", str(args.rank), "--max-loras", str(ADAPTERS),
            "--max-cpu-loras", str(ADAPTERS), "--lora-modules", *(f"{name}={source / name}" for name in adapters)]
    with vllm_on_host(python, ensure_tiny_model(), "tiny-llama", source.parent / "vllm-host.log", lora) as server:
        rounds = rounds_on(server.url, "tiny-llama", adapters, args.rounds, args.requests, args.max_tokens)
    return {"configuration": "vLLM's own server, default configuration (torch.compile on), on the host",
            "start_to_ready_s": round(server.ready_s, 1),
            "mixed_over_base_tokens_per_s": spread([r["ratio"] for r in rounds]), "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--no-vllm", action="store_true", help="leave out vLLM in the vllm-cpu image (enforce_eager)")
    parser.add_argument("--vllm-python", help="a Python with vLLM's CPU build (dockerfiles/locks/vllm-cpu.txt): vLLM "
                                              "in its default configuration, on the host")
    args = parser.parse_args()
    base = ensure_tiny_model()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "peft"
        paths = make_adapters(base, source, ADAPTERS, args.rank)
        names = [p.name for p in paths]
        costs = adapter_costs(base, paths, args.rank)
        env = {"NIM_PEFT_SOURCE": str(source), "NIM_MAX_LORA_RANK": str(args.rank), "NIM_MAX_GPU_LORAS": str(ADAPTERS)}
        with ServerProcess(["--model", str(base)], env=env, log_path=Path(tmp) / "server.log") as server:
            name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
            rounds = rounds_on(server.url, name, names, args.rounds, args.requests, args.max_tokens)
        vllm_default = on_vllm_host(args.vllm_python, source, names, args) if args.vllm_python else None
        vllm = None if args.no_vllm else on_vllm(source, names, args)
    result = {"model": "tiny-llama", "concurrency": CONCURRENCY, "adapters": ADAPTERS, "rank": args.rank,
              "requests_per_round": args.requests, "max_tokens": args.max_tokens,
              "torch": {"mixed_over_base_tokens_per_s": spread([r["ratio"] for r in rounds]), "rounds": rounds},
              "vllm_cpu_default": vllm_default, "vllm_cpu_eager_image": vllm, "adapter": costs}
    print(write_result("lora_adapters", result, args.out))


if __name__ == "__main__":
    main()
