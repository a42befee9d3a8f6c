"""The Hermes tool-call parser and the grammars behind structured outputs (pure logic, and xgrammar
on the tiny model's tokenizer)."""

from __future__ import annotations

import json
import os
import random
import sys
import threading

import pytest
import torch

from service.api.tool_calls import HermesParser, tool_constraint
from service.engine.grammar import (COMPILE_NICE, MAX_ALTERNATIVES, MAX_RULES, Constraint, GrammarCompiler,
                                   GrammarError, alternatives, bounded_strings, choice_grammar, compile_pool,
                                   in_background)

TWO_CALLS = ('Sure. <tool_call>\n{"name": "book", "arguments": {"city": "Pa}ris", "n": {"a": [1, 2]}}}\n</tool_call>\n'
             '<tool_call>\n{"name": "pay", "arguments": {}}\n</tool_call> done')


def parse_whole(text: str) -> tuple[str, list[tuple[str, str]]]:
    parser = HermesParser()
    content, _ = parser.feed(text)
    rest, _ = parser.finish()
    return content + rest, [(call.name, call.arguments) for call in parser.calls]


def parse_streamed(text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    parser, content, calls, start = HermesParser(), "", {}, 0
    while start < len(text):
        end = start + rng.randint(1, 6)
        piece, deltas = parser.feed(text[start:end])
        content, start = content + piece, end
        for delta in deltas:
            name, arguments = calls.get(delta.index, (None, ""))
            calls[delta.index] = (delta.name or name, arguments + delta.arguments)
    piece, deltas = parser.finish()
    for delta in deltas:
        calls[delta.index] = (calls[delta.index][0], calls[delta.index][1] + delta.arguments)
    return content + piece, [calls[i] for i in sorted(calls)]


def test_calls_and_content_are_parsed_from_the_whole_reply():
    content, calls = parse_whole(TWO_CALLS)
    assert content == "Sure. done"  # whitespace right after a call separates calls
    assert calls == [("book", '{"city": "Pa}ris", "n": {"a": [1, 2]}}'), ("pay", "{}")]
    assert json.loads(calls[0][1])["city"] == "Pa}ris"


@pytest.mark.parametrize("text", [TWO_CALLS, "no calls at all", "held back <tool_c", "<tool_call>not json</tool_call> x",
                                  '<tool_call>\n{"name": "cut", "arguments": {"a": 1'])
def test_any_split_of_a_stream_gives_the_whole_replys_result(text):
    rng = random.Random(7)
    whole = parse_whole(text)
    for _ in range(200):
        assert parse_streamed(text, rng) == whole


def test_a_tag_without_a_call_is_content():
    assert parse_whole("<tool_call>not json</tool_call> x") == ("<tool_call>not json</tool_call> x", [])
    assert parse_whole("a <tool_c") == ("a <tool_c", [])


def test_bounded_strings_become_json_valid_patterns():
    schema = {"type": "object", "properties": {"type": {"type": "string", "maxLength": 3},
                                               "id": {"type": "string", "minLength": 2, "pattern": "^[a-z]+$"},
                                               "tags": {"type": "array", "items": {"type": "string", "minLength": 1}}}}
    result = bounded_strings(schema)
    assert result["properties"]["type"] == {"type": "string", "pattern": '^[^"\\\\\\x00-\\x1f]{0,3}$'}
    assert result["properties"]["id"] == schema["properties"]["id"]  # its own pattern rules
    assert result["properties"]["tags"]["items"]["pattern"].endswith("{1,}$")


def test_choice_grammar_quotes_its_options():
    assert choice_grammar(['say "hi"', "a\\b"]) == 'root ::= "say \\"hi\\"" | "a\\\\b"'


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def accepts(compiler: GrammarCompiler, constraint: Constraint, text: str) -> bool:
    matcher = compiler.xgr.GrammarMatcher(compiler.compile(constraint), terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def test_constraints_accept_their_language_only(compiler):
    schema = Constraint.json_schema({"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}},
                                     "required": ["s"]})
    assert accepts(compiler, schema, '{"s": "ab"}')
    assert not accepts(compiler, schema, '{"s": "a\x0eb"}')  # xgrammar's own rule would take it
    assert not accepts(compiler, schema, '{"s": "abcde"}')
    assert accepts(compiler, Constraint.choice(["yes", "no"]), "no")
    assert not accepts(compiler, Constraint.choice(["yes", "no"]), "nope")
    assert accepts(compiler, Constraint("regex", "[0-9]{2}"), "42")


def test_tool_constraints_write_hermes_calls(compiler):
    functions = [{"name": "book", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                 "required": ["n"]}}, {"name": "ping"}]
    call = '<tool_call>\n{"name": "book", "arguments": {"n": 3}}\n</tool_call>'
    ping = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    required = tool_constraint(functions, "required", parallel=True)
    assert accepts(compiler, required, call) and accepts(compiler, required, call + "\n" + ping)
    assert not accepts(compiler, required, "hello")
    assert not accepts(compiler, tool_constraint(functions, "required", parallel=False), call + "\n" + ping)
    named = tool_constraint(functions, {"type": "function", "function": {"name": "ping"}}, parallel=True)
    assert accepts(compiler, named, ping) and not accepts(compiler, named, call)
    auto = tool_constraint(functions, "auto", parallel=True)
    assert accepts(compiler, auto, "just text") and accepts(compiler, auto, "text " + call)
    assert not accepts(compiler, auto, '<tool_call>\n{"name": "book", "arguments": {"n": "x"}}\n</tool_call>')


@pytest.mark.parametrize("constraint", [Constraint("regex", "(unclosed"), Constraint("grammar", "root ::= "),
                                        Constraint.json_schema({"properties": {"a": {"$ref": "#/nowhere"}}})])
def test_a_constraint_that_cannot_compile_names_the_reason(compiler, constraint):
    with pytest.raises(GrammarError) as error:
        compiler.compile(constraint)
    assert str(error.value) and not str(error.value).startswith("[")  # xgrammar's source position is gone


def patterns(count: int, tag: str = "z") -> list[dict]:
    """Strings of `count` patterns: xgrammar makes a rule of each, which the matcher then predicts."""
    return [{"type": "string", "pattern": f"{tag}{i}"} for i in range(count)]


def test_alternatives_are_counted_in_all_of_a_constraints_schemas():
    nested = {"anyOf": [{"oneOf": patterns(3)}, {"type": "object", "patternProperties": {"^a": {}, "^b": {}}}],
              "$defs": {"d": {"anyOf": patterns(4)}}, "properties": {"anyOf": {"type": "string"}}}
    assert alternatives(nested) == 2 + 3 + 2 + 4  # a property named anyOf is no union
    tag = json.loads(tool_constraint([{"name": "f", "parameters": nested}, {"name": "g", "parameters": nested}],
                                     "required", parallel=True).value)
    assert alternatives(tag) == 2 + 2 * 11  # a tag a tool
    assert alternatives({"enum": list(range(5000))}) == 0  # literals: the matcher takes them at no cost


def test_a_constraint_wider_than_the_matcher_serves_is_refused_before_compiling(compiler):
    """xgrammar's matcher takes time quadratic in a union's width when it is made (holding the GIL)
    and at the first token (holding the engine's step): 50 unions of 200 patterns took 2.3 s of each."""
    at_most = Constraint.json_schema({"anyOf": [{"anyOf": patterns(499, "a")}, {"anyOf": patterns(499, "b")}]})
    assert accepts(compiler, at_most, '"a7"')
    wider = [Constraint.json_schema({"anyOf": [{"anyOf": patterns(500, "a")}, {"anyOf": patterns(499, "b")}]}),
             Constraint.json_schema({"type": "object", "patternProperties": {f"^p{i}": {} for i in range(1001)}}),
             tool_constraint([{"name": f"f{i}", "parameters": {"oneOf": patterns(500)}} for i in range(2)],
                             "auto", parallel=True),
             tool_constraint([{"name": f"f{i}"} for i in range(MAX_ALTERNATIVES + 1)], "required", parallel=True)]
    for constraint in wider:
        with pytest.raises(GrammarError, match=f"at most {MAX_ALTERNATIVES} are served"):
            compiler.compile(constraint)
    rules = [f'r{i} ::= "z" r{i} | "i{i}"' for i in range(MAX_RULES)]
    served = Constraint("grammar", "\n".join(["root ::= " + " | ".join(f"r{i}" for i in range(MAX_RULES - 1)),
                                              *rules[:MAX_RULES - 1]]))
    assert accepts(compiler, served, "zzi7")
    with pytest.raises(GrammarError, match=f"have {MAX_RULES + 1} rules; at most {MAX_RULES} are served"):
        compiler.compile(Constraint("grammar", "\n".join(["root ::= " + " | ".join(f"r{i}" for i in range(MAX_RULES)),
                                                          *rules])))


def test_a_constraint_that_admits_nothing_is_refused_and_one_that_leads_nowhere_is_seen_in_the_mask(compiler):
    for nothing in (Constraint.json_schema({"$ref": "#"}), Constraint("grammar", 'root ::= root "a"')):
        with pytest.raises(GrammarError, match="admits no output"):
            compiler.compile(nothing)
    dead_end = compiler.matcher(compiler.compile(Constraint("grammar", 'root ::= "a" x\nx ::= x "b"')))
    alive = compiler.matcher(compiler.compile(Constraint("regex", "a+")))
    logits = torch.zeros(3, compiler.vocab_size)
    assert compiler.mask(logits, [(0, dead_end), (2, alive)]) == set()  # both may begin with "a"
    first = int(torch.isfinite(logits[0]).nonzero()[0])
    assert dead_end.accept_token(first) and alive.accept_token(first)
    logits = torch.zeros(3, compiler.vocab_size)
    assert compiler.mask(logits, [(0, dead_end), (2, alive)]) == {0}
    assert not torch.isfinite(logits[0]).any() and torch.isfinite(logits[1]).all() and torch.isfinite(logits[2]).any()


def own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")
def test_grammars_compile_on_half_the_cores_at_a_lower_priority_never_a_higher_one():
    pool = compile_pool(cores=4)
    try:
        niceness = {pool.submit(own_nice).result() for _ in range(8)}
        assert niceness == {max(COMPILE_NICE, os.getpriority(os.PRIO_PROCESS, 0))}
        assert pool._max_workers == 2 and compile_pool(cores=1)._max_workers == 1
    finally:
        pool.shutdown()

    def already_lower(seen: list) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 15)
        in_background()
        seen.append(own_nice())

    seen: list[int] = []
    thread = threading.Thread(target=already_lower, args=(seen,))
    thread.start()
    thread.join()
    assert seen == [15] and own_nice() < COMPILE_NICE, "only the compiling thread is lowered"
