"""vLLM's HTTP metrics for the inference routes, recorded once a request has ended, off its path.

vLLM's app adds prometheus-fastapi-instrumentator's middleware, whose default metrics are
`http_requests_total`, `http_request_size_bytes`, `http_response_size_bytes`,
`http_request_duration_seconds` and `http_request_duration_highr_seconds`. On the path of every
request it matches the path against vLLM's routes one by one to name the handler, builds a Request
and a Response, records five metrics and wraps `send` for every event: on the API server's event
loop, where at c=32 each 10 us a request costs about 0.6% of TTFT p50 (docs/vllm-contract-cost.md).
The contract sees every request that reaches vLLM's app end (service/api/passthrough.py), so it takes
that middleware out of the chain below it and records the same metrics, through the middleware's own
handler naming and instrumentations, in the bookkeeping done after requests (service.after_requests):
the same series, labels and values, recorded up to DEFER_S later (before any scrape of this process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response

from service.after_requests import after_requests

CHAIN_DEPTH = 64  # middlewares followed below the contract before giving up


@dataclass
class Exchange:
    """What the instrumentator's middleware would have seen of one request: its scope as vLLM's app
    got it, the response's start as vLLM sent it, and the times (perf_counter, the middleware's clock)."""

    scope: dict
    start: float
    status: int = 500  # the middleware's, where vLLM's app raised before it answered
    headers: list = field(default_factory=list)
    answered: float | None = None
    end: float = 0.0

    def started(self, message: dict) -> None:
        self.status, self.headers, self.answered = message["status"], message.get("headers", []), perf_counter()


class HttpMetrics:
    """The instrumentator middleware's recording, made after the request (the body of its
    `__call__`'s `finally`, for the configuration `deferrable` admits)."""

    def __init__(self, middleware: Any) -> None:
        self.middleware = middleware

    def record(self, exchange: Exchange) -> None:
        exchange.end = perf_counter()
        after_requests.add(self._record, exchange)

    def _record(self, exchange: Exchange) -> None:
        from prometheus_fastapi_instrumentator.metrics import Info  # in vLLM's images only

        m = self.middleware
        request = Request(exchange.scope)
        handler, templated = m._get_handler(request)
        if m._is_handler_excluded(handler, templated):
            return
        handler = "none" if not templated and m.should_group_untemplated else handler
        duration = max(exchange.end - exchange.start, 0.0)
        before_streaming = max(exchange.answered - exchange.start, 0.0) if exchange.answered else 0.0
        if m.should_round_latency_decimals:
            duration = round(duration, m.round_latency_decimals)
            before_streaming = round(before_streaming, m.round_latency_decimals)
        status = str(exchange.status)
        status = status[0] + "xx" if m.should_group_status_codes else status
        response = Response(content=b"", headers=Headers(raw=exchange.headers), status_code=exchange.status)
        info = Info(request=request, response=response, method=request.method, modified_handler=handler,
                    modified_status=status, modified_duration=duration,
                    modified_duration_without_streaming=before_streaming)
        for instrumentation in m.instrumentations:
            instrumentation(info)


def deferrable(middleware: Any) -> bool:
    """Whether its recording can wait for the request's end: not with a gauge of requests in
    progress, asynchronous instrumentations or response bodies to read (none of them vLLM's)."""
    return not (middleware.should_instrument_requests_inprogress or middleware.async_instrumentations
                or middleware.body_handlers)


def unlinked(app: Any) -> tuple[Any, HttpMetrics | None]:
    """`app` (vLLM's ASGI chain below the contract) without the instrumentator's middleware, and
    what records its metrics instead; `app` as it is where there is none, or one that must stay."""
    try:
        from prometheus_fastapi_instrumentator.middleware import PrometheusInstrumentatorMiddleware
    except ImportError:
        return app, None
    parent, node = None, app
    for _ in range(CHAIN_DEPTH):
        if node is None:
            break
        if isinstance(node, PrometheusInstrumentatorMiddleware):
            if not deferrable(node):
                break
            if parent is None:
                return node.app, HttpMetrics(node)
            parent.app = node.app  # the middlewares above it (CORS, vLLM's scaling check) stay
            return app, HttpMetrics(node)
        parent, node = node, getattr(node, "app", None)
    return app, None
