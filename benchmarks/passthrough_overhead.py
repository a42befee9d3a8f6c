"""What the NIM contract adds, on the CPU of vLLM's API server process, to each request and each
streamed event: the same stand-in engine app called directly and through the contract's layers
(service.vllm_contract's path: request id and its JSON access log line, body limit, the passthrough's
observing), in-process, with no network, so that only the contract's Python is timed: a long
stream's events, short streams one after another, and streams of `--stream-tokens` events, the
whole of what a request of that many tokens adds. Writes results/passthrough_overhead.json.

The stand-in sends what vLLM's completions stream sends (one event per message, then the usage
event the contract asked for, then [DONE]); vLLM's own per-event work is not in it, so the numbers
are the contract's whole cost, to set beside vLLM's (benchmarks.vllm_backend measures both together).

    python -m benchmarks.passthrough_overhead [--events 4000] [--requests 2000] [--stream-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.common import write_result
from factory.tinymodel import ensure_tiny_model
from service.admission import Admission
from service.api.passthrough import PassthroughApp
from service.app import with_contract_layers
from service.engine.vllm_server import VllmServer
from service.logs import configure_logging
from service.profiles import detect_hardware
from service.runtime import Runtime, load_model_manifest
from service.settings import load_settings

EVENT = (b'data: {"id":"cmpl-c0e0d937d5d444a09397ef6edcdd7bfd","object":"text_completion","created":1795593818,'
         b'"model":"tiny-llama","choices":[{"index":0,"text":" wood","logprobs":null,"finish_reason":null,'
         b'"stop_reason":null,"token_ids":null}]}\n\n')
LAST = EVENT.replace(b'"finish_reason":null', b'"finish_reason":"length"')
USAGE = (b'data: {"id":"cmpl-c0e0d937d5d444a09397ef6edcdd7bfd","object":"text_completion","created":1795593818,'
         b'"model":"tiny-llama","choices":[],"usage":{"prompt_tokens":5,"total_tokens":13,"completion_tokens":8}}\n\n')
BODY = json.dumps({"model": "tiny-llama", "prompt": "the cat", "max_tokens": 8, "stream": True}).encode()


def stand_in(events: int):
    async def app(scope, receive, send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for body in [EVENT] * events + [LAST, USAGE, b"data: [DONE]\n\n"]:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


def contract():
    """The contract's path, as NimContract builds it for inference routes, and its engine (whose
    `app` the caller sets: one runtime a process, as in each of vLLM's API server processes)."""
    model = ensure_tiny_model()
    settings = load_settings({"model_path": str(model)}, {})
    manifest, _ = load_model_manifest(settings)
    engine = VllmServer([], "tiny-llama", 512, 32)
    engine.attach(None, SimpleNamespace(state=SimpleNamespace(engine_client=SimpleNamespace(errored=False))))
    engine._ready = True  # noqa: SLF001 (no vLLM here to warm up)
    runtime = Runtime(settings=settings, manifest=manifest, profile=manifest.profiles[0], hardware=detect_hardware(),
                      model_dir=model, engine=engine, served_model_name="tiny-llama", admission=Admission(32, 256, 288))
    return with_contract_layers(PassthroughApp(runtime), settings), engine


async def one(app) -> None:
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]}
    read = False

    async def receive():
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.Event().wait()

    async def send(message) -> None:
        pass

    await app(scope, receive, send)


def seconds(app, requests: int, repeats: int = 5) -> float:
    """The best of `repeats` runs of `requests` requests one after the other."""
    async def run() -> None:
        for _ in range(requests):
            await one(app)

    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        asyncio.run(run())
        best = min(best, time.perf_counter() - began)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=4000, help="events in the long stream")
    parser.add_argument("--requests", type=int, default=2000, help="streams in a row, each timed whole")
    parser.add_argument("--stream-tokens", type=int, default=64, help="tokens' events of each stream of per_stream_us")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    # The access log line each request writes, as in the image (by the logging thread), to nowhere.
    with contextlib.redirect_stderr(open(os.devnull, "w")):  # noqa: SIM115 (for the process's life)
        configure_logging("INFO", jsonl=True)
    through, engine = contract()

    def added(events: int, requests: int, each: int, digits: int) -> dict[str, float]:
        """Microseconds `requests` streams of `events` tokens' events took alone and through the
        contract, divided by `each`."""
        engine.app = stand_in(events)
        alone, through_it = seconds(engine.app, requests), seconds(through, requests)
        return {"engine_app_alone": round(alone / each * 1e6, digits),
                "through_the_contract": round(through_it / each * 1e6, digits),
                "added": round((through_it - alone) / each * 1e6, digits)}

    result = {"per_event_us": added(args.events, 1, args.events, 2),
              "per_request_us": added(1, args.requests, args.requests, 1),
              "per_stream_us": added(args.stream_tokens, args.requests, args.requests, 1),
              "events": args.events, "requests": args.requests, "stream_tokens": args.stream_tokens}
    print(json.dumps(result, indent=2))
    print(write_result("passthrough_overhead", result, args.out))


if __name__ == "__main__":
    main()
