"""Prometheus metrics with NIM's names and vLLM's bucket boundaries, on a registry of our own.

Gauges are read from the engine at scrape time, so they are never stale; counters and histograms
are recorded when a request ends, from the same numbers that went into the client's `usage`.

Behind vLLM's server (`shared=True`) the counters and histograms live in prometheus_client's default
registry, which vLLM's /metrics exports: with several API server processes that is its multiprocess
collector, so each process counts what it served and the scrape sums them.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from service.after_requests import after_requests
from service.engine.base import EngineStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> list[float]:
    """vLLM's 1-2-5 series up to the context limit."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(float(value))
        exponent += 1


def observe_each(histogram: Histogram, amounts: list[float]) -> None:
    """`histogram.observe(amount)` for every amount, with the sum and each bucket incremented once:
    a 64-token stream's 63 gaps, observed one at a time, took 130-270 us of the serving thread on
    2 cores, most of what the contract adds to a request. prometheus_client has no batch observe;
    this writes the labelled child's values as its `observe` does (its `_upper_bounds`, `_buckets`
    and `_sum`), and a test holds the exposition equal to observing one at a time. The amounts are
    sorted and cut at each bound in turn, up to the largest's bucket (a stream's gaps mostly share
    one or two): with the gaps' list and sum, 4.0-4.6 us for 63 gaps against 11.0 bisecting each
    gap into the bounds."""
    if not amounts:
        return
    histogram._sum.inc(sum(amounts))
    ordered, counted = sorted(amounts), 0
    for bucket, bound in enumerate(histogram._upper_bounds):  # ends with +Inf: every amount has a bucket
        upto = bisect.bisect_right(ordered, bound, counted)  # the amounts at or below this bound
        if upto > counted:
            histogram._buckets[bucket].inc(upto - counted)
            counted = upto
            if counted == len(ordered):
                return


def observe_one(histogram: Histogram, amount: float) -> None:
    """`histogram.observe(amount)` as observe_each writes it: a bisection, not observe's linear walk
    of up to 22 buckets."""
    histogram._sum.inc(amount)
    histogram._buckets[bisect.bisect_left(histogram._upper_bounds, amount)].inc(1)


@dataclass(frozen=True)
class _Series:
    """One served model id's labelled children, looked up once: `record` called `labels()` (a lock
    and a tuple of its arguments) eight times a request, and took 21 of the 66 us the contract added
    to a request (benchmarks.passthrough_overhead, record left out); with these and observe_one, 13."""

    prompt_tokens: Counter
    generation_tokens: Counter
    ttft: Histogram
    tpot: Histogram
    e2e: Histogram
    prompt_hist: Histogram
    generation_hist: Histogram
    ended: dict[str, Counter]  # finished reason: request_success's child, or request_failure's


class _EngineStats(Collector):
    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.model_name, self.stats = model_name, stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.stats()
        for name, doc, value in (
            ("num_requests_running", "Number of requests currently decoding.", stats.running),
            ("num_requests_waiting", "Number of requests waiting to be scheduled.", stats.waiting),
            ("num_request_max", "Most requests decoded at once (max_num_seqs).", stats.max_num_seqs),
            ("gpu_cache_usage_perc", "KV-cache fill, 0 to 1 (CPU memory on CPU).", stats.kv_cache_usage),
        ):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        for name, doc, value in (  # vLLM's names; counted in tokens
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            *self._spec_decode(stats),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter

    @staticmethod
    def _spec_decode(stats: EngineStats) -> list[tuple[str, str, int]]:
        """vLLM's speculative-decoding counters, where the engine speculates; accepted over draft
        tokens is the acceptance rate."""
        counts = stats.spec_decode
        if counts is None:
            return []
        return [("spec_decode_num_drafts", "Speculative drafts run.", counts.drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens run.", counts.draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", counts.accepted_tokens)]


class ServiceMetrics:
    def __init__(self, model_name: str, max_model_len: int, stats: Callable[[], EngineStats],
                 shared: bool = False) -> None:
        self.gauges = CollectorRegistry(auto_describe=True)
        self.gauges.register(_EngineStats(model_name, stats))
        self.registry = REGISTRY if shared else self.gauges
        self.model_name = model_name
        labels, reg, name = ["model_name"], self.registry, model_name
        # Per served model id: the base model's, and each LoRA adapter's once it has served a request.
        self.prompt_tokens = Counter("prompt_tokens", "Prefill tokens processed.", labels, registry=reg)
        self.generation_tokens = Counter("generation_tokens", "Generation tokens produced.", labels, registry=reg)
        self.success = Counter("request_success", "Requests finished.", labels + ["finished_reason"], registry=reg)
        self.failure = Counter("request_failure", "Requests that failed or were aborted.", labels + ["reason"],
                               registry=reg)
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token.", labels, buckets=TTFT_BUCKETS,
                              registry=reg)
        self.tpot = Histogram("time_per_output_token_seconds", "Time between output tokens.", labels,
                              buckets=TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram("e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             buckets=E2E_BUCKETS, registry=reg)
        tokens = token_buckets(max_model_len)
        self.prompt_hist = Histogram("request_prompt_tokens", "Prompt tokens per request.", labels, buckets=tokens,
                                     registry=reg)
        self.generation_hist = Histogram("request_generation_tokens", "Generation tokens per request.", labels,
                                         buckets=tokens, registry=reg)
        self._series: dict[str, _Series] = {}
        self._of(name)  # the base model's series are exported from the start, at zero

    def _of(self, name: str) -> _Series:
        series = self._series.get(name)
        if series is None:
            ended = {reason: self.success.labels(name, reason) for reason in ("stop", "length")}
            ended |= {reason: self.failure.labels(name, reason) for reason in ("abort", "error")}
            series = self._series[name] = _Series(
                *(family.labels(name) for family in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot,
                                                     self.e2e, self.prompt_hist, self.generation_hist)), ended)
        return series

    def record(self, *, prompt_tokens: int, generation_tokens: int, finished_reason: str, ttft: float | None,
               token_gaps: list[float], e2e: float, model_name: str | None = None) -> None:
        """One engine request ended; `finished_reason` abort/error count as failures. `model_name`:
        the id the request named (a LoRA adapter's), else the base model's. Counted off the
        request's path (service.after_requests), before any exposition."""
        after_requests.add(self.count, prompt_tokens, generation_tokens, finished_reason, ttft, token_gaps, e2e,
                           model_name)

    def count(self, prompt_tokens: int, generation_tokens: int, finished_reason: str, ttft: float | None,
              token_gaps: list[float], e2e: float, model_name: str | None = None) -> None:
        """`record` now: for a caller already off the request's path."""
        name = model_name or self.model_name
        series = self._of(name)
        series.prompt_tokens.inc(prompt_tokens)
        series.generation_tokens.inc(generation_tokens)
        if finished_reason not in series.ended:  # any other reason an engine gives is a success's
            series.ended[finished_reason] = self.success.labels(name, finished_reason)
        series.ended[finished_reason].inc()
        if ttft is not None:
            observe_one(series.ttft, ttft)
        observe_each(series.tpot, token_gaps)
        observe_one(series.e2e, e2e)
        observe_one(series.prompt_hist, prompt_tokens)
        observe_one(series.generation_hist, generation_tokens)

    def exposition(self) -> bytes:
        """The gauges, and the counters and histograms unless the engine's exposition has them (what
        after_requests holds is counted first, by the metrics route, before either exposition)."""
        return generate_latest(self.gauges)
