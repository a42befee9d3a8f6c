"""Structured outputs for the torch engine: grammars compiled by xgrammar, a token bitmask per step.

A request's constraint (`Constraint`: a JSON schema, any JSON, a regex, a choice, an EBNF grammar or
an xgrammar structural tag) is compiled once per distinct constraint (xgrammar caches by its text)
on a thread of its own, never on the event loop. Each constrained choice gets a `GrammarMatcher`;
before sampling, every constrained row of the batch has the tokens its grammar forbids masked to
-inf, in place, so constrained and free sequences decode in the same step; a row left with no token
fails its request (a 400: the constraint is the client's). The grammar's end admits only the
model's stop tokens, so a finished constraint ends the choice as a stop token does.

Compiling runs on threads of its own (`compile_pool`) at a lower CPU priority than the engine: a
JSON schema's enum of 25000 values takes xgrammar 30-40 s on 2 cores, and six such requests, compiled
side by side on the event loop's default executor, made another client's stream 16x as slow for
40 s (inter-token p50 185 against 11.7 ms, the 76M model on a 2-core EPYC). One compile at a time at
nice 10: 1.08-1.38x (13.5-18.0 ms in two runs), a small schema's request 20 ms idle and 34 against
28 ms with the engine busy.

The width of what a grammar offers at one point is bounded (`MAX_ALTERNATIVES`, `MAX_RULES`):
xgrammar 0.2.8's matcher takes time quadratic in it when it is made (holding the GIL, so every
thread waits) and when it takes the first token (on the engine's step thread, so every sequence
waits). A schema of 50 unions of 200 patterns (400 KB) stalled another client's stream and the
liveness probe 1.5 s; at 1000 branches in all, a request costs at most 5-8 ms of either.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

log = logging.getLogger(__name__)

ConstraintKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
COMPILE_THREADS = 2  # xgrammar's own threads for one grammar (they take the compiling thread's priority)
COMPILE_NICE = 10  # the compiling threads' nice value: CPU the engine leaves idle, little of what it uses
MAX_NESTING = 64  # levels of objects and arrays in a schema: deeper ones are refused before any recursion
MAX_ALTERNATIVES = 1000  # a constraint's anyOf, oneOf and patternProperties branches and tags (tools), in all
MAX_RULES = 1000  # rules of a constraint's EBNF grammars (`::=`), in all
# xgrammar prefixes its messages with a timestamp and a C++ source position
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def compile_pool(cores: int) -> concurrent.futures.ThreadPoolExecutor:
    """The threads that compile grammars: as many as vLLM's structured-output manager takes (half
    the cores, at least one), each lowered to COMPILE_NICE before its first compile."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=max(1, (cores + 1) // 2), thread_name_prefix="grammar",
                                                 initializer=in_background)


def in_background() -> None:
    """Lower this thread's CPU priority to COMPILE_NICE (Linux's nice is per thread); never raise it."""
    if sys.platform != "linux":
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, max(COMPILE_NICE, os.getpriority(os.PRIO_PROCESS, thread)))
    except OSError as exc:  # a sandbox that forbids it: compiles keep the engine's priority
        log.warning("grammar compiles run at the engine's CPU priority: %s", exc)


class GrammarError(ValueError):
    """The constraint cannot be compiled: the request's fault (a 400 naming the reason)."""


@dataclass(frozen=True)
class Constraint:
    """What a request constrains its output to; `value` is the constraint's text (a schema as JSON)."""

    kind: ConstraintKind
    value: str = ""
    any_whitespace: bool = False  # JSON: whitespace of any length between tokens (vLLM's default is on)

    @classmethod
    def json_schema(cls, schema: dict | str, any_whitespace: bool = False) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError(f"the JSON schema is not JSON: {exc}") from None
        return cls("json", json.dumps(bounded_strings(schema)), any_whitespace)  # properties keep their order

    @classmethod
    def choice(cls, options: list[str]) -> Constraint:
        return cls("choice", json.dumps(options))


# A string of bounded length as a pattern that keeps JSON's rule: no quote, backslash or control
# character. xgrammar 0.2.8 writes a bounded string as [^"\\\r\n]{min,max}, which lets the other
# control characters (U+0000-U+001F) through unescaped: JSON no parser accepts.
_PLAIN_CHARACTER = '[^"\\\\\\x00-\\x1f]'


def _nodes(value) -> Iterator[tuple[object, int]]:
    """Every value in a parsed JSON value, with its depth (the value itself at 1), without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        yield item, depth
        if isinstance(item, dict | list):
            stack += [(child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)]


def nesting(value) -> int:
    """How deeply lists and dicts nest in `value`."""
    return max((depth for item, depth in _nodes(value) if isinstance(item, dict | list)), default=0)


# What offers a choice: a JSON schema's keywords, a structural tag's tags (a tool each; `structures`
# in vLLM's response_format of type structural_tag)
_UNIONS = {"anyOf": list, "oneOf": list, "patternProperties": dict, "tags": list, "structures": list}


def alternatives(value) -> int:
    """How many alternatives a schema or a structural tag offers in all (`_UNIONS`). 2000 tools'
    tags took xgrammar's matcher 93 ms to make, 1000 22 ms."""
    return sum(len(item[key]) for item, _ in _nodes(value) if isinstance(item, dict)
               for key, kind in _UNIONS.items() if isinstance(item.get(key), kind))


def ebnf_rules(value) -> int:
    """The EBNF rules (`::=`) in the strings of a parsed JSON value (or in a grammar's text)."""
    return sum(item.count("::=") for item, _ in _nodes(value) if isinstance(item, str))


def too_wide(constraint: Constraint) -> str | None:
    """Why the constraint offers more at one point than a request may ask of the matcher, if it does."""
    kind = constraint.kind
    parsed = constraint.value if kind == "grammar" else None
    if kind in ("json", "structural_tag"):
        try:
            parsed = json.loads(constraint.value)
        except (ValueError, RecursionError):
            pass  # xgrammar names what is wrong with it
    rules = ebnf_rules(parsed) if kind in ("grammar", "structural_tag") else 0  # a tag may hold EBNF
    return width_refused(rules, alternatives(parsed))


def width_refused(rules: int, branches: int) -> str | None:
    """Why a constraint of `rules` EBNF rules and `branches` schema branches is refused, if it is."""
    if rules > MAX_RULES:
        return f"its grammars have {rules} rules; at most {MAX_RULES} are served"
    if branches > MAX_ALTERNATIVES:
        return (f"it offers {branches} alternatives in all (anyOf, oneOf and patternProperties branches, "
                f"tools); at most {MAX_ALTERNATIVES} are served")
    return None


def bounded_strings(schema):
    """The schema with each length-bounded string (no pattern, format, enum or const of its own)
    constrained by an equivalent pattern of JSON-valid characters. GrammarError for a schema nested
    deeper than MAX_NESTING."""
    if nesting(schema) > MAX_NESTING:
        raise GrammarError(f"the JSON schema nests deeper than {MAX_NESTING} levels")
    return _bounded_strings(schema)


def _bounded_strings(schema):
    if isinstance(schema, list):
        return [_bounded_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _bounded_strings(value) for key, value in schema.items()}
    if (schema.get("type") == "string" and ("minLength" in schema or "maxLength" in schema)
            and not {"pattern", "format", "enum", "const"} & schema.keys()):
        low, high = schema.pop("minLength", 0), schema.pop("maxLength", "")
        schema["pattern"] = f"^{_PLAIN_CHARACTER}{{{low},{high}}}$"
    return schema


def dead_ends(bitmask: torch.Tensor, rows: list[int]) -> set[int]:
    """The `rows` of an xgrammar token bitmask that allow no token: a grammar that compiles and leads
    nowhere, at once (`root ::= root "a"`) or later (`x ::= x "b"` after an "a"). Read on the
    bitmask (host memory, a bit a token) rather than the masked logits: 8 rows of a 128K vocabulary
    took 58 against 714 us."""
    allowed = bitmask[rows].any(dim=-1).tolist()
    return {row for row, some in zip(rows, allowed) if not some}


def choice_grammar(options: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `options`."""
    return "root ::= " + " | ".join(json.dumps(option) for option in options)


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer, with its cache of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        self.vocab_size = vocab_size
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=True)
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=1)  # the engine's step thread fills the masks
        self._bitmask: torch.Tensor | None = None  # reused from step to step, grown to the largest batch

    def compile(self, constraint: Constraint):
        """The compiled grammar; GrammarError with xgrammar's reason when it cannot be compiled, or
        when no token can begin it (a schema that only refers to itself: xgrammar compiles it), or
        when it is too wide for the matcher (`too_wide`)."""
        if (reason := too_wide(constraint)) is not None:
            raise GrammarError(reason)
        compiled = self._compile(constraint)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher(compiled).fill_next_token_bitmask(bitmask)
        if dead_ends(bitmask, [0]):
            raise GrammarError("it admits no output: no token can begin it")
        return compiled

    def _compile(self, constraint: Constraint):
        compiler, kind = self.compiler, constraint.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(constraint.value, any_whitespace=constraint.any_whitespace)
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(constraint.value)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(constraint.value)))
            if kind == "structural_tag":
                return compiler.compile_structural_tag(self.xgr.StructuralTag.model_validate_json(constraint.value))
            return compiler.compile_grammar(constraint.value)
        except (RuntimeError, ValueError) as exc:  # xgrammar raises these for every malformed input
            raise GrammarError(_SOURCE_PREFIX.sub("", str(exc).strip()) or type(exc).__name__) from None

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, object]]) -> set[int]:
        """Mask `logits` [batch, vocab] in place: each (row, matcher) keeps only what its grammar allows;
        returns the rows left with no token.

        One call fills every row and one applies them: each call into a native library may hand the
        GIL to the event loop, and taking it back can wait out the loop's switch interval (measured:
        8 rows masked one call each took 0.22 ms a step in the server, against 0.05 ms alone)."""
        if self._bitmask is None or self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = self.xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        bitmask, indices = self._bitmask[:logits.shape[0]], [row for row, _ in rows]
        self._batch.batch_fill_next_token_bitmask([matcher for _, matcher in rows], bitmask, indices)
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                             vocab_size=self.vocab_size, indices=indices)
        return dead_ends(bitmask, indices)

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        """Advance each matcher by its token, in one call; False where the grammar refuses it."""
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
