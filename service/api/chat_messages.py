"""A chat request's messages as the model's chat template takes them, as vLLM gives them to it, so
that one conversation renders the same prompt on both engines: a message's text parts joined by
newlines, a tool call's arguments as an object (transformers' convention for tool-use templates:
Llama 3's writes them with `tojson`, which would quote a JSON string again), a message's name, a
developer message as a system message where the template does not know the role."""

from __future__ import annotations

import inspect
import json
import logging

from service.api.protocol import ChatMessage, ToolCall

log = logging.getLogger(__name__)


def template_messages(messages: list[ChatMessage], template: str) -> list[dict]:
    """The messages for `template` (the chat template's text). A developer message goes as a system
    message, all system messages then merged into one at the front, where the template does not
    name the developer role (vLLM's rule: Qwen2.5's would drop the message, Llama 3's would print
    the unknown role)."""
    rendered = [_template_message(m) for m in messages]
    if any(m["role"] == "developer" for m in rendered) and not _knows_developer(template):
        rendered = _one_system_message([{**m, "role": "system"} if m["role"] == "developer" else m for m in rendered])
    return rendered


def _knows_developer(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


def _one_system_message(messages: list[dict]) -> list[dict]:
    """All system messages as one at the front (their texts between blank lines), where there is a
    later or a second one: some templates take a system message only first."""
    system = [m for m in messages if m["role"] == "system"]
    if not system or (len(system) == 1 and messages[0] is system[0]):
        return messages
    merged = {"role": "system", "content": "\n\n".join(m["content"] for m in system if m["content"])}
    return [merged, *(m for m in messages if m["role"] != "system")]


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
    message = {"role": m.role, "content": content}
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
