"""Soak: the torch runtime under steady mixed load for a long while, as a pod lives.

Eight clients (by default) send requests back to back for `--minutes`: chat or completions,
streamed or not, prompts of 1 to ~300 tokens, 1 to 256 output tokens, sampled or greedy, and one
request in ten left by its client mid-way (a streamed one after a few events, a plain one by a
client timeout); prompt and output fit the tiny model's 512-token context. Reported: every
outcome (a 5xx, a stream's error frame or a transport error is an error; a 4xx is counted apart), the server's resident memory sampled every 10 s with its growth
after warm-up (the first tenth of the run), and the KV cache at idle once the load stops (blocks
a finished or aborted request still held would show there). Writes results/soak.json.

    python -m benchmarks.soak [--minutes 30] [--concurrency 8] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.common import percentile, write_result
from factory.tinymodel import ensure_tiny_model
from factory.verify.metrics_check import scrape
from service.launcher import ServerProcess

WORDS = "the owl sat on a branch and watched the river run past the old mill in the evening light".split()
CANCEL_SHARE = 0.1
RSS_INTERVAL_S = 10.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def make_request(rng: random.Random, model: str) -> tuple[str, dict, bool]:
    """A random request: its route, body and whether its client leaves before the end."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice((1, 8, 40, 120))))
    sampling = {"max_tokens": rng.choice((1, 8, 32, 128, 256)), "stream": rng.random() < 0.5,
                "temperature": rng.choice((0, 0.7, 1.0)), "seed": rng.randrange(1000)}
    if rng.random() < 0.5:
        return "/v1/completions", {"model": model, "prompt": prompt, **sampling}, rng.random() < CANCEL_SHARE
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], **sampling}
    return "/v1/chat/completions", body, rng.random() < CANCEL_SHARE


async def one(http: httpx.AsyncClient, route: str, body: dict, cancel: bool, rng: random.Random) -> str:
    """Send one request; the outcome's name."""
    try:
        if body["stream"]:
            async with http.stream("POST", route, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return f"http_{response.status_code}"
                events = 0
                async for line in response.aiter_lines():
                    events += line.startswith("data: ")
                    if '"error"' in line:
                        return "stream_error"
                    if cancel and events >= rng.randint(1, 4):
                        return "cancelled"  # leaving the block closes the connection mid-stream
                return "ok"
        timeout = rng.uniform(0.005, 0.05) if cancel else 120
        response = await http.post(route, json=body, timeout=timeout)
        return "ok" if response.status_code == 200 else f"http_{response.status_code}"
    except httpx.TimeoutException:
        return "cancelled" if cancel else "timeout"
    except httpx.TransportError as exc:
        return f"transport_{type(exc).__name__}"


async def load(url: str, model: str, concurrency: int, seconds: float, seed: int) -> tuple[Counter, list[float]]:
    outcomes: Counter = Counter()
    latencies: list[float] = []
    deadline = time.monotonic() + seconds

    async def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            while time.monotonic() < deadline:
                route, body, cancel = make_request(rng, model)
                start = time.perf_counter()
                outcome = await one(http, route, body, cancel, rng)
                outcomes[outcome] += 1
                if outcome == "ok":
                    latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return outcomes, latencies


async def sample_rss(pid: int, seconds: float, samples: list[tuple[float, float]]) -> None:
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        samples.append((round(elapsed, 1), round(rss_mib(pid), 1)))
        await asyncio.sleep(RSS_INTERVAL_S)


async def soak(url: str, pid: int, model: str, concurrency: int, seconds: float, seed: int) -> dict:
    rss: list[tuple[float, float]] = []
    sampler = asyncio.create_task(sample_rss(pid, seconds, rss))
    outcomes, latencies = await load(url, model, concurrency, seconds, seed)
    sampler.cancel()
    rss.append((round(seconds, 1), round(rss_mib(pid), 1)))
    return {"outcomes": dict(outcomes), "latencies": latencies, "rss": rss}


def idle_gauges(url: str, timeout: float = 30) -> dict[str, float]:
    """The gauges once nothing runs or waits (aborts free their blocks at the next step)."""
    deadline = time.monotonic() + timeout
    while (values := scrape(url))["num_requests_running"] or values["num_requests_waiting"]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--model", type=Path, default=None, help="a model directory; default: the tiny model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    model_dir = args.model or ensure_tiny_model()
    seconds = args.minutes * 60
    with ServerProcess(["--model", str(model_dir), "--served-model-name", "soak"]) as server:
        run = asyncio.run(soak(server.url, server.proc.pid, "soak", args.concurrency, seconds, args.seed))
        idle = idle_gauges(server.url)
        ready = httpx.get(f"{server.url}/v1/health/ready").status_code
    outcomes, rss, latencies = run["outcomes"], run["rss"], run["latencies"]
    warm = next((mib for t, mib in rss if t >= seconds / 10), rss[0][1])
    refused = sum(n for name, n in outcomes.items() if name.startswith("http_4"))
    errors = sum(outcomes.values()) - outcomes.get("ok", 0) - outcomes.get("cancelled", 0) - refused
    result = {
        "settings": {"minutes": args.minutes, "concurrency": args.concurrency, "model": model_dir.name,
                     "cancel_share": CANCEL_SHARE, "seed": args.seed},
        "requests": sum(outcomes.values()), "outcomes": outcomes, "errors": errors,
        "refused_4xx": refused,
        "latency_ms": {"p50": round(percentile(latencies, 50) * 1000, 1),
                       "p99": round(percentile(latencies, 99) * 1000, 1)},
        "rss_mib": {"after_warm_up": warm, "end": rss[-1][1], "growth_after_warm_up": round(rss[-1][1] - warm, 1),
                    "max": max(mib for _, mib in rss), "samples": rss},
        "idle": {"kv_cache_usage": idle["gpu_cache_usage_perc"], "running": idle["num_requests_running"],
                 "waiting": idle["num_requests_waiting"]},
        "ready_after": ready,
    }
    path = write_result("soak", result, args.out)
    print(f"{result['requests']} requests, {errors} errors, outcomes {outcomes}; RSS {warm} -> {rss[-1][1]} MiB "
          f"after warm-up; KV cache at idle {idle['gpu_cache_usage_perc']}; ready {ready}; {path}")


if __name__ == "__main__":
    main()
