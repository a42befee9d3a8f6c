"""A chat request's messages as chat templates take them, as vLLM gives them to templates (pure logic,
and one template rendered by transformers on the tiny model's tokenizer)."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from factory.tinymodel import ensure_tiny_model
from service.api.chat_messages import reserved_template_names, template_kwargs, template_messages
from service.api.protocol import ChatCompletionRequest, ChatMessage

# How Llama 3.1's template writes an earlier turn's tool call: the arguments through `tojson`.
TOJSON_TEMPLATE = ("{% for m in messages %}{% for call in m.tool_calls or [] %}"
                   "{{ call.function.name }}{{ call.function.arguments | tojson }};{% endfor %}{% endfor %}")


def call_with(arguments: str) -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "book", "arguments": arguments}}]}


def rendered(*messages: dict, template: str = "") -> list[dict]:
    return template_messages([ChatMessage.model_validate(m) for m in messages], template)


def test_text_parts_join_with_newlines_and_names_and_ids_are_kept():
    [user, tool] = rendered({"role": "user", "name": "ann", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]},
                            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "done"}]})
    assert user == {"role": "user", "content": "a\nb", "name": "ann"}
    assert tool == {"role": "tool", "content": "done", "tool_call_id": "c1"}


def test_developer_messages_are_system_messages_where_the_template_does_not_know_them():
    """vLLM's rule: converted, and every system message merged into one at the front."""
    conversation = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                    {"role": "developer", "content": "d"}]
    assert rendered(*conversation) == [{"role": "system", "content": "s\n\nd"}, {"role": "user", "content": "u"}]
    assert rendered({"role": "developer", "content": "d"}, {"role": "user", "content": "u"}) == [
        {"role": "system", "content": "d"}, {"role": "user", "content": "u"}]
    knows = "{% if m.role == 'developer' %}"
    assert [m["role"] for m in rendered(*conversation, template=knows)] == ["system", "user", "developer"]
    late = [{"role": "user", "content": "u"}, {"role": "system", "content": "s"}]
    assert rendered(*late) == [{"role": "user", "content": "u"}, {"role": "system", "content": "s"}], \
        "without a developer message, nothing moves"


def test_tool_call_arguments_go_to_the_template_as_an_object():
    [message] = rendered(call_with('{"city":"Paris","n":{"a":[1,2]}}'))
    assert message["content"] == ""
    assert message["tool_calls"] == [{"id": "c1", "type": "function",
                                      "function": {"name": "book", "arguments": {"city": "Paris", "n": {"a": [1, 2]}}}}]


@pytest.mark.parametrize("arguments", ["", "{not json", "[1, 2]", "42", "null"])
def test_arguments_that_are_no_json_object_become_empty_as_in_vllm(arguments, caplog):
    caplog.set_level(logging.INFO, logger="service.api.chat_messages")
    [message] = rendered(call_with(arguments))
    assert message["tool_calls"][0]["function"]["arguments"] == {}
    assert bool(caplog.records) == (arguments != "")  # an empty string is "no arguments", nothing to say


def test_a_tojson_template_writes_the_arguments_once_not_as_a_quoted_string():
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    text = tokenizer.apply_chat_template(rendered(call_with('{"city": "Paris"}')), chat_template=TOJSON_TEMPLATE,
                                         tokenize=False)
    assert text == 'book{"city": "Paris"};'


def test_template_kwargs_may_not_set_what_the_request_or_the_call_sets():
    reserved = reserved_template_names(AutoTokenizer.from_pretrained(ensure_tiny_model()))
    assert {"messages", "tools", "add_generation_prompt", "tokenize", "return_dict", "chat_template"} <= reserved
    assert template_kwargs({"enable_thinking": False, "bos_token": ""}, reserved) == {"enable_thinking": False,
                                                                                      "bos_token": ""}
    assert template_kwargs(None, reserved) == {}
    with pytest.raises(ValueError, match="messages, tokenize cannot be set here"):
        template_kwargs({"tokenize": True, "messages": [], "x": 1}, reserved)


def test_a_prompt_ends_open_or_cued_not_both():
    base = {"model": "m", "messages": [{"role": "assistant", "content": "Sure"}]}
    assert ChatCompletionRequest.model_validate({**base, "add_generation_prompt": False,
                                                 "continue_final_message": True}).continue_final_message
    with pytest.raises(ValidationError, match="continue_final_message"):
        ChatCompletionRequest.model_validate({**base, "continue_final_message": True})
