"""Running the whole harness against a URL and gating on its results."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from factory.spec import Tests
from factory.verify.accuracy import engine_parity, exact_match, parity, served_precision
from factory.verify.conformance import run_conformance
from factory.verify.load import LoadSettings, run_load, summarize
from factory.verify.metrics_check import check_metrics
from factory.verify.report import gate_rows, write_report
from factory.verify.result import Gate, TestReport


@dataclass
class HarnessConfig:
    """What the harness runs. Its settings come from a spec's `tests` (HarnessConfig.from_tests), with
    the spec's defaults for `test --url`: one source, so both commands measure alike."""

    min_exact_match: float
    concurrency: list[int]
    requests_per_level: int
    prompt_tokens: int = 32
    output_tokens: int = 32
    rate: float | None = None
    slo: dict[str, float | None] = field(default_factory=dict)
    groups: tuple[str, ...] = ("openai", "nim")
    precision: str | None = None  # the parity tolerance's; None: the served profile's (fp32 if not published)
    reference_url: str | None = None  # another server on the same weights: greedy outputs must match it

    @classmethod
    def from_tests(cls, tests: Tests, **overrides) -> HarnessConfig:
        return cls(min_exact_match=tests.accuracy.min_exact_match, concurrency=list(tests.perf.concurrency),
                   requests_per_level=tests.perf.requests_per_level, slo=tests.perf.slo.model_dump(), **overrides)


def load_pairs(dataset: Path | None) -> list[tuple[str, str]]:
    """JSONL lines of {"prompt", "completion"}; by default the bundled tiny model's memorised lines."""
    if dataset is None:
        from factory.tinymodel import memorised_pairs

        return memorised_pairs()
    rows = [json.loads(line) for line in dataset.read_text().splitlines() if line.strip()]
    return [(row["prompt"], row["completion"]) for row in rows]


def run_harness(url: str, model: str, config: HarnessConfig, output: Path, *, pairs: list[tuple[str, str]],
                model_dir: Path | None, progress: Callable[[str], None]) -> TestReport:
    """Every check against `url`; the report directory gets the full results, the caller a TestReport."""
    progress("conformance checks...")
    result: dict = {"url": url, "model": model, "conformance": run_conformance(url, model, config.groups)}
    progress(f"accuracy on {len(pairs)} prompts...")
    accuracy: dict = {"threshold": config.min_exact_match, "exact_match": exact_match(url, model, pairs)}
    if model_dir is not None:
        precision = config.precision or served_precision(url) or "fp32"
        accuracy["parity"] = parity(url, model, model_dir, [p for p, _ in pairs[:8]], precision)
    if config.reference_url:
        progress(f"greedy outputs against {config.reference_url}...")
        accuracy["engine_parity"] = engine_parity(url, config.reference_url, model, [p for p, _ in pairs])
    result["accuracy"] = accuracy
    if "nim" in config.groups:
        progress("metrics checks...")
        result["metrics"] = check_metrics(url, model)
    performance, runs = {}, {}
    for level in config.concurrency:
        progress(f"load at concurrency {level}...")
        settings = LoadSettings(model=model, prompt_tokens=config.prompt_tokens, output_tokens=config.output_tokens,
                                requests=config.requests_per_level, concurrency=level, rate=config.rate)
        level_records, wall = asyncio.run(run_load(url, settings))
        performance[level], runs[level] = summarize(level_records, wall, config.slo), (settings, level_records)
    result["performance"] = performance
    result["slo"] = slo_gates(performance, config.slo)
    report = TestReport.from_gates(
        [Gate(id=gate, passed=ok, detail=detail) for gate, ok, detail in gate_rows(result)], output, url=url,
        exact_match=accuracy["exact_match"]["score"],
        output_tokens_per_s={str(level): round(m["output_token_throughput"]["avg"], 1)
                             for level, m in performance.items()})
    result.update(passed=report.passed, summary=report.summary)
    write_report(result, runs, output)
    return report


def slo_gates(performance: dict[int, dict], slo: dict[str, float | None]) -> list[dict]:
    gates = []
    for name, metric in (("ttft_p99_ms", "time_to_first_token"), ("itl_p99_ms", "inter_token_latency")):
        limit = slo.get(name)
        if limit is None:
            continue
        for level, summary in performance.items():
            value = summary[metric]["p99"]
            ok = value is not None and value <= limit
            gates.append({"id": f"slo.{name}@{level}", "passed": ok,
                          "message": f"{value if value is None else round(value, 1)} ms (limit {limit} ms)"})
    for level, summary in performance.items():
        errors = summary["error_request_count"]["avg"]
        gates.append({"id": f"perf.errors@{level}", "passed": errors == 0, "message": f"{errors} failed requests"})
    return gates
