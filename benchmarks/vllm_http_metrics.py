"""What vLLM's HTTP metrics cost a request's path in vLLM's own app, and what the contract's recording
of them after the request costs it (service/engine/vllm_http_metrics.py).

vLLM's app adds prometheus-fastapi-instrumentator's middleware; the contract takes it off the path
and records the same series once a request has ended. Timed in the vLLM image, on vLLM's app as its
server builds it (its routes, its middlewares), the middleware's own app replaced by a stand-in
endpoint that streams `--stream-tokens` events (no engine): the stand-in alone, under vLLM's
middleware, and with the contract's record queued (`Exchange`, `HttpMetrics.record`); then the
deferred recording itself, off the path. Writes results/vllm_http_metrics.json.

    python -m benchmarks.vllm_http_metrics [--requests 2000] [--stream-tokens 64]

On the host it builds the tiny vLLM spec's image (as benchmarks.vllm_backend does) and runs itself
in it, this checkout mounted in place of the image's runtime.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
MOUNT = "/src"
EVENT = (b'data: {"id":"cmpl-c0e0d937d5d444a09397ef6edcdd7bfd","object":"text_completion","created":1795593818,'
         b'"model":"tiny-llama","choices":[{"index":0,"text":" wood","logprobs":null,"finish_reason":null}]}\n\n')


def on_host(args: argparse.Namespace) -> None:
    import docker

    from benchmarks.vllm_backend import spec
    from factory.pipeline.runner import Runner

    image = Runner(spec("tiny-llama-vllm.yaml", Path(tempfile.mkdtemp()))).build().model.reference
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    logs = docker.from_env().containers.run(
        image, ["-m", "benchmarks.vllm_http_metrics", "--inside", "--requests", str(args.requests),
                "--stream-tokens", str(args.stream_tokens), "--out", "/out"],
        entrypoint=["python"], working_dir=MOUNT, environment={"PYTHONPATH": MOUNT, "VLLM_NO_USAGE_STATS": "1"},
        volumes={str(ROOT): {"bind": MOUNT, "mode": "ro"}, str(out): {"bind": "/out", "mode": "rw"}},
        user=f"{os.getuid()}:{os.getgid()}", remove=True, stderr=True)  # writes its result as the caller
    print(logs.decode()[-3000:])


def vllms_middleware():
    """vLLM's app as `vllm serve` builds it (no engine), and its HTTP metrics middleware."""
    from prometheus_fastapi_instrumentator.middleware import PrometheusInstrumentatorMiddleware
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    app = build_app(make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "tiny-llama"]),
                    supported_tasks=("generate",))
    node, chain, middleware = app.build_middleware_stack(), [], None
    while node is not None:
        chain.append(type(node).__name__)
        if isinstance(node, PrometheusInstrumentatorMiddleware):
            middleware = node
        node = getattr(node, "app", None)
    assert middleware is not None, f"vLLM's app has no HTTP metrics middleware: {chain}"
    return app, middleware, chain


def inside(args: argparse.Namespace) -> None:
    from benchmarks.common import write_result
    from service.after_requests import after_requests
    from service.engine.vllm_http_metrics import Exchange, unlinked

    app, middleware, chain = vllms_middleware()

    async def stand_in(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(args.stream_tokens):
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    middleware.app = stand_in
    below, http = unlinked(middleware)
    assert below is stand_in and http is not None, "vLLM's middleware is one the contract can take off the path"

    async def recorded(scope, receive, send) -> None:  # what the passthrough adds for these metrics
        exchange = Exchange(scope, time.perf_counter())

        def sending(message):
            if message["type"] == "http.response.start":
                exchange.started(message)
            return send(message)
        await stand_in(scope, receive, sending)
        http.record(exchange)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"80")], "app": app,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message) -> None:
        pass

    def per_request_us(target) -> float:
        """Microseconds a request, the best of 5 runs of `--requests` one after the other."""
        async def run() -> None:
            for _ in range(args.requests):
                await target(dict(scope), receive, send)
        best = float("inf")
        for _ in range(5):
            began = time.perf_counter()
            asyncio.run(run())
            best = min(best, time.perf_counter() - began)
            after_requests.flush()  # the queued records: timed below
        return best / args.requests * 1e6

    alone, vllms, contracts = per_request_us(stand_in), per_request_us(middleware), per_request_us(recorded)

    async def queue() -> None:
        for _ in range(args.requests):
            await recorded(dict(scope), receive, send)
    asyncio.run(queue())
    began = time.perf_counter()
    after_requests.flush()
    deferred = (time.perf_counter() - began) / args.requests * 1e6
    result = {"vllm_app_chain": chain, "vllm_routes": len(app.routes), "requests": args.requests,
              "stream_tokens": args.stream_tokens, "stand_in_alone_us": round(alone, 1),
              "vllms_middleware_on_the_path_us": round(vllms - alone, 1),
              "contracts_record_on_the_path_us": round(contracts - alone, 1),
              "contracts_record_after_the_request_us": round(deferred, 1)}
    print(json.dumps(result, indent=2))
    print(write_result("vllm_http_metrics", result, args.out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # in the vLLM image
    args = parser.parse_args()
    inside(args) if args.inside else on_host(args)


if __name__ == "__main__":
    sys.exit(main())
