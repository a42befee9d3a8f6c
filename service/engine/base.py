"""The engine interface: what the HTTP layer needs from any engine, in-process or supervised."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.adapters import Adapter, AdapterRegistry

SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (vLLM's threshold)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0  # vLLM's: no stop token or string ends a choice before this many tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # vLLM's: the stop string or token that ends a choice stays in its text
    skip_special_tokens: bool = True  # vLLM's: special tokens write no text
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k = the chosen token plus k alternatives
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's: over the prompt's and the output's tokens
    min_p: float = 0.0  # vLLM's: tokens below min_p times the likeliest's probability are dropped
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: () = every token; else only these may be chosen
    bad_words: tuple[tuple[int, ...], ...] = ()  # vLLM's, as token ids: a word's last id never follows the rest
    prompt_logprobs: int | None = None  # None = off; k = each prompt token's logprob plus k alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes the logits before a token is chosen (sampling.process_logits)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.min_tokens or self.allowed_token_ids
                    or self.bad_words)


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: Adapter | None = None  # a LoRA adapter of the registry; None: the base model
    grammar: Any = None  # a grammar the engine compiled (`Engine.compile_grammar`) that every choice follows
    cache_salt: str | None = None  # vLLM's: requests of different salts share no prefix cache


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    rank: int | None = None  # 1 + how many tokens the model found likelier (prompt logprobs report it)


@dataclass
class ChoiceDelta:
    """What one choice gained in one engine step: new text, the tokens behind it, maybe its end."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None
    # On a choice's first delta when the request asked for them: per prompt token (None for the first)
    prompt_logprobs: list[TokenLogprob | None] | None = None


def join_deltas(deltas: list[ChoiceDelta]) -> ChoiceDelta:
    """One choice's consecutive deltas of a step as one (the tokens a speculative step kept)."""
    first, last = deltas[0], deltas[-1]
    return ChoiceDelta(last.index, "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids],
                       [lp for d in deltas for lp in d.logprobs], last.finish_reason, last.stop_reason,
                       first.prompt_logprobs)


@dataclass
class SpecDecodeCounts:
    """Speculative decoding since start, in vLLM's terms: drafts run, their tokens, the tokens kept."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, proposed: int, kept: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += kept


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    max_num_seqs: int
    kv_cache_usage: float  # KV-cache blocks in use, 0 to 1
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of which found there
    spec_decode: SpecDecodeCounts | None = None  # None: the engine does not speculate


class EngineError(RuntimeError):
    """The engine cannot serve (not started, or dead): the HTTP layer answers 503."""


class SamplingError(ValueError):
    """A request's sampling parameters leave nothing to sample: 400, and no fault of the engine."""


class RequestTooLargeError(ValueError):
    """The request can never be served (its KV cache, its sequences, a token id past the model's
    embedding rows): 400, as a prompt over the context is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineBase(ABC):
    """What the runtime needs of every engine: start, ready, stats, shutdown.

    Two kinds serve requests differently (KServe's capabilities): an `Engine` streams token deltas
    to our OpenAI layer; a `PassthroughEngine` is an OpenAI server of its own (vLLM's) whose app
    serves the inference routes in this process, the contract around it.
    """

    max_model_len: int
    max_num_seqs: int
    on_death: Any = None  # set by the app: called with the reason when the engine dies while serving

    @abstractmethod
    async def start(self) -> None: ...

    @property
    @abstractmethod
    def ready(self) -> bool:
        """True once the engine can generate and until it dies or shuts down."""

    @abstractmethod
    def stats(self) -> EngineStats: ...

    async def scrape(self) -> bytes:
        """Refresh what `stats()` reports before a metrics scrape; returns the engine's own
        exposition to append (none for an in-process engine)."""
        return b""

    async def sync_adapters(self, registry: AdapterRegistry) -> None:
        """An engine that keeps its own list of LoRA adapters (vLLM) makes it the registry's, at start
        and after each rescan; one that reads the registry per request (torch) has nothing to do."""

    def describe(self) -> str:
        """What runs, for logs and `serve --dry-run`."""
        return type(self).__name__

    @abstractmethod
    async def shutdown(self) -> None: ...


class Engine(EngineBase):
    """An in-process engine: the HTTP layer tokenizes and streams deltas from `generate`."""

    tokenizer: Any  # a transformers tokenizer: the HTTP layer builds prompts with it

    @abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[list[ChoiceDelta]]:
        """Stream the request's deltas, one list per engine step; closing the iterator aborts it."""

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    async def compile_grammar(self, constraint) -> Any:
        """A structured-output constraint compiled for `GenerationRequest.grammar`, off the event loop.
        Raises GrammarError (a 400) for one it cannot compile."""
        from service.engine.grammar import GrammarError

        raise GrammarError("this engine does not constrain its outputs")


class PassthroughEngine(EngineBase):
    """An engine with an OpenAI server of its own, in this process: requests pass to its ASGI app."""

    app: Any  # the engine's ASGI app (below the contract's middleware)
    root_app: Any  # the application object its routes expect as scope["app"]
    http_metrics: Any = None  # records the engine app's HTTP metrics after each request (vllm_http_metrics)
