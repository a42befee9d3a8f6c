"""Token sampling for one sequence: penalties, logit bias, temperature, min-p, top-k, top-p, seeded draws.

Every distribution a request can ask for either samples or raises `SamplingError` (the request's
own fault, never the engine's): temperatures below `SAMPLING_EPS` are greedy (as in vLLM), top-p
keeps at least the likeliest token however small p is, and a distribution left with no finite mass
is refused before anything is drawn.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from service.engine import cpu_gemm
from service.engine.base import SamplingError, SamplingParams, TokenLogprob, TopLogprob


FLOAT32_MAX = torch.finfo(torch.float32).max

# The least log-probability reported: a token a grammar forbids has -inf, which JSON cannot carry
# (vLLM's OpenAI server writes the same floor).
MIN_LOGPROB = -9999.0


def make_generator(params: SamplingParams, index: int, device: torch.device) -> torch.Generator:
    """A generator per choice: `seed + index` when seeded, so n>1 choices differ but repeat."""
    seed = params.seed + index if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % (2**63))
    return generator


def bias_tensors(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A request's logit bias as token ids and values, made once a request: added one entry at a time,
    a bias of 100000 tokens (a real vocabulary's, in a 2 MiB body) took 0.5 s of every step."""
    if not params.logit_bias:
        return None
    table = torch.tensor(params.logit_bias, dtype=torch.float64)  # token ids are exact in float64
    return table[:, 0].long(), table[:, 1]


def banned_ids(bad_words: tuple[tuple[int, ...], ...], output_ids: list[int]) -> list[int]:
    """vLLM's bad words: each word's last token, where the output ends with the rest of the word (a
    word of one token always)."""
    banned = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix <= len(output_ids) and (not prefix or output_ids[-prefix:] == list(word[:-1])):
            banned.append(word[-1])
    return banned


def process_logits(logits: torch.Tensor, params: SamplingParams, output_ids: list[int],
                   prompt_tokens: torch.Tensor | None = None,
                   bias: tuple[torch.Tensor, torch.Tensor] | None = None,
                   stop_ids: torch.Tensor | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Apply the logit bias (`bias_tensors`, made here unless given), then vLLM's repetition penalty
    (over `prompt_tokens`, the prompt's distinct ids, and the output's), then the frequency and
    presence penalties (OpenAI's definitions, over the output's), in vLLM's order, to a [vocab]
    float32 row: a copy, or the row itself where there are none. Below `params.min_tokens` output
    tokens, `stop_ids` (the choice's stop and end-of-sequence ids) cannot be chosen, where
    `allowed` is given (vLLM's allowed_token_ids) no other token can, and a bad word's last token
    cannot follow the rest of it, as in vLLM."""
    penalized = output_ids and (params.presence_penalty or params.frequency_penalty)
    repeated = params.repetition_penalty != 1.0 and (output_ids or prompt_tokens is not None)
    held = stop_ids is not None and len(output_ids) < params.min_tokens
    banned = banned_ids(params.bad_words, output_ids) if params.bad_words else []
    if not params.logit_bias and not penalized and not repeated and not held and allowed is None and not banned:
        return logits
    logits = logits.clone()
    if allowed is not None:
        allowed = allowed.to(logits.device)
        kept = logits[allowed]
        logits.fill_(-math.inf)
        logits[allowed] = kept
    if banned:
        logits[[t for t in banned if t < len(logits)]] = -math.inf  # a tokenizer may know ids past the model's rows
    if held:
        logits[stop_ids.to(logits.device)] = -math.inf
    if params.logit_bias:
        ids, values = bias or bias_tensors(params)
        logits.index_add_(0, ids.to(logits.device), values.to(logits.device, logits.dtype))
    if repeated:  # a token seen twice gets the same value twice: no need to deduplicate
        seen = torch.tensor(output_ids, dtype=torch.long, device=logits.device)
        if prompt_tokens is not None:
            seen = torch.cat([prompt_tokens.to(logits.device), seen])
        values = logits[seen]
        scaled = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        # an extreme penalty saturates at float32's range rather than overflowing to inf, which would
        # leave no finite distribution; a token a grammar forbids (-inf) stays forbidden
        logits[seen] = torch.where(values.isfinite(), scaled.clamp(-FLOAT32_MAX, FLOAT32_MAX), values)
    if penalized:
        ids, counts = torch.tensor(output_ids, device=logits.device).unique(return_counts=True)
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
    return logits


NO_FINITE_MASS = "the sampling parameters leave no token with a finite probability"
NUCLEUS_FIRST = 256  # the likeliest tokens top-p looks among first (`nucleus`)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.greedy:
        token = int(torch.argmax(logits))
        if logits[token] == -math.inf:  # every token excluded (allowed, bad words, min_tokens, a grammar)
            raise SamplingError(NO_FINITE_MASS)
        return token
    if (params.top_p >= 1.0 and not 0 < params.top_k < logits.shape[-1] and params.min_p <= 0.0
            and native_draw(logits.device)):
        token = torch.ops.inferkiln.sample_row(logits.float().contiguous(), params.temperature, generator)
        if token < 0:
            raise SamplingError(NO_FINITE_MASS)
        return token
    probs, ids = probabilities(logits, params)
    index = draw(probs, generator)
    return index if ids is None else int(ids[index])


@functools.cache
def native_draw(device: torch.device) -> bool:
    """Whether a temperature-only draw runs as one call (cpu_sampling.cpp's `sample_row`, the same
    inverse CDF at the same uniform as `probabilities` and `draw`): on x86 CPUs with AVX2 and FMA
    where the kernel library loads. Elsewhere, and with top-k or top-p, the aten ops below."""
    return device.type == "cpu" and cpu_gemm.runs_here() and cpu_gemm.load()


def probabilities(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The distribution a sampled token is drawn from (temperature, min-p, top-k, then top-p, vLLM's
    order): probabilities and each one's token id (None: every token, in order)."""
    logits = logits.float()
    logits = (logits - logits.max()) / params.temperature  # <= 0 everywhere: no overflow at T near 0
    if params.min_p > 0.0:  # a token's probability over the likeliest's is exp(its shifted logit)
        logits = logits.masked_fill(logits < math.log(params.min_p), float("-inf"))
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return nucleus(probs, params.top_p) if params.top_p < 1.0 else (probs, None)


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of likeliest tokens whose mass reaches top_p (the likeliest always), as
    probabilities, likeliest first, and their token ids: looked for among the likeliest
    NUCLEUS_FIRST, then twice as many, until it lies within them. A nucleus is mostly far smaller
    than the vocabulary, whose whole sort took 2.4 ms a sampled token at 32000 tokens and 11.7 ms
    at 128256 (2-core EPYC)."""
    count = min(NUCLEUS_FIRST, len(probs))
    while True:
        values, ids = torch.topk(probs, count)
        cumulative = torch.cumsum(values, dim=-1)
        if count == len(probs) or float(cumulative[-1]) >= top_p:  # the next token is dropped: the nucleus lies within
            break
        count = min(2 * count, len(probs))
    drop = cumulative - values >= top_p  # keep the smallest set reaching top_p
    drop[0] = False  # and the likeliest token always: a p below float32's range rounds to 0
    return values.masked_fill(drop, 0.0), ids


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """The first token whose cumulative probability exceeds u times the total, u one uniform draw
    of the generator in [0, 1): each token with the chance its probability gives it."""
    cumulative = torch.cumsum(probs, 0, dtype=torch.float64)
    total = float(cumulative[-1])
    if not math.isfinite(total) or total <= 0.0:
        raise SamplingError(NO_FINITE_MASS)
    u = float(torch.rand((), generator=generator, dtype=torch.float64, device=probs.device))
    token = int(torch.searchsorted(cumulative, u * total, right=True))
    return token if token < len(probs) else int(probs.nonzero()[-1])  # u * total rounded up to the total


def token_logprob(raw_logits: torch.Tensor, token_id: int, top_n: int, token_text) -> TokenLogprob:
    """Log-probabilities from the model's own distribution (before sampling adjustments), as vLLM does."""
    return scored_tokens(raw_logits.unsqueeze(0), [token_id], top_n, token_text)[0]


def scored_tokens(logits: torch.Tensor, token_ids: list[int], top_n: int, token_text,
                  ranked: bool = False) -> list[TokenLogprob]:
    """Row i's log-probability of token_ids[i] (with its rank if `ranked`: a pass over the vocabulary
    that only prompt logprobs report), and the row's `top_n` likeliest tokens: one log_softmax over
    all rows (a prompt's logprobs are one row per token), floored at MIN_LOGPROB."""
    logprobs = torch.log_softmax(logits.float(), dim=-1).clamp_(min=MIN_LOGPROB)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device).unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1).add_(1).tolist() if ranked else [None] * len(token_ids)
    tops: list[tuple[TopLogprob, ...]] = [()] * len(token_ids)
    if top_n > 0:
        values, ids = torch.topk(logprobs, top_n, dim=-1)
        tops = [tuple(TopLogprob(i, token_text(i), v) for v, i in zip(row_values, row_ids))
                for row_values, row_ids in zip(values.tolist(), ids.tolist())]
    return [TokenLogprob(token_id, token_text(token_id), value, top, rank)
            for token_id, value, top, rank in zip(token_ids, chosen.squeeze(1).tolist(), tops, ranks)]
