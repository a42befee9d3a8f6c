"""Token sampling for one sequence: penalties, logit bias, temperature, top-k, top-p, seeded draws.

Every distribution a request can ask for either samples or raises `SamplingError` (the request's
own fault, never the engine's): temperatures below `SAMPLING_EPS` are greedy (as in vLLM), top-p
keeps at least the likeliest token however small p is, and a distribution left with no finite mass
is refused rather than handed to `torch.multinomial`.
"""

from __future__ import annotations

import math
import os

import torch

from service.engine.base import SamplingError, SamplingParams, TokenLogprob, TopLogprob


# The least log-probability reported: a token a grammar forbids has -inf, which JSON cannot carry
# (vLLM's OpenAI server writes the same floor).
MIN_LOGPROB = -9999.0


def make_generator(params: SamplingParams, index: int, device: torch.device) -> torch.Generator:
    """A generator per choice: `seed + index` when seeded, so n>1 choices differ but repeat."""
    seed = params.seed + index if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % (2**63))
    return generator


def process_logits(logits: torch.Tensor, params: SamplingParams, output_ids: list[int]) -> torch.Tensor:
    """Apply bias and repetition penalties (OpenAI's definitions) to a [vocab] float32 row."""
    logits = logits.clone()
    for token_id, bias in params.logit_bias:
        logits[token_id] += bias
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(output_ids, device=logits.device).unique(return_counts=True)
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float()
    logits = (logits - logits.max()) / params.temperature  # <= 0 everywhere: no overflow at T near 0
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs >= params.top_p  # keep the smallest set reaching top_p
        drop[0] = False  # and the likeliest token always: a p below float32's range rounds to 0
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    total = float(probs.sum())
    if not math.isfinite(total) or total <= 0.0:
        raise SamplingError("the sampling parameters leave no token with a finite probability")
    return int(torch.multinomial(probs, 1, generator=generator))


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
