"""A chat request's messages as the model's chat template takes them, as vLLM gives them to it, so
that one conversation renders the same prompt on both engines: a message's text parts joined by
newlines, a tool call's arguments as an object (transformers' convention for tool-use templates:
Llama 3's writes them with `tojson`, which would quote a JSON string again), a message's name."""

from __future__ import annotations

import inspect
import json
import logging

from service.api.protocol import ChatMessage, ToolCall

log = logging.getLogger(__name__)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    return [_template_message(m) for m in messages]


def reserved_template_names(tokenizer) -> frozenset[str]:
    """What a request's chat_template_kwargs may not set: the tokenizer's apply_chat_template's own
    parameters (tokenize, return_dict, ...: not the template's) and what it renders the template with
    (messages), which a request sets through its own fields."""
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters
    return frozenset(name for name, p in parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD) | {"messages"}


def template_kwargs(given: dict | None, reserved: frozenset[str]) -> dict:
    """A request's chat_template_kwargs, for the template; ValueError naming a reserved one."""
    if refused := sorted(set(given or ()) & reserved):
        raise ValueError(f"{', '.join(refused)} cannot be set here: "
                         "the request's own fields (messages, tools, add_generation_prompt, ...) set them")
    return dict(given or {})


def _template_message(m: ChatMessage) -> dict:
    content = "\n".join(part.text for part in m.content) if isinstance(m.content, list) else m.content or ""
    message = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [_template_call(call) for call in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _template_call(call: ToolCall) -> dict:
    """An earlier turn's call with its arguments as an object. Arguments that are not a JSON object
    become {}, as in vLLM: they live in the conversation's history, and refusing them would refuse
    every later turn of that conversation too."""
    try:
        arguments = json.loads(call.function.arguments) if call.function.arguments else {}
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        log.info("tool call %r: arguments that are not a JSON object (%d characters) go to the chat template "
                 "as {}", call.function.name, len(call.function.arguments))
        arguments = {}
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}}
