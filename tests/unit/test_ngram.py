"""N-gram speculation: the proposer, its configuration, and how the scheduler carries and settles drafts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.engine.kv_blocks import BlockPool
from service.engine.ngram import NgramConfig, NgramIndex
from service.engine.scheduler import Request, Scheduler

BLOCK = 4


def config(k: int = 3, low: int | None = 2, high: int | None = 3) -> NgramConfig:
    return NgramConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=low, prompt_lookup_max=high)


def test_the_window_follows_vllm():
    assert (config(low=None, high=None).prompt_lookup_min, config(low=None, high=None).prompt_lookup_max) == (5, 5)
    assert (config(low=None, high=4).prompt_lookup_min, config(low=2, high=None).prompt_lookup_max) == (4, 2)
    with pytest.raises(ValidationError, match="at most prompt_lookup_max"):
        config(low=4, high=2)
    with pytest.raises(ValidationError):
        NgramConfig(method="ngram", num_speculative_tokens=2, draft_model="x")


def earliest_match(tokens: list[int], low: int, high: int, count: int) -> list[int]:
    """The proposal by brute force: a scan for the longest recurring suffix's first occurrence."""
    for n in range(high, low - 1, -1):
        for start in range(len(tokens) - n):
            if n <= len(tokens) - 1 and tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + count]
    return []


def test_the_longest_recurring_suffix_proposes_what_followed_it_first_as_vllm_does():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 9, 2, 3, 7, 7, 1, 2, 3]
    # the 3-gram (1, 2, 3) occurred at 0 only: 9, 9, 2 followed it
    assert NgramIndex(config()).propose(tokens, 3) == [9, 9, 2]
    # with 2-grams only, (2, 3) occurred at 1 and 5: what followed the first (9, 9, 2), not the latest (7, 7, 1)
    assert NgramIndex(config(high=2)).propose(tokens, 3) == [9, 9, 2]
    # in a loop the first occurrence has the whole count after it; the latest, one period back, two
    assert NgramIndex(config(k=4, high=2)).propose([4, 7, 4, 7, 4, 7], 4) == [4, 7, 4, 7]


def test_a_proposal_stops_at_the_history_and_the_count():
    assert NgramIndex(config(k=5)).propose([5, 6, 8, 5, 6], 5) == [8, 5, 6]
    assert NgramIndex(config(k=5)).propose([5, 6, 8, 5, 6], 1) == [8]


def test_no_recurring_suffix_no_proposal():
    assert NgramIndex(config()).propose([1, 2, 3, 4, 5, 6], 3) == []
    assert NgramIndex(config()).propose([4, 4], 3) == []  # shorter than the shortest n-gram plus a follower


def test_the_index_kept_as_tokens_join_proposes_what_a_scan_finds():
    import random

    rng = random.Random(0)
    for low, high in ((1, 1), (1, 3), (2, 4), (3, 5)):
        index, tokens = NgramIndex(config(low=low, high=high)), [rng.randrange(6) for _ in range(5)]
        for _ in range(300):
            tokens += [rng.randrange(6) for _ in range(rng.choice((1, 1, 2, 4)))]
            assert index.propose(tokens, 4) == earliest_match(tokens, low, high, 4), (low, high, tokens)


def test_the_batch_size_schedule_follows_vllm():
    schedule = NgramConfig(method="ngram", num_speculative_tokens=4,
                           num_speculative_tokens_per_batch_size=[(32, 128, 2), (1, 2, 6), (3, 16, 0)])
    # sorted; capped at num_speculative_tokens; a gap (17-31) and the tail keep the range before them
    assert [schedule.tokens_for(b) for b in (1, 2, 3, 16, 17, 31, 32, 500)] == [4, 4, 0, 0, 0, 0, 2, 2]
    assert config().tokens_for(100) == 3
    for bad in ([(2, 4, 1)], [(1, 4, 1), (4, 8, 1)], [(1, 4, -1)], [(1, 0, 1)], []):
        with pytest.raises(ValidationError):
            NgramConfig(method="ngram", num_speculative_tokens=4, num_speculative_tokens_per_batch_size=bad)


def make(num_blocks: int = 64, speculation: NgramConfig | None = None) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, BLOCK, True), 8, 16, speculation)


def decode_ready(scheduler: Scheduler, prompt: list[int], first: int, **request) -> Request:
    """Admit and prefill a request; its first token is `first`."""
    req = Request("r", prompt, max_len=len(prompt) + 20, speculate=True, **request)
    scheduler.add(req)
    plan = scheduler.schedule()
    scheduler.update(plan, {seq: [first] for chunk in plan.chunks for seq in chunk.samples})
    return req


def test_a_decode_carries_the_draft_and_keeps_only_the_kept_tokens_computed():
    scheduler = make(speculation=config(k=3))
    req = decode_ready(scheduler, [1, 2, 3, 4, 5, 6, 1, 2], first=3)  # ..., 1, 2, 3: (1, 2, 3) recurs
    seq = req.seqs[0]
    plan = scheduler.schedule()
    (chunk,) = plan.chunks
    assert (chunk.start, chunk.tokens, chunk.draft) == (8, [3, 4, 5, 6], [4, 5, 6])
    assert len(seq.blocks) == 3  # room for positions 8..11
    # the model kept 4 and 5, then chose 9 where the draft said 6
    scheduler.update(plan, {seq: [4, 5, 9]})
    assert seq.tokens[-4:] == [3, 4, 5, 9] and seq.computed == 11  # KV of ..., 3, 4, 5; 9's comes next step
    assert len(seq.keys) == 2  # blocks 0-1 are full of kept tokens; block 2 holds 3, 4, 5 and a rejected 6


def test_speculation_is_off_unless_configured_and_asked():
    for scheduler, speculate in ((make(), True), (make(speculation=config()), False)):
        req = Request("r", [1, 2, 3, 4, 5, 6, 1, 2], max_len=28, speculate=speculate)
        scheduler.add(req)
        plan = scheduler.schedule()
        scheduler.update(plan, {req.seqs[0]: [3]})
        assert scheduler.schedule().chunks[0].draft == []


def test_a_draft_never_preempts_and_stays_within_the_request():
    scheduler = make(num_blocks=3, speculation=config(k=4))
    decode_ready(scheduler, [1, 2, 3, 4, 5, 6, 1, 2], first=3)
    assert scheduler.schedule().chunks[0].draft == []  # 4 guesses need a 4th block; one guess would fit
    scheduler = make(speculation=config(k=3))
    req = Request("r", [1, 2, 3, 4, 5, 6, 1, 2], max_len=11, speculate=True)
    scheduler.add(req)
    plan = scheduler.schedule()
    scheduler.update(plan, {req.seqs[0]: [3]})
    assert scheduler.schedule().chunks[0].draft == [4]  # 9 tokens of 11: one guess and the model's token


def test_no_drafts_at_batch_sizes_the_schedule_turns_off():
    speculation = NgramConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2,
                              num_speculative_tokens_per_batch_size=[(1, 1, 3), (2, 8, 0)])
    scheduler = make(speculation=speculation)
    requests = [Request(f"r{i}", [1, 2, 3, 4, 5, 6, 1, 2], max_len=28, speculate=True) for i in range(2)]
    scheduler.add(requests[0])
    plan = scheduler.schedule()
    scheduler.update(plan, {requests[0].seqs[0]: [3]})
    assert scheduler.schedule().chunks[0].draft == [4, 5, 6]  # alone: it guesses
    scheduler = make(speculation=speculation)
    for req in requests:
        scheduler.add(req)
    plan = scheduler.schedule()
    scheduler.update(plan, {req.seqs[0]: [3] for req in requests})
    assert [chunk.draft for chunk in scheduler.schedule().chunks] == [[], []]  # two running: none does


def test_choices_share_the_prompts_last_token_without_a_draft():
    """A cached prompt leaves its last token to compute: for n choices it is the leader's alone to run."""
    scheduler = make(speculation=config(k=3))
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2]  # (1, 2) recurs
    first = Request("a", prompt, max_len=20, speculate=True)
    scheduler.add(first)
    scheduler.update(scheduler.schedule(), {first.seqs[0]: [3]})
    scheduler.finish(first)  # its two full blocks stay in the prefix cache
    for n, draft in ((1, [3, 4, 5]), (2, [])):
        req = Request(f"n{n}", prompt, n=n, max_len=20, speculate=True)
        scheduler.add(req)
        plan = scheduler.schedule()
        assert [(chunk.start, chunk.draft) for chunk in plan.chunks] == [(8, draft)]
        scheduler.update(plan, {seq: [3] for chunk in plan.chunks for seq in chunk.samples})
        scheduler.finish(req)


def test_refused_drafts_back_off_and_a_kept_guess_resets():
    scheduler = make(speculation=config(k=1, low=1, high=1))
    req = decode_ready(scheduler, [5] * 8, first=5)  # every suffix recurs: a draft each step it may
    seq, drafted = req.seqs[0], []
    for refuse in [True] * 5 + [False] * 2:
        plan = scheduler.schedule()
        (chunk,) = plan.chunks
        drafted.append(bool(chunk.draft))
        scheduler.update(plan, {seq: [6] if refuse and chunk.draft else [5, 5] if chunk.draft else [5]})
    # refused: wait 1, then 2 steps; then a draft is kept and the next step drafts again
    assert drafted == [True, False, True, False, False, True, True]
