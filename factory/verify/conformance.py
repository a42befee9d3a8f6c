"""Conformance: the OpenAI API behaviours the contract promises, each a check with an id.

Checks in the `openai` group hold for any OpenAI-compatible server; the `nim` group adds NIM's
management routes. A check fails with an AssertionError whose message says what was wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal

import httpx
import openai
import yaml
from openai import OpenAI
from pydantic import BaseModel, Field

from factory.verify.result import Gate

PROMPT = "The capital of France is"


@dataclass
class Context:
    url: str
    model: str

    def __post_init__(self) -> None:
        self.client = OpenAI(base_url=f"{self.url}/v1", api_key="harness", max_retries=0, timeout=120)
        self.http = httpx.Client(base_url=self.url, timeout=120)


@dataclass(frozen=True)
class Check:
    id: str
    group: str
    run: Callable[[Context], None]


CHECKS: list[Check] = []


def check(id: str, group: str = "openai"):
    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        CHECKS.append(Check(id, group, fn))
        return fn
    return register


def sse_lines(ctx: Context, route: str, body: dict) -> list[str]:
    with ctx.http.stream("POST", route, json=body) as response:
        assert response.status_code == 200, f"{route} stream answered {response.status_code}"
        assert response.headers.get("content-type", "").startswith("text/event-stream"), "not text/event-stream"
        return [line for line in response.iter_lines() if line]


def assert_error_shape(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, f"expected {status}, got {response.status_code}: {response.text[:200]}"
    error = response.json().get("error")
    assert isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error), \
        f"error body is not OpenAI-shaped: {response.text[:200]}"


@check("models.list")
def _models(ctx: Context) -> None:
    ids = [m.id for m in ctx.client.models.list().data]
    assert ctx.model in ids, f"{ctx.model!r} not in /v1/models {ids}"


@check("chat.basic")
def _chat(ctx: Context) -> None:
    reply = ctx.client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str), "no assistant message"
    assert choice.finish_reason in ("stop", "length"), f"finish_reason {choice.finish_reason!r}"
    u = reply.usage
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and 0 < u.completion_tokens <= 8, f"usage {u}"


@check("completions.basic")
def _completion(ctx: Context) -> None:
    reply = ctx.client.completions.create(model=ctx.model, prompt=PROMPT, max_tokens=5, temperature=0)
    assert reply.object == "text_completion" and isinstance(reply.choices[0].text, str), "no completion text"
    assert reply.usage.completion_tokens <= 5, f"usage {reply.usage}"


@check("usage.exact_length")
def _usage_length(ctx: Context) -> None:
    reply = ctx.client.completions.create(model=ctx.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                          logprobs=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length", f"finish_reason {reply.choices[0].finish_reason!r}"
    assert reply.usage.completion_tokens == 6, f"completion_tokens {reply.usage.completion_tokens} for max_tokens=6"
    assert len(reply.choices[0].logprobs.tokens) == 6, "logprobs do not list one entry per counted token"


@check("chat.stream.framing")
def _chat_stream(ctx: Context) -> None:
    lines = sse_lines(ctx, "/v1/chat/completions", {"model": ctx.model, "messages": [{"role": "user", "content": PROMPT}],
                                                    "max_tokens": 8, "temperature": 0, "stream": True})
    assert all(line.startswith("data: ") for line in lines), "a line without the `data: ` prefix"
    assert lines[-1] == "data: [DONE]", f"the stream does not end with data: [DONE] (last: {lines[-1][:80]})"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks), "chunk object is not chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant", "first delta has no assistant role"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length"), "no finish_reason in the last chunk"


@check("completions.stream.usage")
def _stream_usage(ctx: Context) -> None:
    body = {"model": ctx.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    whole = ctx.http.post("/v1/completions", json=body).json()
    lines = sse_lines(ctx, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert lines[-1] == "data: [DONE]", "the stream does not end with data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    final = chunks[-1]
    assert final["choices"] == [] and final.get("usage"), "no usage chunk before [DONE] with include_usage"
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # servers may add fields (vLLM: *_details)
    streamed, plain = ({k: u.get(k) for k in counts} for u in (final["usage"], whole["usage"]))
    assert streamed == plain, f"streamed usage {streamed} != non-streamed {plain}"
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["choices"][0]["text"], "streamed text differs from the non-streamed text"


@check("n.choices")
def _n(ctx: Context) -> None:
    reply = ctx.client.completions.create(model=ctx.model, prompt=PROMPT, max_tokens=4, n=3, temperature=1, seed=1)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2], "n=3 did not give choices 0, 1, 2"


@check("stop.strings")
def _stop(ctx: Context) -> None:
    plain = ctx.client.completions.create(model=ctx.model, prompt=PROMPT, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
    middle = plain[len(plain) // 2:len(plain) // 2 + 3]
    assert middle.strip(), f"output too short to test stop: {plain!r}"
    cut = ctx.client.completions.create(model=ctx.model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[middle],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == plain[:plain.index(middle)], f"stop={middle!r}: got {cut.text!r} from {plain!r}"
    assert cut.finish_reason == "stop", f"finish_reason {cut.finish_reason!r} after a stop string"


@check("seed.reproducible")
def _seed(ctx: Context) -> None:
    def sample() -> str:
        return ctx.client.completions.create(model=ctx.model, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                             seed=1234).choices[0].text
    assert sample() == sample(), "the same seed gave different samples"


@check("logprobs.chat")
def _chat_logprobs(ctx: Context) -> None:
    reply = ctx.client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens, "one logprob entry per token expected"
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in content), "bad logprob values or top list"


@check("logprobs.completions")
def _completion_logprobs(ctx: Context) -> None:
    lp = ctx.client.completions.create(model=ctx.model, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs), "ragged logprobs"


class Verdict(BaseModel):
    """The structured-output checks' schema: every value bounded, so any model can end it."""

    answer: Literal["yes", "no", "unsure"]
    confidence: Annotated[int, Field(ge=0, le=100)]


class Lookup(BaseModel):
    """The tool-call checks' function. No free-text string: xgrammar (vLLM's default backend too) lets
    control characters into a length-bounded one, and a correct server must not fail this check."""

    city: Literal["paris", "rome", "oslo"]
    days: Annotated[int, Field(ge=1, le=7)]


STRUCTURED_TOKENS = 200  # a small vocabulary spells JSON a character at a time


@check("structured.json_schema")
def _json_schema(ctx: Context) -> None:
    """Plain and streamed, the reply parses and validates (the official client's parse and stream helpers)."""
    messages = [{"role": "user", "content": f"{PROMPT} Paris? Answer in JSON."}]
    plain = ctx.client.chat.completions.parse(model=ctx.model, messages=messages, response_format=Verdict,
                                              max_tokens=STRUCTURED_TOKENS, temperature=0)
    assert plain.choices[0].finish_reason == "stop", f"finish_reason {plain.choices[0].finish_reason!r}"
    assert isinstance(plain.choices[0].message.parsed, Verdict), "the reply did not parse"
    with ctx.client.chat.completions.stream(model=ctx.model, messages=messages, response_format=Verdict,
                                            max_tokens=STRUCTURED_TOKENS, temperature=0) as stream:
        streamed = stream.get_final_completion().choices[0].message.parsed
    assert streamed == plain.choices[0].message.parsed, f"streamed {streamed} != plain {plain.choices[0].message.parsed}"


@check("tools.call", "tools")
def _tool_call(ctx: Context) -> None:
    """A required call and a named one parse with the official client; streamed deltas reassemble to the
    non-streamed call."""
    messages = [{"role": "user", "content": "What is the weather in Paris this week?"}]
    tools = [openai.pydantic_function_tool(Lookup)]
    for choice in ("required", {"type": "function", "function": {"name": "Lookup"}}):
        kwargs = dict(model=ctx.model, messages=messages, tools=tools, tool_choice=choice, parallel_tool_calls=False,
                      max_tokens=STRUCTURED_TOKENS, temperature=0)
        plain = ctx.client.chat.completions.parse(**kwargs).choices[0]
        # OpenAI ends a forced (named) call with "stop", a chosen one with "tool_calls"
        reasons = ("tool_calls",) if choice == "required" else ("stop", "tool_calls")
        assert plain.finish_reason in reasons, f"tool_choice={choice}: finish_reason {plain.finish_reason!r}"
        calls = [(c.function.name, c.function.parsed_arguments) for c in plain.message.tool_calls or []]
        assert len(calls) == 1 and isinstance(calls[0][1], Lookup), f"tool_choice={choice}: calls {calls}"
        with ctx.client.chat.completions.stream(**kwargs) as stream:
            final = stream.get_final_completion().choices[0]
        streamed = [(c.function.name, c.function.parsed_arguments) for c in final.message.tool_calls or []]
        assert streamed == calls, f"tool_choice={choice}: streamed {streamed} != plain {calls}"


@check("errors.malformed_json")
def _bad_json(ctx: Context) -> None:
    assert_error_shape(ctx.http.post("/v1/completions", content=b"{not json",
                                     headers={"content-type": "application/json"}), 400)


@check("errors.unknown_model")
def _unknown_model(ctx: Context) -> None:
    assert_error_shape(ctx.http.post("/v1/completions", json={"model": "no-such-model", "prompt": "x"}), 404)


@check("errors.bad_value")
def _bad_value(ctx: Context) -> None:
    assert_error_shape(ctx.http.post("/v1/completions", json={"model": ctx.model, "prompt": "x", "max_tokens": -1}), 400)


@check("errors.context_overflow")
def _overflow(ctx: Context) -> None:
    assert_error_shape(ctx.http.post("/v1/completions", json={"model": ctx.model, "prompt": "word " * 100000}), 400)


@check("health.live", "nim")
def _live(ctx: Context) -> None:
    response = ctx.http.get("/v1/health/live")
    assert response.status_code == 200 and response.json().get("status") == "live", response.text[:200]


@check("health.ready", "nim")
def _ready(ctx: Context) -> None:
    response = ctx.http.get("/v1/health/ready")
    assert response.status_code == 200 and response.json().get("status") == "ready", response.text[:200]


@check("nim.metadata", "nim")
def _metadata(ctx: Context) -> None:
    data = ctx.http.get("/v1/metadata").json()
    missing = {"version", "modelInfo", "selectedModelProfileId", "assetInfo", "licenseInfo"} - set(data)
    assert not missing, f"/v1/metadata lacks {sorted(missing)}"


@check("nim.manifest", "nim")
def _manifest(ctx: Context) -> None:
    manifest = yaml.safe_load(ctx.http.get("/v1/manifest").json()["manifest_file"])
    assert manifest.get("profiles"), "the manifest lists no profiles"


def run_conformance(url: str, model: str, groups: tuple[str, ...] = ("openai", "nim")) -> list[Gate]:
    ctx = Context(url, model)
    gates = []
    for item in CHECKS:
        if item.group not in groups:
            continue
        try:
            item.run(ctx)
            gates.append(Gate(id=item.id, passed=True, detail=""))
        except Exception as exc:  # any failure of the server under test is a failed check, never a crash
            message = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
            gates.append(Gate(id=item.id, passed=False, detail=message[:500]))
    return gates
