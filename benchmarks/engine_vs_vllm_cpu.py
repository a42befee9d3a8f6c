"""The torch engine against vLLM's CPU build, side by side in one run (writes results/engine_vs_vllm_cpu.json).

Both engines run in the images the factory builds (the cpu image and the vllm-cpu image), as the
chart's pod runs them, on the same weights, driven by the same load generator (AIPerf-style closed
loop, ignore_eos, greedy) at each container's own address (no userland proxy in the path, as a
Service reaches a pod; Docker's proxy behind the loopback port added ~0.2 ms to each TTFT):
- the bundled tiny model and a ~76M-parameter random-weights Llama made here, at concurrency 1, 8
  and 16: output tok/s and TTFT p50;
- a shared-prefix workload: every prompt starts with the same 480 tokens (a system prompt),
  at concurrency 1 and 4, with the torch engine's prefix caching on and off, and vLLM's on;
- on the tiny model, the torch engine's forward pass at its default threads against every core
  (NIM_CPU_THREADS): the default leaves one core to HTTP below 10M parameters (the 76M model's
  default already takes every core);
- the KV memory the torch engine holds for 32 sequences of 64 tokens at max_model_len 512,
  against a slot of max_model_len per sequence (what the engine reserved before paging).

All of a model's configurations run at once, each idle while another is measured, for `--rounds`
rounds; in each round every level measures them back to back, in an order that rotates, each
once every container is quiet (`settle`: vLLM spins a core after its last request). Values are
medians over rounds; ratios are the median and quartiles of the per-round paired ratios.

    python -m benchmarks.engine_vs_vllm_cpu [--models tiny,llama-76m] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import spread, write_result
from benchmarks.vllm_backend import PLAIN_LOAD, make_76m_llama, measure, settle, spec, start
from factory.pipeline.runner import Runner
from factory.stack import docker_client, stack_up
from factory.tinymodel import ensure_tiny_model
from factory.verify.load import LoadSettings, synthetic_prompt

LEVELS = (1, 8, 16)
PREFIX_LEVELS = (1, 4)
PREFIX_TOKENS = 480
PREFIX_REQUESTS = 32  # a measurement at every level: a cached TTFT of ~3 ms moves with the machine's noise


def shared_prefix(model_dir: Path, tokens: int) -> str:
    """Synthetic words that every prompt starting with them shares as its first `tokens` tokens (BOS
    included), as 480 shared tokens are 30 full KV blocks. The text ends at a word and the space after
    it begins the prompt's next word: tokenized alone, a trailing space is a token that no prompt
    has (in a prompt it merges with the word after it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def ids(text: str) -> list[int]:
        return tokenizer(text)["input_ids"]

    words = synthetic_prompt(tokens, 12345).split()
    while len(ids(" ".join(words))) > tokens:
        words.pop()
    shortest = min(sorted(set(words)), key=lambda word: len(ids(word)))
    while len(ids(" ".join(words))) < tokens:  # the shortest word fills the rest
        words.append(shortest)
    text = " ".join(words)
    if len(ids(text)) != tokens or ids(f"{text} {synthetic_prompt(4, 0)}")[:tokens] != ids(text):
        raise ValueError(f"cannot make a {tokens}-token shared prefix with this tokenizer")
    return text + " "


def rotated(names: list[str], turn: int) -> list[str]:
    """Each round starts with the next engine, so none is always measured first."""
    shift = turn % len(names)
    return names[shift:] + names[:shift]


def compare(client, images: dict[str, str], model_dir: Path | None, weights: Path, rounds: int) -> dict:
    """Every configuration running at once, idle while another is measured: in each round, each level
    measures them one after another (within seconds), so a pair shares the machine's state (this
    VM's CPU steal drifts over minutes), and each ratio is the median over rounds of the paired ratios."""
    configs = {"torch": ("torch", {}), "torch_no_prefix_cache": ("torch", {"NIM_ENABLE_KV_CACHE_REUSE": "0"}),
               "vllm": ("vllm", {})}
    if model_dir is None:  # the tiny model's default leaves one core to HTTP; the 76M model's takes all
        configs["torch_all_cores"] = ("torch", {"NIM_CPU_THREADS": str(len(os.sched_getaffinity(0)))})
    plain = [name for name in configs if name != "torch_no_prefix_cache"]
    prefix_engines = ["torch", "torch_no_prefix_cache", "vllm"]
    # two words after the prefix: at most 12 tokens, so 480 + 12 + 16 fit the tiny model's 512
    prefixed = LoadSettings(model="tiny-llama", prompt_tokens=2, output_tokens=16,
                            prefix=shared_prefix(weights, PREFIX_TOKENS))
    running, ready_s, urls = {}, {}, {}
    try:
        for name, (image, env) in configs.items():
            running[name], ready_s[name] = start(client, images[image], model_dir=model_dir, env=env)
            urls[name] = running[name].bridge_url()
            measure(urls[name], (max(LEVELS),), per_stream=1)  # warm-up: batch shapes, first-call costs
        levels = {name: {level: [] for level in LEVELS} for name in plain}
        shared = {name: {level: [] for level in PREFIX_LEVELS} for name in prefix_engines}
        waits: list[float] = []

        def measured(name: str, level: int, load: LoadSettings = PLAIN_LOAD, per_stream: int = 4) -> dict:
            waits.append(settle(list(running.values())))  # the one measured before may still be busy
            return measure(urls[name], (level,), load, per_stream)[level]

        for turn in range(rounds):
            for level in LEVELS:
                for name in rotated(plain, turn):
                    levels[name][level].append(measured(name, level))
            for level in PREFIX_LEVELS:
                for name in rotated(prefix_engines, turn):
                    shared[name][level].append(measured(name, level, prefixed, PREFIX_REQUESTS // level))
    finally:
        for model in running.values():
            model.stop()
    return {"start_to_ready_s": {name: round(s, 1) for name, s in ready_s.items()},
            "settle_s": {"median": round(statistics.median(waits), 2), "max": round(max(waits), 2)},
            "levels": {name: medians(runs) for name, runs in levels.items()},
            "shared_prefix": {name: medians(runs) for name, runs in shared.items()},
            "ratios": {**{f"tok_s_{name}_over_vllm": paired(levels[name], levels["vllm"], "output_tok_s")
                          for name in plain if name != "vllm"},
                       "ttft_p50_torch_over_vllm": paired(levels["torch"], levels["vllm"], "ttft_p50_ms"),
                       "shared_prefix_ttft_p50_cached_over_uncached":
                           paired(shared["torch"], shared["torch_no_prefix_cache"], "ttft_p50_ms"),
                       "shared_prefix_ttft_p50_torch_over_vllm": paired(shared["torch"], shared["vllm"], "ttft_p50_ms")},
            "rounds": {"levels": levels, "shared_prefix": shared}}


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


def table(result: dict) -> str:
    """The medians over rounds, and the median [quartiles] of the paired ratios."""
    def ratio(spread: dict) -> str:
        return f"{spread['median']:.2f} [{spread['q1']:.2f}, {spread['q3']:.2f}]"

    lines = ["model  level  torch tok/s  vLLM tok/s  torch/vLLM tok/s    torch TTFT  vLLM TTFT  torch/vLLM TTFT"]
    for name, run in result.items():
        if not isinstance(run, dict) or "levels" not in run:
            continue
        torch_, vllm, ratios = run["levels"]["torch"], run["levels"]["vllm"], run["ratios"]
        for level in LEVELS:
            lines.append(f"{name}  {level}  {torch_[level]['output_tok_s']:.1f}  {vllm[level]['output_tok_s']:.1f}  "
                         f"{ratio(ratios['tok_s_torch_over_vllm'][level])}  {torch_[level]['ttft_p50_ms']:.1f} ms  "
                         f"{vllm[level]['ttft_p50_ms']:.1f} ms  {ratio(ratios['ttft_p50_torch_over_vllm'][level])}")
        shared = run["shared_prefix"]
        for level in PREFIX_LEVELS:
            lines.append(f"{name} shared prefix c={level}: TTFT p50 cached {shared['torch'][level]['ttft_p50_ms']:.1f} ms, "
                         f"uncached {shared['torch_no_prefix_cache'][level]['ttft_p50_ms']:.1f} ms, vLLM "
                         f"{shared['vllm'][level]['ttft_p50_ms']:.1f} ms; cached/uncached "
                         f"{ratio(ratios['shared_prefix_ttft_p50_cached_over_uncached'][level])}, cached/vLLM "
                         f"{ratio(ratios['shared_prefix_ttft_p50_torch_over_vllm'][level])}")
        lines.append(f"{name}: waited for quiet before each measurement: median {run['settle_s']['median']:.2f} s, "
                     f"max {run['settle_s']['max']:.2f} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,llama-76m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    names = args.models.split(",")
    if unknown := set(names) - {"tiny", "llama-76m"}:
        parser.error(f"unknown model(s) {', '.join(sorted(unknown))}: choose from tiny, llama-76m")
    stack_up()
    client = docker_client()
    result: dict = {"rounds": args.rounds, "kv_memory_32x64_at_512": kv_memory()}
    with tempfile.TemporaryDirectory() as tmp:  # the specs, and the 76M model (~300 MB) if asked for
        Path(tmp).chmod(0o755)  # the images' user reads the model through a bind mount
        specs = {"torch": spec("tiny-llama.yaml", Path(tmp)), "vllm": spec("tiny-llama-vllm.yaml", Path(tmp))}
        images = {engine: Runner(path).build().model.reference for engine, path in specs.items()}
        for name in names:
            model_dir = make_76m_llama(Path(tmp) / name) if name == "llama-76m" else None
            result[name] = compare(client, images, model_dir, model_dir or ensure_tiny_model(), args.rounds)
            path = write_result("engine_vs_vllm_cpu", result, args.out)
    print(table(result))
    print(path)

if __name__ == "__main__":
    main()
