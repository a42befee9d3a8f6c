"""Bad input on every route gets the right 4xx in the OpenAI error shape, never a 500."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from service.launcher import ServerProcess

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None,
                        code: str | None = None) -> dict:
    """The OpenAI error shape; `code` is the status unless OpenAI names one (model_not_found)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["code"] == (code or status)
    if param is not None:
        assert error["param"] == param
    return error


def chat_body(**overrides) -> dict:
    return {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **overrides}


def completion_body(**overrides) -> dict:
    return {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4, **overrides}


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_malformed_json(server, route):
    response = httpx.post(server.url + route, content=b'{"model": "tiny-llama", "prompt": ',
                          headers={"content-type": "application/json"})
    error = assert_openai_error(response, 400)
    assert error["type"] == "invalid_request_error" and "JSON" in error["message"]


@pytest.mark.parametrize("route,body,param", [
    (CHAT, chat_body(max_tokens="many"), "max_tokens"),
    (CHAT, chat_body(messages="hello"), "messages"),
    (CHAT, chat_body(temperature=[1]), "temperature"),
    (CHAT, chat_body(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role"),
    (CHAT, chat_body(messages=[]), "messages"),
    (COMPLETIONS, completion_body(prompt={"text": "x"}), None),
    (COMPLETIONS, completion_body(n="two"), "n"),
    (COMPLETIONS, completion_body(stop=5), None),
])
def test_wrong_types(server, route, body, param):
    assert_openai_error(httpx.post(server.url + route, json=body), 400, param)


@pytest.mark.parametrize("route,body,param", [
    (CHAT, chat_body(max_tokens=-1), "max_tokens"),
    (CHAT, chat_body(max_tokens=0), "max_tokens"),
    (CHAT, chat_body(max_tokens=10**9), "max_tokens"),
    (CHAT, chat_body(max_completion_tokens=10**9), "max_completion_tokens"),
    (COMPLETIONS, completion_body(max_tokens=10**9), "max_tokens"),
    (CHAT, chat_body(temperature=5), "temperature"),
    (CHAT, chat_body(top_p=0), "top_p"),
    (CHAT, chat_body(n=0), "n"),
    (CHAT, chat_body(n=100), "n"),
    (CHAT, chat_body(top_logprobs=50, logprobs=True), "top_logprobs"),
    (CHAT, chat_body(top_logprobs=2), "top_logprobs"),
    (COMPLETIONS, completion_body(logprobs=99), "logprobs"),
    (COMPLETIONS, completion_body(stop=[""]), "stop"),
    (COMPLETIONS, completion_body(prompt=[]), "prompt"),
    (COMPLETIONS, completion_body(prompt=[99999]), "prompt"),
    (COMPLETIONS, completion_body(prompt="", add_special_tokens=False), "prompt"),  # no tokens: it hung
    (COMPLETIONS, completion_body(prompt=["a", ""], add_special_tokens=False), "prompt"),
    (CHAT, chat_body(continue_final_message=True), "continue_final_message"),  # with add_generation_prompt
    (CHAT, chat_body(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs"),
    (CHAT, chat_body(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    (CHAT, chat_body(chat_template_kwargs={"eos_token": 5}), "chat_template_kwargs"),  # the template adds it to text
    (COMPLETIONS, completion_body(min_tokens=100, max_tokens=10), "min_tokens"),
    (COMPLETIONS, completion_body(min_tokens=-1), "min_tokens"),
    (COMPLETIONS, completion_body(allowed_token_ids=[]), "allowed_token_ids"),
    (COMPLETIONS, completion_body(truncate_prompt_tokens=0), "truncate_prompt_tokens"),  # no prompt left
    (COMPLETIONS, completion_body(bad_words=[""]), "bad_words"),
    (CHAT, chat_body(bad_words=["  "]), "bad_words"),  # no tokens
    (COMPLETIONS, completion_body(bad_words=[str(i) for i in range(129)]), "bad_words"),  # vLLM's bound: 128
    (COMPLETIONS, completion_body(bad_words=["word " * 300]), "bad_words"),  # and 1024 tokens in all
    (CHAT, chat_body(truncate_prompt_tokens=513), "truncate_prompt_tokens"),  # past the context
    (COMPLETIONS, completion_body(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (COMPLETIONS, completion_body(truncate_prompt_tokens=3, truncation_side="middle"), "truncation_side"),
    (COMPLETIONS, completion_body(allowed_token_ids=[5, 99999]), "allowed_token_ids"),
    # beside a constraint of the reply (vLLM 0.32 answers 500 where the two admit no common token)
    (COMPLETIONS, completion_body(allowed_token_ids=[5], structured_outputs={"choice": ["a", "b"]}),
     "allowed_token_ids"),
    (CHAT, chat_body(allowed_token_ids=[5], response_format={"type": "json_object"}), "allowed_token_ids"),
    (COMPLETIONS, completion_body(logit_bias={"word": 1}), "logit_bias"),
    (COMPLETIONS, completion_body(logit_bias={"5": 1000}), "logit_bias"),
    (COMPLETIONS, completion_body(frequency_penalty=3), "frequency_penalty"),
    (COMPLETIONS, completion_body(repetition_penalty=0), "repetition_penalty"),
    (CHAT, chat_body(repetition_penalty=-1.5), "repetition_penalty"),
    (COMPLETIONS, completion_body(min_p=1.5), "min_p"),
    (CHAT, chat_body(min_p=-0.1), "min_p"),
])
def test_out_of_range_values(server, route, body, param):
    assert_openai_error(httpx.post(server.url + route, json=body), 400, param)


@pytest.mark.parametrize("value", ["Infinity", "NaN"])
def test_a_repetition_penalty_that_is_not_finite_is_a_400(server, value):
    """Python's JSON parser reads Infinity and NaN; a penalty of either would turn logits into NaN."""
    body = json.dumps(completion_body()).replace('"max_tokens"', f'"repetition_penalty": {value}, "max_tokens"')
    response = httpx.post(server.url + COMPLETIONS, content=body, headers={"content-type": "application/json"})
    assert_openai_error(response, 400, "repetition_penalty")


@pytest.mark.parametrize("route,body,param", [
    (CHAT, chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (CHAT, chat_body(functions=[{"name": "f"}]), "functions"),
    (CHAT, chat_body(modalities=["audio"]), "modalities"),
    (COMPLETIONS, completion_body(suffix="end"), "suffix"),
    (COMPLETIONS, completion_body(best_of=3), "best_of"),
    (COMPLETIONS, completion_body(made_up_option=1), "made_up_option"),
])
def test_unsupported_parameters_are_refused(server, route, body, param):
    error = assert_openai_error(httpx.post(server.url + route, json=body), 400, param)
    assert "support" in error["message"]


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("route,body,param", [
    (CHAT, chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": deep_schema(900)}}),
     "response_format"),
    (COMPLETIONS, completion_body(structured_outputs={"json": deep_schema(900)}), "structured_outputs"),
    (COMPLETIONS, completion_body(structured_outputs={"grammar": "root ::= " + '("(" ' * 3000 + '"x"' + ' ")")' * 3000}),
     "structured_outputs"),
    (CHAT, chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}), "response_format"),
    (CHAT, chat_body(response_format={"type": "json_schema"}), "response_format"),
    (COMPLETIONS, completion_body(structured_outputs={"regex": "(unclosed"}), "structured_outputs"),
    (COMPLETIONS, completion_body(structured_outputs={"json": "{not json"}), "structured_outputs"),
    (COMPLETIONS, completion_body(structured_outputs={"grammar": "root ::= "}), "structured_outputs"),
    (COMPLETIONS, completion_body(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
    (CHAT, chat_body(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), "structured_outputs"),
    (CHAT, chat_body(tool_choice="required"), "tool_choice"),
    (COMPLETIONS, completion_body(prompt_logprobs=50), "prompt_logprobs"),
])
def test_constraints_that_cannot_be_followed_are_400(server, route, body, param):
    assert_openai_error(httpx.post(server.url + route, json=body), 400, param)


@pytest.mark.parametrize("route,body", [(CHAT, chat_body()), (COMPLETIONS, completion_body())])
def test_unknown_model_is_404(server, route, body):
    error = assert_openai_error(httpx.post(server.url + route, json={**body, "model": "gpt-17"}), 404, "model",
                                "model_not_found")
    assert "gpt-17" in error["message"]


def test_unknown_model_through_openai_client(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_prompt_over_the_context(server, client):
    long_prompt = "word " * 600
    response = httpx.post(server.url + COMPLETIONS, json=completion_body(prompt=long_prompt))
    error = assert_openai_error(response, 400, "prompt")
    assert "512" in error["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": long_prompt}])


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_a_prompt_that_takes_seconds_to_encode_leaves_the_event_loop_free(server, tokenizer, route):
    """Nearly 2 MiB of text, refused once encoded (far past the context): encoded on the event loop,
    it held every stream and every probe of the server for seconds; it is encoded on a thread of its
    own. Liveness, answered on the loop, must not wait half as long as the encoding takes here."""
    text = " ".join(f"w{i % 9973}x" for i in range(300_000))
    began = time.perf_counter()
    tokenizer(text)
    encoding_s = time.perf_counter() - began
    body = chat_body(messages=[{"role": "user", "content": text}]) if route == CHAT else completion_body(prompt=text)

    async def probed() -> tuple[list[float], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            refusal = asyncio.create_task(client.post(route, json=body))
            waits = []
            while not refusal.done():
                sent = time.perf_counter()
                assert (await client.get("/v1/health/live")).status_code == 200
                waits.append(time.perf_counter() - sent)
                await asyncio.sleep(0.02)
            return waits, await refusal

    waits, refused = asyncio.run(probed())
    assert_openai_error(refused, 400, "messages" if route == CHAT else "prompt")
    assert len(waits) > 5 and max(waits) < encoding_s / 2, (max(waits), len(waits), encoding_s)


def test_prompt_plus_max_tokens_over_the_context_stops_at_its_end(server):
    """As vLLM 0.32 (and so NIM) serves it: the output ends where the context does (it was a 400 here);
    a max_tokens past the whole context is still one."""
    body = completion_body(prompt=[100] * 200, max_tokens=400, ignore_eos=True)
    reply = httpx.post(server.url + COMPLETIONS, json=body, timeout=120).json()
    assert reply["usage"]["completion_tokens"] == 312 and reply["choices"][0]["finish_reason"] == "length"
    assert_openai_error(httpx.post(server.url + COMPLETIONS, json=body | {"max_tokens": 513}), 400, "max_tokens")


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_oversized_body_is_413(server, route):
    big = "x" * (3 * 1024 * 1024)
    assert_openai_error(httpx.post(server.url + route, json=completion_body(prompt=big)), 413)


def test_oversized_chunked_body_is_413(server):
    def chunks():
        for _ in range(40):
            yield b"x" * 100_000

    response = httpx.post(server.url + COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(response, 413)


@pytest.mark.parametrize("method,path", [("GET", "/v1/nothing"), ("POST", "/v1/embeddings"), ("GET", "/")])
def test_unknown_route_is_404_in_openai_shape(server, method, path):
    assert_openai_error(httpx.request(method, server.url + path), 404)


def test_wrong_method_is_405_in_openai_shape(server):
    assert_openai_error(httpx.get(server.url + COMPLETIONS), 405)


def test_empty_body_is_400(server):
    assert_openai_error(httpx.post(server.url + CHAT, headers={"content-type": "application/json"}), 400)


def test_request_id_is_echoed_or_made(server):
    given = httpx.get(server.url + "/v1/health/live", headers={"X-Request-Id": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123"
    made = httpx.get(server.url + "/v1/health/live")
    assert len(made.headers["x-request-id"]) == 32
    completion = httpx.post(server.url + COMPLETIONS, json=completion_body(), headers={"X-Request-Id": "req-9"})
    assert completion.json()["id"] == "cmpl-req-9"


# -- what a hostile client sent (issue: hostile input) ----------------------------------------
@pytest.mark.parametrize("route,body,param", [
    (COMPLETIONS, completion_body(prompt="\ud800abc"), "prompt"),
    (COMPLETIONS, completion_body(prompt=["fine", "\udfffx"]), "prompt"),
    (COMPLETIONS, completion_body(stop="\ud800"), "stop"),
    (CHAT, chat_body(messages=[{"role": "user", "content": "\ud800abc"}]), "messages.0.content"),
    (CHAT, chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]), "messages.0.content"),
])
def test_text_that_is_not_unicode_is_a_400_naming_the_field(server, route, body, param):
    content = json.dumps(body).encode()  # the lone surrogate as the JSON escape "\ud800" a client sends
    error = assert_openai_error(httpx.post(server.url + route, content=content,
                                           headers={"content-type": "application/json"}), 400)
    assert error["param"].startswith(param) and "surrogate" in error["message"]
    assert "TextEncodeInput" not in error["message"] and "Traceback" not in error["message"]


@pytest.mark.parametrize("route,body", [(COMPLETIONS, completion_body), (CHAT, chat_body)])
def test_more_stop_strings_than_openai_takes_is_a_400_naming_the_limit(server, route, body):
    """Each stop string is looked for after every token: 200000 of them held every stream of the
    server to a token every 0.3 s."""
    error = assert_openai_error(httpx.post(server.url + route, json=body(stop=["x"] * 5)), 400, "stop")
    assert "at most 4" in error["message"]
    assert httpx.post(server.url + route, json=body(stop=["x"] * 4, max_tokens=2)).status_code == 200


def test_nim_max_stop_strings_sets_the_bound(tiny_model_dir, tmp_path):
    with ServerProcess(["--model", str(tiny_model_dir)], env={"NIM_MAX_STOP_STRINGS": "6"},
                       log_path=tmp_path / "service.log") as six:
        assert httpx.post(six.url + COMPLETIONS, json=completion_body(stop=["x"] * 6)).status_code == 200
        assert_openai_error(httpx.post(six.url + COMPLETIONS, json=completion_body(stop=["x"] * 7)), 400, "stop")


@pytest.mark.parametrize("body,param", [
    (completion_body(prompt=["x"] * 1000), "prompt"),
    (completion_body(prompt=["x"] * 255, n=32), "prompt"),
    (completion_body(n=33), "n"),
])
def test_more_sequences_than_a_request_may_make_is_a_400_not_a_retryable_503(server, body, param):
    error = assert_openai_error(httpx.post(server.url + COMPLETIONS, json=body), 400, param)
    assert "NIM_MAX" in error["message"]


@pytest.mark.parametrize("route,body,param", [
    (CHAT, chat_body(temperature=False), "temperature"),
    (CHAT, chat_body(temperature="0.5"), "temperature"),
    (COMPLETIONS, completion_body(top_p="1"), "top_p"),
    (COMPLETIONS, completion_body(n=2.5), "n"),
    (COMPLETIONS, completion_body(n="2"), "n"),
    (COMPLETIONS, completion_body(max_tokens=True), "max_tokens"),
    (COMPLETIONS, completion_body(stream="yes"), "stream"),
    (COMPLETIONS, completion_body(stream_options={"include_usage": True}), "stream_options"),  # as OpenAI and vLLM
    (CHAT, chat_body(stream=False, stream_options={"include_usage": False}), "stream_options"),
    (COMPLETIONS, completion_body(stop_token_ids=[-5]), "stop_token_ids.0"),
    (COMPLETIONS, completion_body(stop_token_ids=[99999]), "stop_token_ids"),
])
def test_sampling_fields_are_strictly_typed_and_ranged(server, route, body, param):
    assert_openai_error(httpx.post(server.url + route, json=body), 400, param)


def test_numbers_keep_json_schemas_meaning(server):
    """An integer is a float and an integral float an integer, as the OpenAPI document's types say."""
    response = httpx.post(server.url + COMPLETIONS, json=completion_body(temperature=0, top_p=1, presence_penalty=1,
                                                                        max_tokens=3.0, n=2.0, seed=7.0))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 6


def test_the_openapi_document_describes_streamed_answers(server):
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    for route in (CHAT, COMPLETIONS):
        content = paths[route]["post"]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(content), route
