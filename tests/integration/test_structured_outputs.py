"""Structured outputs, tool calls and prompt logprobs on the torch engine, through the official client.

The tiny model knows nothing of JSON or tools: every valid reply here is the grammar's doing. Its
schemas bound every value (string lengths, integer ranges, enums), since a model that was never
taught to close a string or stop a number writes one until max_tokens, whatever the engine.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
import torch
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field

from factory.spec import AccuracyTask
from factory.tinymodel import memorised_pairs
from factory.verify.lm_eval_tasks import run_tasks
from service.launcher import ServerProcess

MODEL = "tiny-llama"
REQUESTS = 20


class Shipment(BaseModel):
    """A schema this project never used before this test."""

    carrier: Literal["ups", "dhl", "post"]
    parcels: Annotated[int, Field(ge=1, le=40)]
    fragile: bool
    label: Annotated[str, Field(max_length=12)]
    dims: Annotated[list[Annotated[int, Field(ge=0, le=99)]], Field(min_length=1, max_length=3)]


class BookRoom(BaseModel):
    hotel: Annotated[str, Field(max_length=10)]
    nights: Annotated[int, Field(ge=1, le=14)]
    breakfast: bool


class Transfer(BaseModel):
    account: Literal["checking", "savings"]
    cents: Annotated[int, Field(ge=0, le=100000)]


TOOLS = [openai.pydantic_function_tool(BookRoom), openai.pydantic_function_tool(Transfer)]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def tools_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("tools-server") / "service.log"
    with ServerProcess(["--model", str(tiny_model_dir), "--tool-call-parser", "hermes"], log_path=log) as proc:
        yield proc


@pytest.fixture(scope="module")
def oai(tools_server) -> OpenAI:
    return OpenAI(base_url=f"{tools_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(i: int) -> list[dict]:
    return [{"role": "user", "content": memorised_pairs()[i % 64][0]}]


# -- structured outputs ----------------------------------------------------------------------------
def test_json_schema_replies_parse_and_validate_plain_and_streamed(oai):
    schema = Shipment.model_json_schema()
    for i in range(REQUESTS):
        reply = oai.chat.completions.parse(model=MODEL, messages=ask(i), response_format=Shipment, max_tokens=160,
                                           temperature=1.0, seed=i)
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
        assert isinstance(reply.choices[0].message.parsed, Shipment)
        with oai.chat.completions.stream(model=MODEL, messages=ask(i), response_format=Shipment, max_tokens=160,
                                         temperature=1.0, seed=i) as stream:
            final = stream.get_final_completion()
        assert final.choices[0].message.parsed == reply.choices[0].message.parsed  # same seed, same reply


def test_json_object_and_vllms_structured_outputs(oai):
    reply = oai.chat.completions.create(model=MODEL, messages=ask(3), max_tokens=120, temperature=0,
                                        response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    cases = [({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
             ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-"),
             ({"grammar": 'root ::= "yes" | "no" | "maybe " [0-9]'}, lambda t: t in ("yes", "no") or t.startswith("maybe ")),
             ({"json": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
               "disable_any_whitespace": True}, lambda t: all(0 <= n <= 9 for n in json.loads(t)))]
    for fields, valid in cases:
        for seed in range(3):
            text = oai.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, temperature=1.0, seed=seed,
                                          extra_body={"structured_outputs": fields}).choices[0].text
            assert valid(text), f"{fields}: {text!r}"


def test_constrained_and_free_requests_decode_together(tools_server):
    """Masks are per row: a free request's greedy output is the same beside constrained ones."""
    client = AsyncOpenAI(base_url=f"{tools_server.url}/v1", api_key="unused", max_retries=0)
    prompt, expected = memorised_pairs()[9]

    async def run() -> list:
        free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        constrained = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                                 extra_body={"structured_outputs": {"regex": "[a-z ]{5,30}"}})
                       for _ in range(6)]
        return await asyncio.gather(free, *constrained)

    free, *constrained = asyncio.run(run())
    assert free.choices[0].text == expected
    for reply in constrained:
        text = reply.choices[0].text
        assert 5 <= len(text) <= 30 and set(text) <= set("abcdefghijklmnopqrstuvwxyz ")


# -- tool calls ------------------------------------------------------------------------------------
def calls_of(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or []]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "Transfer"}}])
def test_tool_calls_are_valid_plain_and_streamed(oai, choice):
    for i in range(REQUESTS):
        kwargs = dict(model=MODEL, messages=ask(i), tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                      max_tokens=200, temperature=1.0, seed=i)
        reply = oai.chat.completions.parse(**kwargs)
        choice_ = reply.choices[0]
        assert choice_.finish_reason == ("tool_calls" if choice == "required" else "stop"), choice_  # OpenAI's
        [(name, arguments)] = calls_of(choice_.message)
        if isinstance(choice, dict):
            assert name == "Transfer"
        jsonschema.validate(arguments, SCHEMAS[name])
        assert choice_.message.tool_calls[0].function.parsed_arguments is not None  # the client parsed it
        with oai.chat.completions.stream(**kwargs) as stream:
            final = stream.get_final_completion()
        assert calls_of(final.choices[0].message) == [(name, arguments)]
        assert final.choices[0].finish_reason == choice_.finish_reason


def test_streamed_deltas_follow_openais_format(oai):
    deltas = []
    for chunk in oai.chat.completions.create(model=MODEL, messages=ask(2), tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=200, temperature=0, stream=True):
        deltas += [d for choice in chunk.choices for d in choice.delta.tool_calls or []]
    first, *rest = deltas
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function" and first.function.name
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert len(rest) > 3  # arguments come in pieces as they are written
    jsonschema.validate(json.loads("".join(d.function.arguments for d in deltas)), SCHEMAS[first.function.name])


def test_tool_choice_none_and_auto_and_a_tool_result_turn(oai):
    plain = oai.chat.completions.create(model=MODEL, messages=ask(1), tools=TOOLS, tool_choice="none",
                                        max_tokens=20, temperature=0)
    assert not plain.choices[0].message.tool_calls and plain.choices[0].message.content
    auto = oai.chat.completions.create(model=MODEL, messages=ask(1), tools=TOOLS, max_tokens=60, temperature=0)
    for name, arguments in calls_of(auto.choices[0].message):  # the model may call or not; a call is valid
        jsonschema.validate(arguments, SCHEMAS[name])
    called = oai.chat.completions.create(model=MODEL, messages=ask(1), tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=200, temperature=0)
    call = called.choices[0].message.tool_calls[0]
    follow_up = [*ask(1), {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "done"}]
    answer = oai.chat.completions.create(model=MODEL, messages=follow_up, tools=TOOLS, max_tokens=10, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_unknown_named_tool_and_hostile_parameters_are_400(oai):
    with pytest.raises(openai.BadRequestError) as error:
        oai.chat.completions.create(model=MODEL, messages=ask(0), tools=TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "Nope"}})
    assert error.value.body["param"] == "tool_choice"
    deep: dict = {"type": "integer"}
    for _ in range(900):  # deeper than Python's recursion limit: refused before anything recurses
        deep = {"type": "array", "items": deep}
    for choice in ("required", "none"):
        with pytest.raises(openai.BadRequestError) as error:
            oai.chat.completions.create(model=MODEL, messages=ask(0), tool_choice=choice, tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": deep}}}}])
        assert error.value.body["param"] == "tools"


def test_a_union_wider_than_the_matcher_serves_is_the_requests_400(oai):
    """50 unions of 200 patterns (400 KB) stalled another client's stream and the liveness probe
    1.5 s (xgrammar's matcher, quadratic in the width); 1001 branches are refused before compiling."""
    union = {"anyOf": [{"type": "string", "pattern": f"u{i}"} for i in range(1001)]}
    wide = [("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": union}}}),
            ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": union}}],
                       "tool_choice": "required"})]
    for param, extra in wide:
        with pytest.raises(openai.BadRequestError, match="alternatives in all") as error:
            oai.chat.completions.create(model=MODEL, messages=ask(0), max_tokens=4, **extra)
        assert error.value.body["param"] == param
    union["anyOf"].pop()
    reply = oai.chat.completions.create(model=MODEL, messages=ask(0), max_tokens=8, response_format={
        "type": "json_schema", "json_schema": {"name": "u", "schema": union}})
    assert reply.choices[0].message.content.startswith('"u')


def threads_nice(pid: int) -> dict[str, int]:
    """Each thread of a process: its nice value (field 19 of /proc's stat), by thread id."""
    niceness = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        niceness[task.name] = int(fields[16])
    return niceness


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads threads' nice values from Linux's /proc")
def test_grammars_compile_below_the_engines_priority(tools_server, oai):
    """A schema's compile runs on a thread of its own at nice 10 (with xgrammar's threads, which it
    starts); the process's other threads, the event loop's and the engine's, stay at its priority."""
    schema = {"type": "object", "properties": {"priority_probe": {"enum": ["a", "b"]}}, "required": ["priority_probe"]}
    reply = oai.chat.completions.create(model=MODEL, messages=ask(1), max_tokens=24, response_format={
        "type": "json_schema", "json_schema": {"name": "probe", "schema": schema}})
    assert json.loads(reply.choices[0].message.content)["priority_probe"] in ("a", "b")
    niceness = threads_nice(tools_server.proc.pid)
    assert niceness[str(tools_server.proc.pid)] == 0, "the event loop's thread keeps the process's priority"
    assert 10 in niceness.values() and list(niceness.values()).count(0) >= 3, niceness


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constraint_that_leads_nowhere_is_the_requests_400_and_the_engine_serves_on(oai, temperature):
    """xgrammar compiles both: a schema that only refers to itself admits no first token, and this
    grammar none after its "a". Greedy decoding once took token 0, which the grammar refused: a 503
    "engine unavailable" for the client's own input."""
    nothing = {"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as error:
            oai.chat.completions.create(model=MODEL, messages=ask(0), temperature=temperature, max_tokens=5,
                                        response_format=nothing, stream=stream)
        assert error.value.body["param"] == "response_format"
        assert "admits no output" in error.value.body["message"]
    dead_end = {"structured_outputs": {"grammar": 'root ::= "a" x\nx ::= x "b"'}}
    with pytest.raises(openai.BadRequestError, match="admits no further token"):
        oai.completions.create(model=MODEL, prompt="hi", temperature=temperature, max_tokens=5, extra_body=dead_end)
    with pytest.raises(openai.APIError, match="admits no further token") as error:
        for _ in oai.completions.create(model=MODEL, prompt="hi", temperature=temperature, max_tokens=5,
                                        extra_body=dead_end, stream=True):
            pass
    assert error.value.body["type"] == "invalid_request_error"
    served = oai.completions.create(model=MODEL, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert served.usage.completion_tokens == 3


def test_logprobs_of_the_tokens_a_constraint_forbids_are_floored_as_vllm_floors_them(oai):
    """Under a grammar most tokens have logprob -inf, which JSON cannot carry: a reply asking for
    top_logprobs was once a 500 (its stream said null). vLLM's server writes -9999.0."""
    one = {"structured_outputs": {"regex": "a"}}  # a single token allowed, so most of the top 5 are forbidden
    for stream in (False, True):
        reply = oai.chat.completions.create(model=MODEL, messages=ask(0), max_tokens=2, logprobs=True, top_logprobs=5,
                                            extra_body=one, stream=stream)
        entries = [entry for part in (reply if stream else [reply]) for choice in part.choices
                   if choice.logprobs for entry in choice.logprobs.content or []]
        tops = [top.logprob for top in entries[0].top_logprobs]
        assert len(tops) == 5 and min(tops) == -9999.0 and entries[0].logprob == max(tops) > -9999.0
    reply = oai.completions.create(model=MODEL, prompt="hi", max_tokens=1, logprobs=5, extra_body=one)
    assert min(reply.choices[0].logprobs.top_logprobs[0].values()) == -9999.0


# -- prompt logprobs -------------------------------------------------------------------------------
def reference_logprobs(model_dir, prompt_ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at each position, in fp32: row i scores token i + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)


def test_echo_logprobs_and_prompt_logprobs_equal_transformers(oai, tiny_model_dir, tokenizer):
    prompt = " ".join(p for p, _ in memorised_pairs()[:6])  # longer than one 16-token block, twice
    ids = tokenizer(prompt)["input_ids"]
    expected = reference_logprobs(tiny_model_dir, ids)
    for attempt in range(2):  # the second finds the prompt in the prefix cache, which must not matter
        reply = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1,
                                       extra_body={"prompt_logprobs": 2})
        choice = reply.choices[0]
        assert choice.text.startswith(prompt)
        scored = choice.logprobs.token_logprobs
        assert scored[0] is None and choice.logprobs.top_logprobs[0] is None and len(scored) == len(ids) + 1
        for position in range(1, len(ids)):
            assert abs(scored[position] - float(expected[position - 1, ids[position]])) < 1e-4, position
        prompt_logprobs = choice.model_extra["prompt_logprobs"]
        assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
        for position in range(1, len(ids)):
            entry = prompt_logprobs[position][str(ids[position])]
            assert abs(entry["logprob"] - float(expected[position - 1, ids[position]])) < 1e-4
            assert entry["rank"] == 1 + int((expected[position - 1] > expected[position - 1, ids[position]]).sum())
            assert len(prompt_logprobs[position]) in (2, 3)


def test_streamed_echo_carries_the_prompt_logprobs(oai):
    prompt, _ = memorised_pairs()[4]
    plain = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=0)
    chunks = list(oai.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=0,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == plain.choices[0].logprobs.token_logprobs


def test_a_loglikelihood_lm_eval_task_scores_the_torch_engine(tools_server, tiny_model_dir):
    """lm-eval's multiple-choice path (echo + logprobs), as MMLU, HellaSwag and ARC use it."""
    [row] = run_tasks(tools_server.url, MODEL, [AccuracyTask(name="inferkiln_tiny_choice", min=0.9)],
                      include_paths=[], endpoint="completions", tokenizer=tiny_model_dir)
    assert (row["metric"], row["samples"], row["passed"]) == ("acc,none", 64, True), row
