"""Pure ASGI middleware (streaming-safe, unlike BaseHTTPMiddleware): request ids, access logs, the API
key, the body limit."""

from __future__ import annotations

import json
import logging
import re
import secrets
import time

from service.after_requests import after_requests
from service.api.errors import ServingError
from service.logs import request_id_var

log = logging.getLogger("service.access")
REQUEST_ID_HEADER = b"x-request-id"
VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# What NIM_API_KEY leaves open: probes, management, metrics and the API's own description.
PUBLIC_PATHS = frozenset({"/v1/health/live", "/v1/health/ready", "/v1/metadata", "/v1/version", "/v1/manifest",
                          "/v1/metrics", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


async def send_error(send, error: ServingError) -> None:
    """Answer with the OpenAI error shape before the app has seen the request."""
    body = json.dumps(error.body().model_dump()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class IdSend:
    """The client's `send`, adding the request id to the response's headers. An app that sends
    many messages after the start (a stream's events) may send them to `raw`, the client's own:
    one call an event fewer."""

    __slots__ = ("raw", "request_id", "status")

    def __init__(self, raw, request_id: bytes) -> None:
        self.raw, self.request_id, self.status = raw, request_id, 500

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER, self.request_id)]
        await self.raw(message)


class RequestContextMiddleware:
    """Takes `X-Request-Id` (or makes one), echoes it, and logs one line per request with it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        incoming = dict(scope["headers"]).get(REQUEST_ID_HEADER, b"").decode("latin-1")
        request_id = incoming if VALID_REQUEST_ID.match(incoming) else secrets.token_hex(16)  # uuid4's hex, 1 us less
        token = request_id_var.set(request_id)
        scope.setdefault("state", {})["request_id"] = request_id
        start, send_with_id = time.perf_counter(), IdSend(send, request_id.encode())
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if log.isEnabledFor(logging.INFO):
                usage = scope["state"].get("usage")
                after_requests.add(access_line, request_id, scope["method"], scope["path"], send_with_id.status,
                                   time.perf_counter() - start, time.time(), usage.prompt_tokens if usage else None,
                                   usage.completion_tokens if usage else None)
            request_id_var.reset(token)


def access_line(request_id: str, method: str, path: str, status: int, latency_s: float, ended: float,
                prompt_tokens: int | None, completion_tokens: int | None) -> None:
    """A request's access line, logged off its path (service.after_requests), with its end's time."""
    record = log.makeRecord(log.name, logging.INFO, "(unknown file)", 0, "%s %s %s", (method, path, status), None,
                            extra={"request_id": request_id, "route": path, "method": method, "status": status,
                                   "latency_ms": round(latency_s * 1000, 2), "prompt_tokens": prompt_tokens,
                                   "completion_tokens": completion_tokens})
    record.created, record.msecs = ended, int(ended * 1000) % 1000
    log.handle(record)


class BodyLimitMiddleware:
    """413 for bodies over the limit, by Content-Length or by counting a chunked body."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(send)
        # Read the body up front (it is bounded), then replay it; later receives pass through so
        # handlers still see the client's disconnect.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._reject(send)
            chunks.append(message)
            if not message.get("more_body"):
                break
        replay = iter(chunks)

        async def replay_receive():
            return next(replay, None) or await receive()

        await self.app(scope, replay_receive, send)

    async def _reject(self, send) -> None:
        await send_error(send, ServingError(413, f"request body larger than {self.max_bytes} bytes (NIM_MAX_REQUEST_BYTES)"))


class ApiKeyMiddleware:
    """With NIM_API_KEY set, every route but `PUBLIC_PATHS` needs `Authorization: Bearer <key>`,
    checked before the body is read: a client without the key learns nothing about its body."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer" or not secrets.compare_digest(given.strip(), self.key):
            return await send_error(send, ServingError(
                401, "missing or invalid API key: send `Authorization: Bearer <NIM_API_KEY>`",
                headers={"WWW-Authenticate": "Bearer"}))
        await self.app(scope, receive, send)
