"""Metrics checks: the server's Prometheus counters must agree with what its clients were told."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from factory.verify.load import LoadSettings, run_load
from factory.verify.result import Gate


def scrape(url: str) -> dict[str, float]:
    """Every sample summed over its labels, by sample name."""
    text = httpx.get(f"{url}/v1/metrics", timeout=30).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" not in sample.labels:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def check_metrics(url: str, model: str, requests: int = 8) -> list[Gate]:
    """Send `requests` streamed requests alone and compare counter deltas with the clients' usage."""
    before = scrape(url)
    settings = LoadSettings(model=model, requests=requests, concurrency=4, prompt_tokens=16, output_tokens=12, warmup=0)
    records, _ = asyncio.run(run_load(url, settings))
    after = scrape(url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    ok = [r for r in records if r.error is None]
    expected = {
        "prompt_tokens_total": sum(r.input_tokens for r in ok),
        "generation_tokens_total": sum(r.output_tokens for r in ok),
        "request_success_total": len(ok),
        "e2e_request_latency_seconds_count": len(ok),
        "request_prompt_tokens_sum": sum(r.input_tokens for r in ok),
        "request_generation_tokens_sum": sum(r.output_tokens for r in ok),
        "request_generation_tokens_count": len(ok),
    }
    gates = [Gate(id=f"metrics.{name}", passed=delta(name) == value,
                  detail="" if delta(name) == value else f"server counted {delta(name):g}, clients saw {value:g}")
             for name, value in expected.items()]
    if len(ok) != requests:
        gates.append(Gate(id="metrics.requests", passed=False, detail=f"{requests - len(ok)} requests failed"))
    return gates
