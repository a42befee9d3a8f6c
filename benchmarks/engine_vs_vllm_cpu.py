"""The torch engine against vLLM's CPU build, side by side in one run (writes results/engine_vs_vllm_cpu.json).

Both engines run in the images the factory builds (the cpu image and the vllm-cpu image), as the
chart's pod runs them, on the same weights, driven by the same load generator (AIPerf-style closed
loop, ignore_eos, greedy):
- the bundled tiny model and a ~76M-parameter random-weights Llama made here, at concurrency 1, 8
  and 16: output tok/s and TTFT p50;
- a shared-prefix workload: every prompt starts with the same ~480-token text (a system prompt),
  at concurrency 1 and 4, with the torch engine's prefix caching on and off, and vLLM's on;
- the torch engine's forward pass at its default threads against every core (NIM_CPU_THREADS). The
  default leaves one core to HTTP only below 10M parameters; on the 76M model the two runs are the
  same configuration twice, and their ratio reads as the run-to-run noise;
- the KV memory the torch engine holds for 32 sequences of 64 tokens at max_model_len 512,
  against a slot of max_model_len per sequence (what the engine reserved before paging).

    python -m benchmarks.engine_vs_vllm_cpu [--models tiny,llama-76m]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

import yaml

from benchmarks.common import write_result
from benchmarks.vllm_backend import make_76m_llama, measure, spec, start
from factory.pipeline.runner import Runner
from factory.stack import docker_client, stack_up
from factory.tinymodel import ensure_tiny_model
from factory.verify.load import LoadSettings, synthetic_prompt

LEVELS = (1, 8, 16)
PREFIX_LEVELS = (1, 4)
PREFIX_TOKENS = 480


def shared_prefix(model_dir: Path, tokens: int) -> str:
    """Synthetic words, as many as fit in `tokens` tokens of this model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = synthetic_prompt(tokens, 12345).split()
    while len(tokenizer(" ".join(words) + " ")["input_ids"]) > tokens:
        words.pop()
    return " ".join(words) + " "


def run_engine(client, image: str, model_dir: Path | None, weights: Path, env: dict | None = None) -> dict:
    running, ready_s = start(client, image, model_dir=model_dir, env=env)
    try:
        prefixed = LoadSettings(model="tiny-llama", prompt_tokens=4, output_tokens=16,
                                prefix=shared_prefix(weights, PREFIX_TOKENS))
        return {"start_to_ready_s": round(ready_s, 1), "levels": measure(running.url, LEVELS),
                "shared_prefix": measure(running.url, PREFIX_LEVELS, prefixed)}
    finally:
        running.stop()


def ratios(torch_run: dict, all_cores: dict, vllm_run: dict) -> dict:
    def ratio(a: dict, b: dict, key: str) -> float:
        return round(a[key] / b[key], 2)

    return {"tok_s_all_cores_over_default": {
                lvl: ratio(all_cores["levels"][lvl], torch_run["levels"][lvl], "output_tok_s") for lvl in LEVELS},
            "tok_s_torch_over_vllm": {lvl: ratio(torch_run["levels"][lvl], vllm_run["levels"][lvl], "output_tok_s")
                                      for lvl in LEVELS},
            "ttft_p50_torch_over_vllm": {lvl: ratio(torch_run["levels"][lvl], vllm_run["levels"][lvl], "ttft_p50_ms")
                                         for lvl in LEVELS}}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,llama-76m")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    stack_up()
    client = docker_client()
    result: dict = {"kv_memory_32x64_at_512": kv_memory()}
    with tempfile.TemporaryDirectory() as tmp:
        specs = {"torch": spec("tiny-llama.yaml", Path(tmp)), "vllm": spec("tiny-llama-vllm.yaml", Path(tmp))}
        images = {engine: Runner(path).build().model.reference for engine, path in specs.items()}
        shared = Path(tempfile.mkdtemp(prefix="inferkiln-76m-"))
        shared.chmod(0o755)
        models = {"tiny": None, "llama-76m": make_76m_llama(shared / "llama-76m")}
        for name in args.models.split(","):
            model_dir = models[name]
            weights = model_dir or ensure_tiny_model()
            runs = {"torch": run_engine(client, images["torch"], model_dir, weights),
                    "torch_no_prefix_cache": run_engine(client, images["torch"], model_dir, weights,
                                                        {"NIM_ENABLE_KV_CACHE_REUSE": "0"}),
                    # every core in the forward pass: the tiny model's default leaves one to HTTP
                    "torch_all_cores": run_engine(client, images["torch"], model_dir, weights,
                                                  {"NIM_CPU_THREADS": str(len(os.sched_getaffinity(0)))}),
                    "vllm": run_engine(client, images["vllm"], model_dir, weights)}
            runs.update(ratios(runs["torch"], runs["torch_all_cores"], runs["vllm"]))
            prefix = {engine: runs[engine]["shared_prefix"][1]["ttft_p50_ms"]
                      for engine in ("torch", "torch_no_prefix_cache", "vllm")}
            runs["shared_prefix_ttft_p50_c1"] = {
                **prefix, "cached_over_uncached": round(prefix["torch"] / prefix["torch_no_prefix_cache"], 3),
                "torch_over_vllm": round(prefix["torch"] / prefix["vllm"], 3)}
            result[name] = runs
            path = write_result("engine_vs_vllm_cpu", result, args.out)
    print(yaml.safe_dump(result, sort_keys=False))
    print(path)


if __name__ == "__main__":
    main()
