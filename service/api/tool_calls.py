"""Tool calls in the Hermes format (vLLM's `hermes` parser): the grammar that makes a model write
them, and the parser that turns a model's text into OpenAI's `tool_calls`, streamed or whole.

A call is `<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`, as Hermes, Qwen 2.5/3
and the bundled tiny model's chat template write it. With `tool_choice` `required` or a named
function, the output is constrained to calls only (xgrammar structural tags); with `auto`, text is
free and each call the model starts is constrained to a declared function and its parameters.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from service.engine.grammar import Constraint, bounded_strings

ARGUMENT_WHITESPACE = 1  # most whitespace characters in a row inside arguments: no padding without end
BEGIN, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*')


def _tag(function: dict) -> dict:
    parameters = bounded_strings(function.get("parameters") or {"type": "object", "properties": {}})
    return {"type": "tag", "begin": f'{BEGIN}\n{{"name": {json.dumps(function["name"])}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": ARGUMENT_WHITESPACE},
            "end": f"}}\n{END}"}


def tool_constraint(functions: list[dict], choice: str | dict, parallel: bool) -> Constraint:
    """The grammar of a reply under `choice`: `auto` (free text, valid calls), `required` (calls
    only, at least one) or a named function ({"type": "function", "function": {"name": ...}})."""
    if isinstance(choice, dict):
        (function,) = [f for f in functions if f["name"] == choice["function"]["name"]]
        format_ = _tag(function)
    elif choice == "required":
        format_ = {"type": "tags_with_separator", "tags": [_tag(f) for f in functions], "separator": "\n",
                   "at_least_one": True, "stop_after_first": not parallel}
    else:
        format_ = {"type": "triggered_tags", "triggers": [BEGIN], "tags": [_tag(f) for f in functions],
                   "at_least_one": False, "stop_after_first": not parallel}
    return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": format_}))


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: it may become the marker)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _json_value(text: str) -> str | None:
    """The JSON value `text` begins with, as written; None if it does not begin with a whole one."""
    try:
        return text[:json.JSONDecoder().raw_decode(text)[1]]
    except ValueError:
        return None


class HermesParser:
    """Text in, content and tool-call deltas out. Fed a whole reply at once, it gives the
    non-streamed message; fed delta by delta, the stream, whose pieces concatenate to the same."""

    def __init__(self) -> None:
        self.buffer = ""  # text not yet handed out
        self.calls: list[ToolCallDelta] = []  # each call as sent so far (name, arguments)
        self.in_call = False
        self.args_start: int | None = None  # where the current call's arguments begin in `buffer`
        self.after_call = False  # whitespace right after a call separates calls: it is not content

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += text
        content, deltas = "", []
        while True:
            if not self.in_call:
                if self.after_call:
                    self.buffer = self.buffer.lstrip()
                    self.after_call = not self.buffer
                start = self.buffer.find(BEGIN)
                if start < 0:
                    keep = _partial_suffix(self.buffer, BEGIN)
                    content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return content, deltas
                content += self.buffer[:start]
                self.buffer, self.in_call, self.args_start = self.buffer[start + len(BEGIN):], True, None
            delta, text = self._call_progress()
            content += text
            if delta is not None and (delta.name or delta.arguments):
                deltas.append(delta)
            if self.in_call:
                return content, deltas

    def _call_progress(self) -> tuple[ToolCallDelta | None, str]:
        """What the current call gained; at its end tag, the call is closed and the buffer moves on.
        A tagged text that is not a call (no name) is content, tags and all."""
        if self.args_start is None:
            match = _NAME.match(self.buffer)
            if match is None:
                end = self.buffer.find(END)
                if end < 0:
                    return None, ""
                text, self.buffer, self.in_call = BEGIN + self.buffer[:end + len(END)], self.buffer[end + len(END):], False
                return None, text
            self.calls.append(ToolCallDelta(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", match.group(1)))
            self.args_start = match.end()
            first = ToolCallDelta(len(self.calls) - 1, self.calls[-1].id, match.group(1))
        else:
            first = ToolCallDelta(len(self.calls) - 1)
        call, body = self.calls[-1], self.buffer[self.args_start:].lstrip()
        end = body.find(END)
        if end >= 0:
            arguments = _json_value(body) or body[:end].rstrip().removesuffix("}").rstrip()
            self.buffer, self.in_call, self.after_call = body[end + len(END):], False, True
        else:  # hold back what may be the outer object's close and the end tag
            arguments = body[:len(body) - _partial_suffix(body, END)].rstrip().rstrip("}").rstrip()
        first.arguments = arguments[len(call.arguments):] if arguments.startswith(call.arguments) else ""
        call.arguments += first.arguments
        return first, ""

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The end of the reply: text held back is content, and an unclosed call's arguments are what came."""
        if self.in_call and self.args_start is not None:
            call = self.calls[-1]
            body = self.buffer[self.args_start:].strip()
            body = _json_value(body) or body
            rest = body[len(call.arguments):] if body.startswith(call.arguments) else ""
            call.arguments += rest
            self.buffer, self.in_call = "", False
            return "", [ToolCallDelta(call.index, arguments=rest)] if rest else []
        content = (BEGIN if self.in_call else "") + self.buffer
        self.buffer, self.in_call = "", False
        return content, []
