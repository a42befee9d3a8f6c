"""vLLM's truncate_prompt_tokens, as its renderer cuts a generative model's prompts (checked against
vLLM 0.32's image in tests/integration/test_vllm_backend.py)."""

import pytest

from service.api.encoding import prompt_encoder
from service.api.truncation import keep_count, special_split, truncated

IDS = [1, 10, 11, 12, 13, 14]  # BOS and five tokens of text


def test_the_special_tokens_an_encoding_adds_are_found(tokenizer):
    assert special_split(prompt_encoder(tokenizer)) == (1, 0)  # the tiny model's BOS
    assert special_split(lambda text, special: [101, 7, 102] if special else [7]) == (1, 1)  # [CLS] a [SEP]
    assert special_split(lambda text, special: [7]) == (0, 0)


@pytest.mark.parametrize("side,specials,expected", [
    ("right", (1, 0), [1, 10, 11]),
    ("left", (1, 0), [12, 13, 14]),  # of the whole encoding: BOS goes
    (None, (1, 0), [1, 13, 14]),  # the tokenizer's own cut keeps what it added
    (None, (0, 0), [12, 13, 14]),  # token ids, or text encoded without special tokens
])
def test_a_prompt_keeps_its_last_or_first_tokens(side, specials, expected):
    assert truncated(IDS, 3, side, specials) == expected
    assert truncated(IDS, 6, side, specials) == IDS and truncated(IDS, 60, side, specials) == IDS


def test_special_tokens_on_both_sides_are_kept_and_counted():
    assert truncated([101, 7, 8, 9, 102], 4, None, (1, 1)) == [101, 8, 9, 102]
    assert truncated([1, 10, 11], 1, None, (1, 0)) == [1], "no text left, as vLLM serves it"
    with pytest.raises(ValueError, match="special tokens"):
        truncated([101, 7, 8, 102], 1, None, (1, 1))


def test_minus_one_leaves_a_token_of_the_context_to_generate():
    assert keep_count(-1, 512) == 511 and keep_count(512, 512) == 512 and keep_count(5, 512) == 5
    for asked in (0, 513):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            keep_count(asked, 512)
