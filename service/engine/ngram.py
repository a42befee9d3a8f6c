"""N-gram (prompt-lookup) speculation: vLLM's `speculative_config` method "ngram", for the torch engine.

Text that quotes or edits its prompt repeats spans of it. When the last n tokens of a sequence
(n from `prompt_lookup_max` down to `prompt_lookup_min`) occurred before, the tokens that followed
them there are a guess at what comes next. The engine runs the guess with the sequence's next
token in one forward pass and keeps the guessed tokens that greedy decoding would have produced
anyway, plus the model's own token after the last kept one: one to k+1 tokens for one read of
the weights, and the output is the same as without speculation.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class NgramConfig(BaseModel):
    """The keys of vLLM's `--speculative-config` that the ngram method reads, with vLLM's defaults."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram"]
    num_speculative_tokens: int = Field(ge=1, le=16, description="tokens guessed per step")
    prompt_lookup_max: int | None = Field(None, ge=1, description="the longest n-gram matched")
    prompt_lookup_min: int | None = Field(None, ge=1, description="the shortest n-gram matched")
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = Field(
        None, description="[start, end, tokens]: the tokens guessed while start..end sequences run (vLLM's "
                          "dynamic schedule; a gap or the tail keeps the range before it)")

    @field_validator("num_speculative_tokens_per_batch_size")
    @classmethod
    def _schedule(cls, value: list[tuple[int, int, int]] | None) -> list[tuple[int, int, int]] | None:
        """vLLM's rules: ranges of positive sizes, in order, not overlapping, the first from 1; tokens >= 0."""
        if value is None:
            return None
        ranges = sorted(value)
        if not ranges or ranges[0][0] != 1:
            raise ValueError("the first batch-size range must start at 1")
        end = 0
        for low, high, tokens in ranges:
            if low <= end or high < low or tokens < 0:
                raise ValueError(f"({low}, {high}, {tokens}): ranges must not overlap, start <= end, tokens >= 0")
            end = high
        return ranges

    @model_validator(mode="after")
    def _window(self) -> NgramConfig:
        """As vLLM: neither set is 5 and 5; one set stands for both."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        self.prompt_lookup_min = low or high or 5
        self.prompt_lookup_max = high or low or 5
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be at most "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        return self

    def tokens_for(self, batch: int) -> int:
        """Tokens to guess per sequence while `batch` sequences run."""
        tokens = self.num_speculative_tokens
        for low, _, scheduled in self.num_speculative_tokens_per_batch_size or ():
            if batch < low:
                break
            tokens = min(self.num_speculative_tokens, scheduled)
        return tokens


class NgramIndex:
    """Where each n-gram of one sequence first occurred with a token after it, kept up to date as
    tokens join: a proposal costs a few dictionary lookups a step, not a scan of the sequence.
    The first occurrence, as vLLM's proposer takes it (of the longest match, the earliest
    position): in a loop of p tokens the latest earlier occurrence lies p tokens back and has only
    p tokens after it, the first has the whole count."""

    def __init__(self, config: NgramConfig) -> None:
        self.low, self.high = config.prompt_lookup_min, config.prompt_lookup_max
        self.follower: dict[tuple[int, ...], int] = {}  # n-gram -> where the token after its first occurrence is
        self.indexed = 0  # the n-grams before tokens[1:indexed] are recorded

    def propose(self, tokens: list[int], count: int) -> list[int]:
        """Up to `count` tokens that followed the first occurrence of the longest suffix of `tokens`
        that occurred before (n from prompt_lookup_max down to prompt_lookup_min); [] where none
        recurs."""
        self._index(tokens)
        for n in range(min(self.high, len(tokens)), self.low - 1, -1):
            at = self.follower.get(tuple(tokens[-n:]))
            if at is not None:
                return tokens[at:at + count]
        return []

    def _index(self, tokens: list[int]) -> None:
        """Record the n-grams that end before each token up to the last, which has none after it yet."""
        for follow in range(max(self.indexed, 1), len(tokens)):
            for n in range(self.low, min(self.high, follow) + 1):
                self.follower.setdefault(tuple(tokens[follow - n:follow]), follow)
        self.indexed = len(tokens)  # a sequence's tokens only grow
