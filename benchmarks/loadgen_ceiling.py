"""The load generator's own ceiling: how many streamed requests and tokens per second it can drive
against a trivial endpoint that answers instantly, so that it is never what limits a measurement.

The endpoint runs in its own process (no shared GIL); it streams `--tokens` one-token chunks and a
usage chunk per request, like a server that costs nothing. In the same run, with the same settings,
the generator drives the real service on the bundled tiny model (the fastest service here); the
headroom is the generator's best tokens/s over the service's best. Writes results/loadgen_ceiling.json.

    python -m benchmarks.loadgen_ceiling
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from pathlib import Path

import httpx

from benchmarks.common import write_result
from factory.tinymodel import ensure_tiny_model
from factory.verify.load import LoadSettings, run_load, summarize
from service.launcher import ServerProcess, free_port


def trivial_server(port: int, tokens: int) -> None:
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> StreamingResponse:
        async def events():
            for _ in range(tokens):
                yield 'data: {"choices":[{"index":0,"text":"x"}]}\n\n'
            usage = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    port = free_port()
    server = multiprocessing.Process(target=trivial_server, args=(port, args.tokens), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.post(f"{url}/v1/completions", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    ceiling = sweep("trivial endpoint", url, "trivial", args)
    server.terminate()
    with ServerProcess(["--model", str(ensure_tiny_model())]) as service:
        served = sweep("tiny-llama service", service.url, "tiny-llama", args)
    best = {name: max(level["output_token_throughput"] for level in levels.values())
            for name, levels in (("generator", ceiling), ("service", served))}
    headroom = round(best["generator"] / best["service"], 2)
    print(f"headroom: {best['generator']:.0f} / {best['service']:.0f} tokens/s = {headroom}x")
    result = {"settings": vars(args) | {"out": str(args.out)}, "levels": ceiling, "service_levels": served,
              "best_output_token_throughput": best, "headroom": headroom}
    print(write_result("loadgen_ceiling", result, args.out))


def sweep(name: str, url: str, model: str, args) -> dict[int, dict]:
    levels = {}
    for concurrency in (1, 4, 16, 64):
        settings = LoadSettings(model=model, requests=args.requests, concurrency=concurrency,
                                output_tokens=args.tokens, warmup=4)
        records, wall = asyncio.run(run_load(url, settings))
        summary = summarize(records, wall, {})
        levels[concurrency] = {"request_throughput": summary["request_throughput"]["avg"],
                               "output_token_throughput": summary["output_token_throughput"]["avg"],
                               "errors": summary["error_request_count"]["avg"]}
        print(f"{name} c={concurrency:>2}  {levels[concurrency]['request_throughput']:8.1f} req/s  "
              f"{levels[concurrency]['output_token_throughput']:9.1f} tokens/s  errors {levels[concurrency]['errors']}")
    return levels


if __name__ == "__main__":
    main()
