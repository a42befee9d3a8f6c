"""Running the whole harness against a URL and gating on its results."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from factory.spec import AccuracyTask, Tests
from factory.tinymodel import memorised_pairs
from factory.verify.accuracy import engine_parity, exact_match, parity, served_precision, served_profile
from factory.verify.conformance import run_conformance
from factory.verify.lm_eval_tasks import run_tasks
from factory.verify.load import LoadSettings, run_load, summarize
from factory.verify.metrics_check import check_metrics
from factory.verify.report import write_report
from factory.verify.result import Gate, TestReport


@dataclass(frozen=True)
class AdapterCheck:
    """A LoRA adapter the server must list (with the model as its parent) and, given pairs, its own
    accuracy: exact match on what it was trained to complete."""

    name: str
    pairs: list[tuple[str, str]] | None = None
    min_exact_match: float = 0.9


@dataclass
class HarnessConfig:
    """What the harness runs. Its settings come from a spec's `tests` (HarnessConfig.from_tests), with
    the spec's defaults for `test --url`: one source, so both commands measure alike."""

    min_exact_match: float
    concurrency: list[int]
    requests_per_level: int
    tasks: list[AccuracyTask] = field(default_factory=list)
    task_paths: list[Path] = field(default_factory=list)  # directories of the spec's own lm-eval tasks
    endpoint: str = "completions"  # the route lm-eval calls
    prompt_tokens: int = 32
    output_tokens: int = 32
    rate: float | None = None
    slo: dict[str, float | None] = field(default_factory=dict)
    groups: tuple[str, ...] = ("openai", "nim")
    precision: str | None = None  # the parity tolerance's; None: the served profile's (fp32 if not published)
    reference_url: str | None = None  # another server on the same weights: greedy outputs must match it
    adapters: list[AdapterCheck] = field(default_factory=list)

    @classmethod
    def from_tests(cls, tests: Tests, base: Path | None = None, **overrides) -> HarnessConfig:
        """`base`: the spec's directory, which its include_path is relative to."""
        accuracy = tests.accuracy
        paths = [(base or Path.cwd()) / accuracy.include_path] if accuracy.include_path else []
        return cls(min_exact_match=accuracy.min_exact_match, concurrency=list(tests.perf.concurrency),
                   requests_per_level=tests.perf.requests_per_level, slo=tests.perf.slo.model_dump(),
                   tasks=list(accuracy.tasks), task_paths=paths, endpoint=accuracy.endpoint, **overrides)


def load_pairs(dataset: Path | None) -> list[tuple[str, str]] | None:
    """JSONL lines of {"prompt", "completion"}; None without a dataset."""
    if dataset is None:
        return None
    rows = [json.loads(line) for line in dataset.read_text().splitlines() if line.strip()]
    return [(row["prompt"], row["completion"]) for row in rows]


def run_accuracy(url: str, model: str, config: HarnessConfig, pairs: list[tuple[str, str]] | None,
                 model_dir: Path | None, progress: Callable[[str], None]) -> dict:
    """Exact match on a dataset, lm-eval tasks, parity with transformers and with another server.
    Parity needs no known answers: without a dataset, its prompts are the bundled model's."""
    accuracy: dict = {"threshold": config.min_exact_match, "tasks": [], "skipped": {}}
    if pairs is None:
        accuracy["skipped"]["accuracy.exact_match"] = ("no dataset of known continuations "
                                                       "(tests.accuracy.dataset, or --dataset)")
    else:
        progress(f"exact match on {len(pairs)} prompts...")
        accuracy["exact_match"] = exact_match(url, model, pairs)
    if config.tasks:
        progress(f"lm-eval tasks {', '.join(t.name for t in config.tasks)}...")
        accuracy["tasks"] = run_tasks(url, model, config.tasks, include_paths=config.task_paths,
                                      endpoint=config.endpoint, tokenizer=model_dir)
    else:
        accuracy["skipped"]["accuracy.tasks"] = "no lm-eval tasks named (tests.accuracy.tasks, or --task)"
    prompts = [p for p, _ in pairs or memorised_pairs()]
    if model_dir is not None:
        precision = config.precision or served_precision(url) or "fp32"
        accuracy["parity"] = parity(url, model, model_dir, prompts[:8], precision)
    if config.reference_url:
        progress(f"greedy outputs against {config.reference_url}...")
        accuracy["engine_parity"] = engine_parity(url, config.reference_url, model, prompts)
    return accuracy


def run_harness(url: str, model: str, config: HarnessConfig, output: Path, *, pairs: list[tuple[str, str]] | None,
                model_dir: Path | None, progress: Callable[[str], None]) -> TestReport:
    """Every check against `url`; the report directory gets the full results, the caller a TestReport."""
    progress("conformance checks...")
    gates = run_conformance(url, model, config.groups)
    result: dict = {"url": url, "model": model}
    result["accuracy"] = accuracy = run_accuracy(url, model, config, pairs, model_dir, progress)
    gates += accuracy_gates(accuracy)
    if config.adapters:
        progress(f"LoRA adapters {', '.join(a.name for a in config.adapters)}...")
        result["adapters"] = adapters = check_adapters(url, model, config.adapters)
        gates += adapter_gates(adapters)
        accuracy["skipped"].update({f"accuracy.adapter.{a.name}.exact_match": "no dataset for this adapter "
                                    "(adapters[].dataset)" for a in config.adapters if a.pairs is None})
    if "nim" in config.groups:
        progress("metrics checks...")
        gates += check_metrics(url, model)
    performance, runs = {}, {}
    for level in config.concurrency:
        progress(f"load at concurrency {level}...")
        settings = LoadSettings(model=model, prompt_tokens=config.prompt_tokens, output_tokens=config.output_tokens,
                                requests=config.requests_per_level, concurrency=level, rate=config.rate)
        level_records, wall = asyncio.run(run_load(url, settings))
        performance[level], runs[level] = summarize(level_records, wall, config.slo), (settings, level_records)
    result["performance"], result["slo_targets"] = performance, config.slo
    gates += slo_gates(performance, config.slo)
    report = TestReport.from_gates(
        gates, output, url=url,
        skipped=accuracy["skipped"], profile=served_profile(url),
        exact_match=accuracy["exact_match"]["score"] if "exact_match" in accuracy else None,
        accuracy={row["task"]: row["score"] for row in accuracy["tasks"] if "score" in row},
        output_tokens_per_s={str(level): round(m["output_token_throughput"]["avg"], 1)
                             for level, m in performance.items()})
    result.update(passed=report.passed, summary=report.summary, skipped=report.skipped)
    write_report(result, gates, runs, output)
    return report


def accuracy_gates(accuracy: dict) -> list[Gate]:
    """The gates of run_accuracy's measurements: exact match, each lm-eval task, parity with
    transformers and with another server."""
    gates = []
    if "exact_match" in accuracy:
        score, threshold = accuracy["exact_match"]["score"], accuracy["threshold"]
        gates.append(Gate(id="accuracy.exact_match", passed=score >= threshold,
                          detail=f"{score:.3f} (threshold {threshold})"))
    for task in accuracy.get("tasks", []):
        gates.append(Gate(id=f"accuracy.task.{task['task']}", passed=task.get("passed", False), detail=task.get(
            "error") or f"{task['metric']} {task['score']:.3f} (min {task['min']}, {task['samples']} samples)"))
    if parity := accuracy.get("parity"):
        first = f"; {parity['mismatches'][0]}" if parity["mismatches"] else ""
        gates.append(Gate(id="accuracy.parity", passed=parity["passed"], detail=(
            f"max logprob diff {parity['max_logprob_diff']:.2e} (tolerance {parity['tolerance']}){first}")))
    if same := accuracy.get("engine_parity"):
        first = f"; {same['mismatches'][0]}" if same["mismatches"] else ""
        identical = same["prompts"] - len(same["mismatches"])
        gates.append(Gate(id="accuracy.engine_parity", passed=same["passed"], detail=(
            f"{identical}/{same['prompts']} greedy outputs identical to {same['reference']}{first}")))
    return gates


def check_adapters(url: str, model: str, adapters: list[AdapterCheck]) -> dict[str, dict]:
    """Each adapter as the server lists it, and its exact match where it has known answers."""
    import httpx

    listed = {m["id"]: m.get("parent") for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
    results = {}
    for adapter in adapters:
        results[adapter.name] = {"listed": adapter.name in listed, "parent": listed.get(adapter.name),
                                 "expected_parent": model, "threshold": adapter.min_exact_match}
        if adapter.pairs is not None:
            results[adapter.name]["exact_match"] = exact_match(url, adapter.name, adapter.pairs)
    return results


def adapter_gates(adapters: dict[str, dict]) -> list[Gate]:
    gates = []
    for name, result in adapters.items():
        gates.append(Gate(id=f"adapter.{name}.listed", passed=result["listed"] and result["parent"] == result["expected_parent"],
                          detail=f"in /v1/models with parent {result['parent']!r}" if result["listed"]
                          else "not in /v1/models"))
        if "exact_match" in result:
            score, threshold = result["exact_match"]["score"], result["threshold"]
            gates.append(Gate(id=f"accuracy.adapter.{name}.exact_match", passed=score >= threshold,
                              detail=f"{score:.3f} (threshold {threshold})"))
    return gates


def slo_gates(performance: dict[int, dict], slo: dict[str, float | None]) -> list[Gate]:
    gates = []
    for name, metric in (("ttft_p99_ms", "time_to_first_token"), ("itl_p99_ms", "inter_token_latency")):
        limit = slo.get(name)
        if limit is None:
            continue
        for level, summary in performance.items():
            value = summary[metric]["p99"]
            ok = value is not None and value <= limit
            gates.append(Gate(id=f"slo.{name}@{level}", passed=ok,
                              detail=f"{value if value is None else round(value, 1)} ms (limit {limit} ms)"))
    for level, summary in performance.items():
        errors, retried = summary["error_request_count"]["avg"], summary["retried_request_count"]["avg"]
        gates.append(Gate(id=f"perf.errors@{level}", passed=errors == 0,
                          detail=f"{errors} failed requests, {retried} sent again after a closed connection"))
    return gates
