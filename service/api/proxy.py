"""Inference routes in front of an engine process: requests pass through, streams as they arrive.

The runtime keeps what the contract promises (auth, request ids, body limit, 503 while loading or
past NIM_MAX_QUEUE, drain, metrics with NIM's names that equal the usage clients received); the
engine validates parameters and serves its extra features (tools, response_format, embeddings,
/tokenize, /v1/responses). A client that goes away closes the upstream connection, which aborts
the request in the engine.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from service.api.context import cancel_on_disconnect, runtime
from service.api.errors import ServingError
from service.api.openapi import REQUESTS, STREAMED, request_body
from service.engine.base import ProcessEngine

# Routes the engine serves; those marked True generate tokens (metrics, queue bound).
PROXIED = {"/v1/chat/completions": True, "/v1/completions": True, "/v1/responses": True,
           "/v1/embeddings": False, "/tokenize": False, "/detokenize": False, "/v1/score": False,
           "/v1/rerank": False, "/pooling": False, "/classify": False}
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "host", "authorization"}
RETRY = {"Retry-After": "1"}
RESPONSE_ENDS = {"response.completed": "stop", "response.incomplete": "length", "response.failed": "error"}


@dataclass
class Observed:
    """What the runtime's metrics need of one proxied generation."""

    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)
    usage: dict | None = None
    finish: str | None = None
    ended: bool = False  # the stream's final event passed: a disconnect after it is no abort

    def chunk(self, event: dict) -> None:
        now = time.perf_counter()
        if event.get("type") in RESPONSE_ENDS:  # /v1/responses: the final event carries the usage
            self.ended = True
            self.usage = _counts((event.get("response") or {}).get("usage"))
            self.finish = RESPONSE_ENDS[event["type"]]
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
            if _has_output(choice):
                if self.first is None:
                    self.first = now
                elif self.last is not None:
                    self.gaps.append(now - self.last)
                self.last = now
        if event.get("usage"):
            self.usage = _counts(event["usage"])

    def record(self, metrics, failure: str | None = None) -> None:
        usage = self.usage or {}
        reason = failure or self.finish or "stop"
        if failure is None and not usage:
            return  # nothing was generated (an engine 4xx): as the in-process path, not counted
        metrics.record(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                       generation_tokens=int(usage.get("completion_tokens") or 0),
                       finished_reason=reason if reason in ("stop", "length", "abort", "error") else "stop",
                       ttft=None if self.first is None else self.first - self.start, token_gaps=self.gaps,
                       e2e=time.perf_counter() - self.start)


def _counts(usage: dict | None) -> dict | None:
    """Usage in chat/completions terms; /v1/responses names its counts input/output_tokens."""
    if not usage or "input_tokens" not in usage:
        return usage
    return {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens")}


def _has_output(choice: dict) -> bool:
    delta = choice.get("delta") or {}
    return bool(choice.get("text") or delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


def _headers(request: Request) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
    headers["x-request-id"] = request.state.request_id
    return headers


def attach_proxy(router: APIRouter) -> None:
    """The engine's routes; chat and completions documented with the bodies and answers of the
    contract (the engine takes more: its own features pass through)."""
    for path in PROXIED:
        documented = {"openapi_extra": request_body(path), "responses": STREAMED[path]} if path in REQUESTS else {}
        router.add_api_route(path, forward, methods=["POST"], include_in_schema=True,
                             summary=f"{path}, served by the engine process", **documented)


async def forward(request: Request) -> Response:
    rt = runtime(request)
    engine: ProcessEngine = rt.engine  # type: ignore[assignment]
    path = request.url.path
    generates = PROXIED[path]
    if not rt.ready:
        raise ServingError(503, rt.not_ready_reason(), headers=RETRY)
    body = await request.body()
    payload = _json(body)
    streaming = isinstance(payload, dict) and payload.get("stream") is True
    wants_usage = streaming and bool((payload.get("stream_options") or {}).get("include_usage"))
    if streaming and generates and path != "/v1/responses":
        payload["stream_options"] = {**(payload.get("stream_options") or {}), "include_usage": True}
        body = json.dumps(payload).encode()
    if query := request.url.query:
        path = f"{path}?{query}"
    observed = Observed()
    rt.admission.enter(bounded=generates)
    try:
        response = await cancel_on_disconnect(request, _post(engine.client, path, body, _headers(request)))
    except Exception as exc:
        rt.admission.leave()
        if generates:
            observed.record(rt.metrics, "error")
        raise ServingError(503, f"the engine did not answer: {type(exc).__name__}", headers=RETRY) from None
    if isinstance(response, Response):  # the client went away before the engine answered
        rt.admission.leave()
        if generates:
            observed.record(rt.metrics, "abort")
        return response
    media = response.headers.get("content-type", "application/json")
    if not media.startswith("text/event-stream"):
        try:
            content = await response.read()
        finally:
            response.release()
            rt.admission.leave()
        if generates and response.status == 200:
            reply = _json(content) or {}
            observed.usage = _counts(reply.get("usage"))
            observed.finish = next((c.get("finish_reason") for c in reply.get("choices") or []), None)
            observed.record(rt.metrics)
        elif generates and response.status >= 500:
            observed.record(rt.metrics, "error")
        if response.status >= 400:
            content, media = openai_error(response.status, content), "application/json"
        return Response(content, status_code=response.status, media_type=media)
    return StreamingResponse(_relay(rt, response, observed, wants_usage or not generates),
                             status_code=response.status, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _post(client, path: str, body: bytes, headers: dict[str, str]):
    """The engine's response, its headers read and its body not yet (an aiohttp ClientResponse)."""
    return await client.post(path, data=body, headers=headers)


async def _relay(rt, response, observed: Observed, keep_usage_chunk: bool):
    """SSE events as they arrive: what one read from the engine brought is sent on in one piece, the
    events' bytes as the engine wrote them; the usage-only chunk the runtime asked for is dropped
    when the client did not ask for it. The request is settled (metrics, in flight) before its final
    event is sent, so a client that has it sees metrics that count it and may close at once."""
    settled = False

    def settle(failure: str | None) -> None:
        nonlocal settled
        if not settled:
            settled = True
            rt.admission.leave()
            observed.record(rt.metrics, failure)

    failure, pending = "abort", b""
    try:
        async for data in response.content.iter_any():
            *events, pending = (pending + data).replace(b"\r\n", b"\n").split(b"\n\n")
            out = b"".join(_event(raw, observed, keep_usage_chunk) for raw in events)
            if observed.ended:
                settle(None)
            if out:
                yield out
        if pending.strip() and (last := _event(pending, observed, keep_usage_chunk)):
            yield last
        failure = None
    except Exception:
        failure = "error"
        raise
    finally:
        settle(failure)
        if failure is None:
            response.release()
        else:
            response.close()  # closes the connection: the engine sees the client go and aborts


def _event(raw: bytes, observed: Observed, keep_usage_chunk: bool) -> bytes:
    """One SSE event (its lines, without the blank line that ends it), observed for metrics; the
    bytes to send on, empty to drop it."""
    if not raw:
        return b""
    for line in raw.split(b"\n"):
        if line == b"data: [DONE]":
            observed.ended = True
        elif line.startswith(b"data: {"):
            event = _json(line[6:]) or {}
            observed.chunk(event)
            if not keep_usage_chunk and event.get("usage") and not event.get("choices"):
                return b""
    return raw + b"\n\n"


def openai_error(status: int, content: bytes) -> bytes:
    """The engine's error body in the OpenAI shape the contract promises: passed on as it is when
    it has that shape already; else (FastAPI's `{"detail": ...}` for a route the model does not
    serve, plain text) its message wrapped."""
    body = _json(content)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return content
    detail = body.get("detail") if isinstance(body, dict) else None
    message = detail if isinstance(detail, str) else json.dumps(detail) if detail else content.decode(errors="replace")
    return ServingError(status, message.strip()[:2000] or f"HTTP {status} from the engine").body().model_dump_json().encode()


def _json(body: bytes):
    try:
        return json.loads(body)
    except ValueError:
        return None
