"""vLLM's `truncate_prompt_tokens` and `truncation_side`: a prompt cut to some of its tokens, as vLLM 0.32
cuts it for a generative model (its tokenizer truncates from the left)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

Side = Literal["left", "right"] | None


def special_split(encode: Callable[[str, bool], list[int]]) -> tuple[int, int]:
    """How many special tokens the tokenizer puts before and after a text it encodes (BOS: (1, 0))."""
    plain, marked = encode("a", False), encode("a", True)
    for before in range(len(marked) - len(plain) + 1):
        if marked[before:before + len(plain)] == plain:
            return before, len(marked) - before - len(plain)
    return 0, 0


def keep_count(asked: int, context: int) -> int:
    """The tokens a prompt keeps: -1 is the context less one (a token is left to generate), as in vLLM.
    ValueError where the request asks for none or for more than the context."""
    if asked > context:
        raise ValueError(f"truncate_prompt_tokens={asked} cannot be greater than the context, {context} tokens")
    if asked == 0:
        raise ValueError("truncate_prompt_tokens=0 leaves the prompt no tokens")
    return context - 1 if asked < 0 else asked


def truncated(ids: list[int], keep: int, side: Side, specials: tuple[int, int] = (0, 0)) -> list[int]:
    """`ids` cut to `keep` tokens: "left" keeps the last, "right" the first. With no side given a text
    prompt is cut by the tokenizer as it encodes (vLLM's default): from the left, keeping the special
    tokens the encoding added (`specials`, before and after the text); token ids are cut from the left."""
    if keep >= len(ids):
        return ids
    if side == "right":
        return ids[:keep]
    before, after = specials
    if side == "left" or not (before or after):
        return ids[len(ids) - keep:]
    text = keep - before - after
    if text < 0:
        raise ValueError(f"truncate_prompt_tokens={keep} leaves no room for the {before + after} special tokens "
                         "the prompt's encoding adds")
    body = ids[before:len(ids) - after]
    return ids[:before] + body[len(body) - text:] + ids[len(ids) - after:]
