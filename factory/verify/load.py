"""The load generator: streaming requests over aiohttp, as a concurrency sweep or at a Poisson
request rate; statistics named, defined and shaped as NVIDIA AIPerf exports them.

aiohttp is AIPerf's own HTTP client. Its C parser and line reader cost less per request than
httpx's pure-Python stack, and what the client costs lands in every TTFT it reports: on the tiny
model, a cached-prefix request's TTFT read 0.8 ms more through httpx (4.5 against 3.7 ms).

Per request it records the time to the first token, the gaps between streamed chunks, the
end-to-end latency and the exact token counts from the final usage chunk. Inter-token latency is
AIPerf's: (request latency - TTFT) / (output tokens - 1), per request.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp


# perf_counter seconds to epoch nanoseconds, for exports that carry wall-clock timestamps
CLOCK_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def epoch_ns(perf_seconds: float) -> int:
    return CLOCK_OFFSET_NS + int(perf_seconds * 1e9)


@dataclass
class RequestRecord:
    start: float  # time.perf_counter() seconds
    index: int = 0
    end: float | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)  # gaps between streamed chunks (a chunk may hold several tokens)
    latency: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    code: int | None = None  # the HTTP status of a failed request
    retried: bool = False  # the first connection closed before any response, and the request was sent again

    @property
    def inter_token_latency(self) -> float | None:
        """AIPerf's definition: (request latency - TTFT) / (output tokens - 1), per request."""
        if self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def tokens_per_s_per_user(self) -> float | None:
        """AIPerf's output_token_throughput_per_user: 1 / inter-token latency."""
        itl = self.inter_token_latency
        return 1 / itl if itl else None


@dataclass(frozen=True)
class LoadSettings:
    model: str
    prompt_tokens: int = 32
    output_tokens: int = 32
    requests: int = 32
    concurrency: int = 1
    rate: float | None = None  # requests per second (Poisson arrivals); None = closed loop
    warmup: int = 2
    seed: int = 0
    timeout: float = 300.0
    prefix: str = ""  # text every prompt starts with (a shared system prompt, as AIPerf's prefix prompts)


def synthetic_prompt(tokens: int, seed: int) -> str:
    """Words from a small vocabulary: roughly one token each for BPE tokenizers; usage gives the exact count."""
    words = ("river", "stone", "light", "north", "garden", "winter", "copper", "signal", "harbour", "meadow")
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(tokens))


async def one_request(http: aiohttp.ClientSession, settings: LoadSettings, index: int) -> RequestRecord:
    body = {"model": settings.model, "prompt": settings.prefix + synthetic_prompt(settings.prompt_tokens, settings.seed + index),
            "max_tokens": settings.output_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    record = RequestRecord(start=time.perf_counter(), index=index)
    last = None
    try:
        async with await _post(http, settings, body, record) as response:
            if response.status != 200:
                record.code = response.status
                record.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return record
            async for raw in response.content:  # line by line
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    record.input_tokens = chunk["usage"]["prompt_tokens"]
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if record.ttft is None:
                        record.ttft = now - record.start
                    elif last is not None:
                        record.itls.append(now - last)
                    last = now
        record.latency = time.perf_counter() - record.start
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        record.end = time.perf_counter()
    return record


async def _post(http: aiohttp.ClientSession, settings: LoadSettings, body: dict,
                record: RequestRecord) -> aiohttp.ClientResponse:
    """The response's start. A connection closed before any answer (a pooled one the server shut as
    the request went out) is sent once more, as the openai client does (it tries twice), and the
    record says so (retried_request_count); a failed second try is an error, as is a refused connect."""
    # the timeout bounds connecting and each wait for bytes, not the whole stream: a long one is no error
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.timeout, sock_read=settings.timeout)
    try:
        return await http.post("/v1/completions", json=body, timeout=timeout)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        if isinstance(exc, aiohttp.ClientConnectorError):  # nothing was sent
            raise
        record.retried = True
        return await http.post("/v1/completions", json=body, timeout=timeout)


async def run_load(base_url: str, settings: LoadSettings) -> tuple[list[RequestRecord], float]:
    """All requests of one level; returns the records and the wall time of the measured part."""
    connector = aiohttp.TCPConnector(limit=0)  # a connection per client, however many
    async with aiohttp.ClientSession(base_url, connector=connector) as http:  # one_request sets each timeout
        for i in range(settings.warmup):
            await one_request(http, settings, -1 - i)
        records: list[RequestRecord] = []
        start = time.perf_counter()
        if settings.rate:
            rng = random.Random(settings.seed)
            tasks = []
            for i in range(settings.requests):
                tasks.append(asyncio.create_task(one_request(http, settings, i)))
                await asyncio.sleep(rng.expovariate(settings.rate))
            records = list(await asyncio.gather(*tasks))
        else:
            counter = iter(range(settings.requests))

            async def client() -> None:
                for i in counter:
                    records.append(await one_request(http, settings, i))

            await asyncio.gather(*(client() for _ in range(settings.concurrency)))
        return records, time.perf_counter() - start


PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99)


def describe(values: list[float], unit: str) -> dict:
    """AIPerf's per-metric fields for a distribution: unit, avg, p1..p99, min, max, std (population),
    count and sum; percentiles interpolated linearly, as AIPerf computes them."""
    if not values:
        return {"unit": unit, **{k: None for k in ("avg", *(f"p{q}" for q in PERCENTILES), "min", "max", "std")}}
    ordered = sorted(values)

    def pct(q: float) -> float:
        pos = (len(ordered) - 1) * q / 100
        low = math.floor(pos)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)

    return {"unit": unit, "avg": statistics.fmean(ordered), **{f"p{q}": pct(q) for q in PERCENTILES},
            "min": ordered[0], "max": ordered[-1], "std": statistics.pstdev(ordered) if len(ordered) > 1 else 0.0,
            "count": len(ordered), "sum": math.fsum(ordered)}


def summarize(records: list[RequestRecord], wall: float, slo: dict[str, float | None]) -> dict:
    """The AIPerf-style export of one level, with goodput against the SLOs (ms)."""
    ok = [r for r in records if r.error is None]
    output = sum(r.output_tokens for r in ok)

    def meets(r: RequestRecord) -> bool:
        ttft_ok = slo.get("ttft_p99_ms") is None or (r.ttft or math.inf) * 1000 <= slo["ttft_p99_ms"]
        itl = r.inter_token_latency
        itl_ok = slo.get("itl_p99_ms") is None or (itl is not None and itl * 1000 <= slo["itl_p99_ms"])
        return ttft_ok and itl_ok

    good = [r for r in ok if meets(r)]
    return {
        "time_to_first_token": describe([r.ttft * 1000 for r in ok if r.ttft is not None], "ms"),
        "inter_token_latency": describe([r.inter_token_latency * 1000 for r in ok if r.inter_token_latency is not None], "ms"),
        "inter_chunk_latency": describe([g * 1000 for r in ok for g in r.itls], "ms"),
        "request_latency": describe([r.latency * 1000 for r in ok if r.latency is not None], "ms"),
        "output_sequence_length": describe([r.output_tokens for r in ok], "tokens"),
        "input_sequence_length": describe([r.input_tokens for r in ok], "tokens"),
        "output_token_throughput_per_user": describe([r.tokens_per_s_per_user for r in ok
                                                      if r.tokens_per_s_per_user is not None], "tokens/sec/user"),
        "output_token_throughput": {"unit": "tokens/sec", "avg": output / wall if wall else 0.0},
        "request_throughput": {"unit": "requests/sec", "avg": len(ok) / wall if wall else 0.0},
        "goodput": {"unit": "requests/sec", "avg": len(good) / wall if wall else 0.0},
        "good_request_count": {"unit": "requests", "avg": len(good)},
        "request_count": {"unit": "requests", "avg": len(ok)},
        "error_request_count": {"unit": "requests", "avg": len(records) - len(ok)},
        "retried_request_count": {"unit": "requests", "avg": sum(r.retried for r in records)},
        "total_output_tokens": {"unit": "tokens", "avg": output},
        "total_isl": {"unit": "tokens", "avg": sum(r.input_tokens for r in ok)},
        "benchmark_duration": {"unit": "sec", "avg": wall},
    }
