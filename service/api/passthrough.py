"""Inference routes served by an engine's own OpenAI app in this process (vLLM's), observed on the way.

The contract keeps what it promises around them (auth, request ids, body limit, 503 while loading or
draining, metrics with NIM's names that equal the usage clients received); the engine validates
parameters, bounds its queue and serves its extra features (tools, response_format, embeddings,
/tokenize, /v1/responses). The engine's app reads the client's disconnect itself and aborts.

The routes are pure ASGI, taken before any routing (service/vllm_contract.py): on the token path
the contract costs one wrapped `send` per event, which finds a token's event by its choice's null
finish reason and sends it to the client's own `send`, or else finds by regular expressions what
carries output and what may end a request (a finish reason, usage, a /v1/responses end), the only
events parsed, once the request has ended (service.after_requests); the times of the tokens' events
are kept (TTFT, the gaps between tokens). vLLM's own HTTP metrics, whose middleware the contract takes
off the path, are recorded then too (service.engine.vllm_http_metrics).
"""

from __future__ import annotations

import asyncio
import json
import operator
import re
from collections.abc import Awaitable
from dataclasses import dataclass, field
from time import perf_counter

from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.requests import ClientDisconnect

from service.admission import Admission
from service.after_requests import after_requests
from service.api.errors import RETRY_AFTER_SECONDS, ServingError, allowed_beside, empty_prompt, from_exception
from service.api.middleware import send_error
from service.api.openapi import ERRORS, REQUESTS, STREAMED, request_body
from service.engine.base import PassthroughEngine, RequestTooLargeError
from service.engine.grammar import alternatives, ebnf_rules, width_refused
from service.engine.vllm_http_metrics import Exchange

# Routes the engine serves; those marked True generate tokens (metrics).
PASSED = {"/v1/chat/completions": True, "/v1/completions": True, "/v1/responses": True,
          "/v1/embeddings": False, "/tokenize": False, "/detokenize": False, "/v1/score": False,
          "/v1/rerank": False, "/pooling": False, "/classify": False}
RETRY = {"Retry-After": RETRY_AFTER_SECONDS}
GONE = (ClientDisconnect, asyncio.CancelledError, OSError)  # how a client's leaving reaches the app
RESPONSE_ENDS = {"response.completed": "stop", "response.incomplete": "length", "response.failed": "error"}
# An event with output: text, content, reasoning or a /v1/responses delta that is not empty, or tool calls.
OUTPUT = re.compile(rb'"(?:text|content|reasoning_content|reasoning|delta)":"[^"]|"tool_calls":\[\{')
# An event that may end a request or carry its usage: parsed.
MAY_END = re.compile(rb'"finish_reason":"|"usage":\{|"type":"response\.(?:completed|incomplete|failed)"')
NOT_ENDING = b'"finish_reason":null'  # a chat or completions event of a choice that goes on
USAGE = b'"usage":{'  # what MAY_END finds in an event with usage
# Where each route takes a constraint of its output (vLLM compiles them with xgrammar): their bodies
# are parsed to check them (`_refused_before_the_engine`). A textual look first would cost as much
# as the parse of a 1 KB body (3.7 us) and miss keys written with escapes ("any\u004ff").
CONSTRAINED = {"/v1/chat/completions": ("structured_outputs", "response_format", "tools"),
               "/v1/completions": ("structured_outputs", "response_format"), "/v1/responses": ("text", "tools")}
ALLOWED_TOKEN_ROUTES = ("/v1/chat/completions", "/v1/completions")  # where vLLM takes allowed_token_ids
LAX_BOOL = TypeAdapter(bool)  # how vLLM's request models read a boolean: "true", "no", 1, 0.0 too
LAX_INT = TypeAdapter(int)  # and an integer: "3", 3.0


@dataclass
class Observed:
    """What the runtime's metrics need of one generation."""

    start: float = field(default_factory=perf_counter)
    outputs: list[float] = field(default_factory=list)  # when each token's event was sent on (see _events)
    usage: dict | None = None
    finish: str | None = None
    model: str | None = None  # the id the engine answered for: a LoRA adapter's, or the base model's
    endings: list[bytes | dict] = field(default_factory=list)  # events that may end it, read once it has
    end: float = 0.0

    def ending(self, event: dict) -> None:
        if isinstance(event.get("model"), str):
            self.model = event["model"]
        if event.get("type") in RESPONSE_ENDS:  # /v1/responses: the final event carries the usage
            self.usage = _counts((event.get("response") or {}).get("usage"))
            self.finish = RESPONSE_ENDS[event["type"]]
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        if event.get("usage"):
            self.usage = _counts(event["usage"])

    def record(self, metrics, failure: str | None = None) -> None:
        """Counted off the request's path (service.after_requests), its last events read then."""
        self.end = perf_counter()
        after_requests.add(self._count, metrics, failure)

    def _count(self, metrics, failure: str | None) -> None:
        for event in self.endings:
            self.ending(event if isinstance(event, dict) else _json(_data(event)) or {})
        usage = self.usage or {}
        reason = failure or self.finish or "stop"
        if failure is None and not usage:
            return  # nothing was generated (an engine 4xx): as the in-process path, not counted
        times, generated = self.outputs, int(usage.get("completion_tokens") or 0)
        gaps = list(map(operator.sub, times[1:], times))
        if times and generated > len(times):  # tokens that came in one event: no time between them
            gaps += [0.0] * (generated - len(times))
        metrics.count(prompt_tokens=int(usage.get("prompt_tokens") or 0), generation_tokens=generated,
                      finished_reason=reason if reason in ("stop", "length", "abort", "error") else "stop",
                      ttft=times[0] - self.start if times else None, token_gaps=gaps,
                      e2e=self.end - self.start, model_name=self.model)


def _counts(usage: dict | None) -> dict | None:
    """Usage in chat/completions terms; /v1/responses names its counts input/output_tokens."""
    if not usage or "input_tokens" not in usage:
        return usage
    return {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens")}


class PassthroughApp:
    """The engine's inference routes, as ASGI: no router or exception layers on the token path."""

    def __init__(self, rt) -> None:
        self.rt = rt

    async def __call__(self, scope, receive, send) -> None:
        rt, path = self.rt, scope["path"]
        if scope["method"] != "POST":
            return await send_error(send, ServingError(405, f"{scope['method']} is not allowed on {path}: POST",
                                                       headers={"Allow": "POST"}))
        if not rt.ready:
            return await send_error(send, ServingError(503, rt.not_ready_reason(), headers=RETRY))
        body = await _read_body(receive)
        if body is None:
            return  # the client went away before its request was read
        payload = _object(body) if path in CONSTRAINED else None  # 3.7 us for a 1 KB body
        if (refused := _refused_before_the_engine(path, payload) or _no_tokens(path, payload)
                or _allowed_beside_constraint(path, payload) or _too_large(path, payload, rt.admission)) is not None:
            return await send_error(send, refused)
        generates = PASSED[path]
        body, keep_usage = _asking_for_usage(body, payload, generates and path != "/v1/responses")
        rt.admission.enter(bounded=False)  # counted for the drain; the engine bounds its own queue
        await Passthrough(rt, body, generates, keep_usage, path != "/v1/responses")(scope, receive, send)


async def _read_body(receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def documented_routes() -> list[APIRoute]:
    """The OpenAPI document's entries for these routes, chat and completions with the bodies and
    answers of the contract (the engine takes more: its own features pass through). Only the
    document reads them: PassthroughApp serves the paths, before any routing."""
    router = APIRouter(responses=ERRORS)
    for path in PASSED:
        documented = {"openapi_extra": request_body(path), "responses": STREAMED[path]} if path in REQUESTS else {}
        router.add_api_route(path, _documented, methods=["POST"], summary=f"{path}, served by the engine",
                             **documented)
    return list(router.routes)


async def _documented(request: Request) -> Response:
    raise ServingError(500, "a route of the OpenAPI document only")  # never routed to: see documented_routes


def _object(body: bytes) -> dict | None:
    """The request's JSON object; None for anything else, which the engine answers (with its 400)."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):  # nested past the parser's depth too
        return None
    return payload if isinstance(payload, dict) else None


def _refused_before_the_engine(path: str, payload: dict | None) -> ServingError | None:
    """A 400 for input that would harm the engine or that it would answer with a 500. vLLM 0.32's
    chat and completions requests call `.get` on `structured_outputs` before validating it, so
    anything but an object (a list, a string) fails inside vLLM. A constraint wider than xgrammar's
    matcher serves (`service.engine.grammar.too_wide`) stalls vLLM's engine core, every request
    with it: a stream of vLLM's own server stalled 10.3 s beside one 400 KB schema
    (benchmarks.structured_outputs, its wide_union part)."""
    if payload is None or path not in CONSTRAINED:
        return None
    value = payload.get("structured_outputs")
    if value is not None and not isinstance(value, dict) and "structured_outputs" in CONSTRAINED[path]:
        return ServingError(400, f"structured_outputs must be an object, not {type(value).__name__}",
                            "structured_outputs")
    for param in CONSTRAINED[path]:
        if param not in payload:
            continue
        value = payload[param]
        grammars = ebnf_rules(value) if param in ("structured_outputs", "response_format") else 0
        tools = len(value) if param == "tools" and isinstance(value, list) else 0  # vLLM's `required`: a union of them
        if (reason := width_refused(grammars, tools + alternatives(value))) is not None:
            return ServingError(400, f"{param}: the constraint cannot be compiled: {reason}", param)
    return None


def _no_tokens(path: str, payload: dict | None) -> ServingError | None:
    """The torch runtime's 400 for a completions text prompt of no tokens (an empty text without
    special tokens): vLLM 0.32 takes it, then fails inside a stream's generator (an ERROR with a
    traceback in its log, an error event after a 200 to the client)."""
    if path != "/v1/completions" or payload is None or _flag(payload.get("add_special_tokens", True)) is not False:
        return None
    prompt = payload.get("prompt")
    if "" in ([prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []):
        return empty_prompt()
    return None


def _allowed_beside_constraint(path: str, payload: dict | None) -> ServingError | None:
    """The torch runtime's 400 for allowed_token_ids beside a constraint of the reply (errors.allowed_beside):
    a JSON schema, a choice or a required tool call whose tokens the allowed ids leave out is a 500 from
    vLLM 0.32 (its grammar rejects the token sampled from nothing)."""
    if payload is None or payload.get("allowed_token_ids") is None or path not in ALLOWED_TOKEN_ROUTES:
        return None
    if payload.get("structured_outputs") is not None:
        return allowed_beside("structured_outputs")
    if isinstance(fmt := payload.get("response_format"), dict) and fmt.get("type", "text") != "text":
        return allowed_beside("response_format")
    if path == "/v1/chat/completions" and payload.get("tools") and payload.get("tool_choice") != "none":
        return allowed_beside("tools")
    return None


def _too_large(path: str, payload: dict | None, admission: Admission) -> ServingError | None:
    """A 400 for a chat or completions request of more sequences (prompts x n) than vLLM's queue
    bound: it counts each against `--max-num-queued-reqs`, and would answer 503 "busy, try again
    later" to a request that no wait admits (the torch runtime's 400, NIM_MAX_SEQS_PER_REQUEST)."""
    if payload is None or path not in ("/v1/chat/completions", "/v1/completions"):
        return None
    try:
        n = 1 if payload.get("n") is None else LAX_INT.validate_python(payload["n"])
    except ValidationError:
        return None  # vLLM's 400
    prompt = payload.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    try:
        admission.check_size(prompts, n, together=False)
    except RequestTooLargeError as exc:
        return from_exception(exc)
    return None


def _asking_for_usage(body: bytes, payload: dict | None, rewrite: bool) -> tuple[bytes, bool]:
    """A stream of chat or completions always asks the engine for its usage (the metrics count it);
    whether the client asked too, so the usage-only event can be dropped when it did not. `stream`
    and `include_usage` are read as vLLM reads them (`"stream": "true"` streams); a body vLLM will
    refuse is passed on as it is, for its 400."""
    if not rewrite or payload is None or _flag(payload.get("stream")) is not True:
        return body, True
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return body, True
    asked = _flag((options or {}).get("include_usage"))
    if asked is None:
        return body, True
    if not asked:
        payload["stream_options"] = {**(options or {}), "include_usage": True}
        body = json.dumps(payload).encode()
    return body, asked


def _flag(value) -> bool | None:
    """`value` as vLLM's request models read a boolean, absent or null as False; None where they
    refuse it."""
    if value is None or isinstance(value, bool):
        return bool(value)
    try:
        return LAX_BOOL.validate_python(value)
    except ValidationError:
        return None


class Passthrough:
    """The engine's own answer to one request, sent on as it is made; observed for the metrics, its
    errors in the OpenAI shape, its 503s with Retry-After."""

    def __init__(self, rt, body: bytes, generates: bool, keep_usage: bool, token_per_event: bool = True) -> None:
        self.rt, self.body, self.generates, self.keep_usage = rt, body, generates, keep_usage
        self.token_per_event = token_per_event  # see _events
        self.observed = Observed()

    async def __call__(self, scope, receive, send) -> None:
        engine: PassthroughEngine = self.rt.engine
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"x-request-id")]
        headers += [(b"content-length", str(len(self.body)).encode()),
                    (b"x-request-id", scope["state"]["request_id"].encode())]
        inner = {**scope, "app": engine.root_app, "headers": headers}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": self.body, "more_body": False}
            return await receive()  # the client's disconnect reaches the engine, which aborts

        self.client, self.sending, self.status, self.held, self.settled = send, None, 200, [], False
        self.exchange = Exchange(inner, self.observed.start)  # for the engine app's HTTP metrics
        failure = "abort"  # the engine's app returned without a last event: its client went away
        try:
            await engine.app(inner, replay, self._send)
        except BaseException as exc:
            failure = "abort" if isinstance(exc, GONE) else "error"
            raise
        finally:
            self._settle(failure)  # nothing when the answer was sent whole
            if engine.http_metrics is not None:
                engine.http_metrics.record(self.exchange)

    def _settle(self, failure: str | None) -> None:
        """The request is over for the metrics and the drain: once, before its last byte is sent."""
        if not self.settled:
            self.settled = True
            self.rt.admission.leave()
            if self.generates and (failure or self.status < 400 or self.status >= 500):
                self.observed.record(self.rt.metrics, failure or ("error" if self.status >= 500 else None))

    def _send(self, message) -> Awaitable[None]:
        """The engine app's `send`, called once an event on the token path. A token's event (see
        _events) is timed and handed to the client's own `send`, below the request id's layer; this
        is no coroutine but returns the client's, which the engine's app awaits: one coroutine an
        event fewer. NOT_ENDING is looked for from the end of the event, where vLLM writes the
        finish reason (`rfind`: 80 ns against 235 for `in` on a completions event). With both,
        0.42-0.43 us of the API server's CPU an event against 0.78-0.81
        (benchmarks.passthrough_overhead, 3 runs each, alternating)."""
        if self.token_per_event and (outputs := self.observed.outputs) and message.get("more_body") \
                and message.get("body", b"").rfind(NOT_ENDING) >= 0:  # after the first output, a token's event
            outputs.append(perf_counter())
            return self.client(message)
        return self._send_other(message)

    async def _send_other(self, message) -> None:
        """Every message but a token's event: the headers, the other events, a whole answer."""
        if self.sending == "events" and message["type"] == "http.response.body":
            if self.generates:
                message["body"] = self._events(message.get("body", b""))
            if not message.get("more_body", False):
                self._settle(None)
                self.sending = "done"
            return await self.client(message)
        send = self.client
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.exchange.started(message)
            media = dict(message.get("headers", [])).get(b"content-type", b"")
            self.sending = "error" if self.status >= 400 else "events" if media.startswith(b"text/event-stream") \
                else "whole"
            if self.sending == "events":
                await send(message)
                self.client = getattr(send, "raw", send)  # the headers are sent: the events skip the id's layer
                return
            self.held = [message]
            return
        if message["type"] != "http.response.body":
            return await send(message)
        self.held.append(message)
        if not message.get("more_body", False):
            await self._send_whole(send)

    def _events(self, data: bytes) -> bytes:
        """SSE events as the engine wrote them (whole events, one per message as vLLM sends them),
        observed; the usage-only event the runtime asked for is dropped when the client did not ask.

        After the first output of a chat or completions stream, vLLM sends an event a token (its text
        held back or not) until the one that ends it, each with its choice's finish reason null: such
        an event is a token's, found by NOT_ENDING at a third of the cost of the regular expressions,
        and _send takes it before it comes here. Where vLLM's API server falls behind its engine, one
        event carries the tokens made meanwhile (vLLM's RequestOutputCollector merges them): the
        usage tells how many, and the metrics count them a gap of zero each (Observed._count).
        Every other event (a chat stream's role first, the last ones, all of a /v1/responses
        stream, whose events also tell of its items) carries output where OUTPUT finds it, and is
        kept where MAY_END finds what may end the request, to be parsed once it has ended
        (Observed.record), off its path; only a usage event the client did not ask for is parsed
        here, to be dropped. The usage a token's event may carry too (with `continuous_usage_stats`)
        is the final usage event's, later, to the same count."""
        if OUTPUT.search(data):
            self.observed.outputs.append(perf_counter())
        if not MAY_END.search(data):
            return data
        out = []
        for raw in data.split(b"\n\n"):
            if not raw:
                continue
            if not self.keep_usage and USAGE in raw:  # the usage-only event the client did not ask for?
                event = _json(_data(raw)) or {}
                self.observed.endings.append(event)
                if event.get("usage") and not event.get("choices"):
                    continue
            else:
                self.observed.endings.append(raw)
            out.append(raw + b"\n\n")
        return b"".join(out)

    async def _send_whole(self, send) -> None:
        """A whole answer (JSON, or an error): observed, errors rewritten, then sent."""
        start, *parts = self.held
        content = b"".join(part.get("body", b"") for part in parts)
        headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
        if self.sending == "error":
            content = openai_error(self.status, content)
            headers = [(k, v) for k, v in headers if k != b"content-type"] + [(b"content-type", b"application/json")]
            if self.status == 503:
                headers.append((b"retry-after", RETRY_AFTER_SECONDS.encode()))
        elif self.generates:
            reply = _json(content) or {}
            self.observed.usage = _counts(reply.get("usage"))
            self.observed.model = reply.get("model") if isinstance(reply.get("model"), str) else None
            self.observed.finish = next((c.get("finish_reason") for c in reply.get("choices") or []), None)
        self._settle(None)
        self.sending = "done"
        await send({**start, "headers": headers + [(b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content, "more_body": False})


def _data(raw: bytes) -> bytes:
    """The JSON of an event's `data:` line (an event may name its type on an `event:` line first)."""
    if raw.startswith(b"data: {") and b"\n" not in raw:
        return raw[6:]  # chat's and completions' events: one line
    return next((line[6:] for line in raw.split(b"\n") if line.startswith(b"data: {")), b"")


def openai_error(status: int, content: bytes) -> bytes:
    """The engine's error body in the OpenAI shape the contract promises: passed on as it is when
    it has that shape already; else (FastAPI's `{"detail": ...}`, plain text) its message wrapped."""
    body = _json(content)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        if status == 404:  # on an inference route, only the model can be unknown: OpenAI's code for it
            return json.dumps({"error": {**body["error"], "param": "model", "code": "model_not_found"}}).encode()
        return content
    detail = body.get("detail") if isinstance(body, dict) else None
    message = detail if isinstance(detail, str) else json.dumps(detail) if detail else content.decode(errors="replace")
    return ServingError(status, message.strip()[:2000] or f"HTTP {status} from the engine").body().model_dump_json().encode()


def _json(body: bytes):
    try:
        return json.loads(body)
    except ValueError:
        return None
