"""Incremental detokenization and stop handling, on the real tiny-model tokenizer."""

import pytest

from service.engine.base import SamplingParams
from service.engine.sequence import (ByteLevelDetokenizer, IncrementalDetokenizer, SequenceOutput,
                                     byte_level_table, detokenizer_factory)


TEXTS = ["The quick brown fox jumps.", "naïve café — 東京 🙂 done", "  spaces\tand\nlines  "]


@pytest.mark.parametrize("kind", ["general", "byte-level"])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tokenizer, text, kind):
    prompt = tokenizer("Prompt:")["input_ids"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = (IncrementalDetokenizer(tokenizer, prompt) if kind == "general"
             else ByteLevelDetokenizer(byte_level_table(tokenizer)))
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in d for d in deltas), "no half characters are emitted"


@pytest.mark.parametrize("kind", ["general", "byte-level"])
def test_ids_past_the_tokenizers_vocabulary_show_no_text(tokenizer, kind):
    """A model may pad its vocabulary past the tokenizer's (its logits' rows): such an id is no text,
    as in vLLM's detokenizer, and the text around it is as if it were not there."""
    ids = tokenizer("naïve café", add_special_tokens=False)["input_ids"]
    detok = (IncrementalDetokenizer(tokenizer, []) if kind == "general"
             else ByteLevelDetokenizer(byte_level_table(tokenizer)))
    padded = len(tokenizer)
    deltas = [detok.add(i) for token_id in ids for i in (token_id, padded, padded + 63)] + [detok.flush()]
    assert "".join(deltas) == "naïve café"


def test_byte_level_table_matches_decode_for_every_token(tokenizer):
    table = byte_level_table(tokenizer)
    assert table is not None and len(table) == len(tokenizer)
    for token_id in range(len(tokenizer)):
        expected = tokenizer.decode([token_id], skip_special_tokens=True)
        assert table[token_id].decode("utf-8", errors="replace") == expected, token_id


def test_special_tokens_show_no_text(tokenizer):
    detok = detokenizer_factory(tokenizer)([])
    assert isinstance(detok, ByteLevelDetokenizer)
    assert detok.add(tokenizer.eos_token_id) == "" and detok.add(tokenizer.convert_tokens_to_ids("<|user|>")) == ""


@pytest.mark.parametrize("kind", ["general", "byte-level"])
def test_special_tokens_are_written_where_not_skipped(tokenizer, kind):
    """vLLM's skip_special_tokens: false: chat markers and the end of sequence are text, as decode writes them."""
    ids = tokenizer("<|user|>\nHi there</s>", add_special_tokens=False)["input_ids"]
    assert tokenizer.eos_token_id in ids, "the special tokens are tokens of their own"
    detok = (IncrementalDetokenizer(tokenizer, [], skip_special=False) if kind == "general"
             else detokenizer_factory(tokenizer)([], False))
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=False) == "<|user|>\nHi there</s>"
    assert "".join(map(detokenizer_factory(tokenizer)([], True).add, ids)) == "\nHi there"


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_token_that_ends_a_choice_is_written_only_where_asked(tokenizer, include):
    """As vLLM: with include_stop_str_in_output the stop token joins the text (an end of sequence
    only where special tokens are written); else it is counted in usage and shows nothing."""
    comma = tokenizer.convert_tokens_to_ids(",")
    seq, deltas = run(tokenizer, "Bread, flour", stop_token_ids=(comma,), include_stop_str_in_output=include)
    assert "".join(d.text for d in deltas) == ("Bread," if include else "Bread") and seq.token_ids[-1] == comma
    eos = tokenizer.eos_token_id
    for skip in (True, False):
        seq = make_sequence(tokenizer, SamplingParams(max_tokens=9, include_stop_str_in_output=include,
                                                      skip_special_tokens=skip), frozenset({eos}))
        text = "".join(seq.append(t, None).text for t in tokenizer("Hi", add_special_tokens=False)["input_ids"] + [eos])
        assert text == ("Hi</s>" if include and not skip else "Hi") and seq.finish_reason == "stop"


def make_sequence(tokenizer, params: SamplingParams, eos=frozenset()) -> SequenceOutput:
    return SequenceOutput(0, detokenizer_factory(tokenizer)([], params.skip_special_tokens), params, eos,
                          params.max_tokens)


def run(tokenizer, text, eos=frozenset(), **params):
    params.setdefault("max_tokens", 100)
    seq = make_sequence(tokenizer, SamplingParams(**params), eos)
    deltas = []
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        deltas.append(seq.append(token, None))
        if seq.finished:
            break
    return seq, deltas


def test_stop_string_truncates_and_is_never_emitted(tokenizer):
    seq, deltas = run(tokenizer, "Bread is baked from flour and water.", stop=("flour",))
    assert "".join(d.text for d in deltas) == "Bread is baked from "
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "flour"


def test_stop_string_spanning_tokens_is_held_back(tokenizer):
    seq, deltas = run(tokenizer, "one two three four", stop=("o th",))
    assert "".join(d.text for d in deltas) == "one tw"
    assert all("o th" not in d.text for d in deltas)


@pytest.mark.parametrize("text, stop, shown", [("Bread is baked from flour and water.", "flour", "Bread is baked from flour"),
                                                ("one two three four", "o th", "one two th")])
def test_a_stop_string_kept_in_the_output_ends_it(tokenizer, text, stop, shown):
    """vLLM's include_stop_str_in_output: the text ends with the stop string, nothing after it."""
    _, deltas = run(tokenizer, text, stop=(stop,), include_stop_str_in_output=True)
    assert "".join(d.text for d in deltas) == shown
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop


def test_stop_strings_count_only_after_min_tokens_as_in_vllm(tokenizer):
    """vLLM looks for stop strings once a choice has more than min_tokens tokens, and only where they
    end in the new text: one completed earlier never ends the choice."""
    ids = tokenizer("one two three four", add_special_tokens=False)["input_ids"]
    before = len(tokenizer.decode(ids[:3]))
    assert "one" in tokenizer.decode(ids[:3]) and "four" not in tokenizer.decode(ids[:3])
    _, deltas = run(tokenizer, "one two three four", stop=("one",), min_tokens=3)
    assert deltas[-1].finish_reason is None and "".join(d.text for d in deltas).startswith("one two")
    _, deltas = run(tokenizer, "one two three four", stop=("one", "four"), min_tokens=3)
    assert deltas[-1].stop_reason == "four" and len("".join(d.text for d in deltas)) >= before


def test_earliest_stop_string_wins(tokenizer):
    _, deltas = run(tokenizer, "alpha beta gamma", stop=("gamma", "beta"))
    assert "".join(d.text for d in deltas) == "alpha " and deltas[-1].stop_reason == "beta"


def test_max_tokens_gives_length_with_all_text(tokenizer):
    text = "Seven days make one week"
    seq, deltas = run(tokenizer, text, max_tokens=3)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:3]
    assert deltas[-1].finish_reason == "length" and len(seq.token_ids) == 3
    assert "".join(d.text for d in deltas) == tokenizer.decode(ids)


def test_eos_stops_and_counts_but_shows_nothing(tokenizer):
    eos = tokenizer.eos_token_id
    seq = make_sequence(tokenizer, SamplingParams(max_tokens=10), frozenset({eos}))
    seq.append(tokenizer("Hi", add_special_tokens=False)["input_ids"][0], None)
    last = seq.append(eos, None)
    assert last.finish_reason == "stop" and last.text == "" and len(seq.token_ids) == 2


def test_ignore_eos_and_stop_token_ids(tokenizer):
    eos = tokenizer.eos_token_id
    seq = make_sequence(tokenizer, SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(7,)),
                        frozenset({eos}))
    assert seq.append(eos, None).finish_reason is None
    last = seq.append(7, None)
    assert last.finish_reason == "stop" and last.stop_reason == 7


def test_abort_flushes_held_text(tokenizer):
    seq, deltas = run(tokenizer, "abc de", stop=("xyz-long",))
    final = seq.finish("abort")
    assert "".join(d.text for d in deltas) + final.text == "abc de" and final.finish_reason == "abort"
