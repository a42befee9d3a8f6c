"""N-gram speculation in the torch engine, on against off, side by side in one run (writes
results/ngram_speculation.json).

Two servers of the torch engine run at once from the same weights, one with the profile's
`speculative_config` (vLLM's ngram method: `SPECULATION`), one without; the client is NVIDIA
AIPerf, closed loop, greedy, server token counts. Two workloads:
- `quoting`: the prompt holds a text three times and starts it a fourth (as an edit or a quote
  does), and the model goes on with it: 64 tokens, ignore_eos;
- `answers`: the bundled model's prompts alone, each answered with its memorised line, which the
  prompt does not hold, stopping where the model stops (at most 64 tokens).
On the bundled tiny model (trained) and on the 76M Llama shape, whose random weights decode into
loops of a few tokens whatever the prompt: n-gram drafts find those loops, so on that shape both
workloads repeat, and what a draft costs when it is refused is measured directly too: a c=1
decode step with `num_speculative_tokens` more positions against one without.

Reported per model, workload and level: output tok/s and inter-token latency p50 with and without
speculation, the paired ratio (median and quartiles over rounds), the acceptance rate from the
server's `spec_decode_*` counters, and whether the greedy outputs are the same.

    python -m benchmarks.ngram_speculation [--models tiny,llama-76m] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.common import AIPERF, ROOT, aiperf, make_76m_llama, settle, spread, write_result
from factory.tinymodel import ensure_tiny_model, memorised_pairs
from factory.verify.metrics_check import scrape
from service.launcher import ServerProcess
from service.manifest import default_manifest

NAME = "tiny-llama"
SPECULATION = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
               "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 1024, 0]]}
LEVELS = (1, 2, 8)
OUTPUT_TOKENS = 64
PROMPTS = 16


def workloads(work: Path) -> dict[str, tuple[Path, bool]]:
    """AIPerf single_turn files of the two workloads, and whether each ignores the end of text."""
    pairs = memorised_pairs()[:PROMPTS]
    texts = {"quoting": [(prompt + completion + " ") * 3 + prompt for prompt, completion in pairs],
             "answers": [prompt for prompt, _ in pairs]}
    files = {}
    for name, prompts in texts.items():
        path = work / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in prompts))
        files[name] = (path, name == "quoting")
    return files


def manifest(model_dir: Path, path: Path, speculate: bool) -> Path:
    """The default manifest, its CPU profile with or without `SPECULATION`."""
    data = default_manifest(model_dir, name=NAME)
    if speculate:
        data.profiles[0].engine_args["speculative_config"] = SPECULATION
    path.write_text(json.dumps(data.model_dump(mode="json", exclude_none=True)))
    return path


def counters(url: str) -> dict[str, float]:
    """The server's spec_decode_* counters (none without speculation)."""
    return {name: value for name, value in scrape(url).items() if name.startswith("spec_decode_")}


def same_outputs(urls: dict[str, str], dataset: Path, ignore_eos: bool) -> bool:
    """Greedy completions of every prompt, with and without speculation: token for token the same."""
    def outputs(url: str) -> list[str]:
        return [httpx.post(url + "/v1/completions", timeout=120, json={
            "model": NAME, "prompt": json.loads(line)["text"], "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "ignore_eos": ignore_eos}).json()["choices"][0]["text"] for line in dataset.read_text().splitlines()]

    return outputs(urls["speculation"]) == outputs(urls["off"])


def verify_cost(model_dir: Path, extra: int) -> dict:
    """A c=1 decode step of the model with `extra` more positions (a draft refused in full) against
    one without, in process, at the engine's thread count for the model: medians of 50 steps."""
    from transformers import AutoModelForCausalLM

    from service.engine.llama_runner import LlamaRunner
    from service.engine.torch_engine import default_cpu_threads

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.set_num_threads(default_cpu_threads(sum(p.numel() for p in model.parameters())))
    runner = LlamaRunner(model, 16, 16, 512, pack_weights=True)
    table, prompt = list(range(8)), list(range(3, 67))
    times: dict[int, list[float]] = {1: [], 1 + extra: []}
    with torch.inference_mode():
        runner.forward([(prompt, table, 0)])
        for step in range(100):
            width = 1 + extra * (step % 2)
            began = time.perf_counter()
            runner.forward([(prompt[:width], table, 64)], every_position=width > 1)
            times[width].append(time.perf_counter() - began)
    plain, wide = (statistics.median(times[w][5:]) * 1000 for w in (1, 1 + extra))
    return {"step_ms": round(plain, 2), f"step_with_{extra}_draft_tokens_ms": round(wide, 2),
            "ratio": round(wide / plain, 3)}


def compare(model_dir: Path, rounds: int, work: Path, requests_per_stream: int) -> dict:
    """Each round measures every workload and level on both servers back to back, in an order that
    alternates, each after the machine is quiet; a run sends `requests_per_stream` requests per
    concurrent stream (at least two streams' worth)."""
    files, runs = workloads(work), itertools.count()
    results = {name: {level: {"off": [], "speculation": []} for level in LEVELS} for name in files}
    acceptance = {name: {level: [] for level in LEVELS} for name in files}
    with contextlib.ExitStack() as stack:
        urls = {config: stack.enter_context(ServerProcess(
                    ["--model", str(model_dir), "--served-model-name", NAME, "--max-model-len", "512",
                     "--manifest", str(manifest(model_dir, work / f"{config}.json", config == "speculation"))],
                    log_path=work / f"{config}.log", timeout=600)).url
                for config in ("off", "speculation")}
        identical = {name: same_outputs(urls, path, ignore_eos) for name, (path, ignore_eos) in files.items()}
        for turn in range(rounds):
            for name, (path, ignore_eos) in files.items():
                for level in LEVELS:
                    for config in (("off", "speculation") if turn % 2 == 0 else ("speculation", "off")):
                        settle()
                        before = counters(urls["speculation"])
                        results[name][level][config].append(aiperf(
                            urls[config], NAME, model_dir, level, requests_per_stream * max(level, 2),
                            work / f"run{next(runs)}",
                            output_tokens=OUTPUT_TOKENS, dataset=path, ignore_eos=ignore_eos, greedy=True))
                        if config == "speculation":
                            after = counters(urls["speculation"])
                            acceptance[name][level].append({key: after[key] - before[key] for key in after})
    return {name: {"outputs_identical": identical[name], "levels": {
        level: summary(results[name][level], acceptance[name][level]) for level in LEVELS}} for name in files}


def summary(runs: dict[str, list[dict]], counts: list[dict]) -> dict:
    drafts = sum(c["spec_decode_num_drafts_total"] for c in counts)
    proposed = sum(c["spec_decode_num_draft_tokens_total"] for c in counts)
    accepted = sum(c["spec_decode_num_accepted_tokens_total"] for c in counts)
    return {**{config: {key: statistics.median(run[key] for run in rs) for key in rs[0]} for config, rs in runs.items()},
            "tok_s_speculation_over_off": spread([a["output_tok_s"] / b["output_tok_s"]
                                                  for a, b in zip(runs["speculation"], runs["off"])]),
            "drafts": int(drafts), "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
            "mean_accepted_per_draft": round(accepted / drafts, 2) if drafts else None}


def table(model: str, result: dict) -> str:
    lines = [f"{model}: n-gram speculation {json.dumps(SPECULATION)}; a refused draft's step costs "
             f"{result['verify_cost']['ratio']:.2f}x a plain c=1 step",
             "workload  c  tok/s off  tok/s on  on/off [quartiles]  ITL p50 ms off/on  acceptance  same outputs"]
    for name, workload in result["workloads"].items():
        for level, row in workload["levels"].items():
            ratio = row["tok_s_speculation_over_off"]
            lines.append(f"{name}  {level}  {row['off']['output_tok_s']:.1f}  {row['speculation']['output_tok_s']:.1f}  "
                         f"{ratio['median']:.2f} [{ratio['q1']:.2f}, {ratio['q3']:.2f}]  "
                         f"{row['off']['itl_p50_ms']:.2f}/{row['speculation']['itl_p50_ms']:.2f}  "
                         f"{row['acceptance_rate']}  {workload['outputs_identical']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,llama-76m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    if not AIPERF.is_file():
        parser.error(f"{AIPERF.relative_to(ROOT)} is missing: run scripts/setup.sh")
    names = args.models.split(",")
    if unknown := set(names) - {"tiny", "llama-76m"}:
        parser.error(f"unknown model(s) {', '.join(sorted(unknown))}: choose from tiny, llama-76m")
    result: dict = {"speculative_config": SPECULATION, "rounds": args.rounds, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model_dir = make_76m_llama(Path(tmp) / name) if name == "llama-76m" else ensure_tiny_model()
            work = Path(tmp) / f"{name}-runs"
            work.mkdir()
            # the tiny model answers in ~10 ms: enough requests that a run lasts seconds, not AIPerf's start-up
            requests = 32 if name == "tiny" else 4
            result["models"][name] = {"verify_cost": verify_cost(model_dir, SPECULATION["num_speculative_tokens"]),
                                      "requests_per_stream": requests,
                                      "workloads": compare(model_dir, args.rounds, work, requests)}
            print(table(name, result["models"][name]), flush=True)
    print(f"wrote {write_result('ngram_speculation', result, args.out)}")


if __name__ == "__main__":
    main()
