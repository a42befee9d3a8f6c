"""The scheduling policy and the paged KV cache's bookkeeping, with no model: plans in, tokens out."""

from __future__ import annotations

import pytest

from service.engine.kv_blocks import BlockPool, block_keys
from service.engine.scheduler import Request, Scheduler, StepPlan

BLOCK = 4


def make(num_blocks: int = 64, max_seqs: int = 8, chunk: int = 16, caching: bool = True) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, BLOCK, caching), max_seqs, chunk)


def prompt(length: int, first: int = 100) -> list[int]:
    return list(range(first, first + length))


def step(scheduler: Scheduler, token: int = 7) -> StepPlan:
    """One step as the worker runs it: every sequence that samples gets `token`."""
    plan = scheduler.schedule()
    scheduler.update(plan, {seq: [token] for chunk in plan.chunks for seq in chunk.samples})
    return plan


def shape(plan: StepPlan) -> list[tuple[str, int, int]]:
    return [(chunk.seq.request.request_id, chunk.start, len(chunk.tokens)) for chunk in plan.chunks]


def test_a_prompt_is_prefilled_in_chunks_then_decoded_one_token_a_step():
    scheduler = make(chunk=16)
    scheduler.add(Request("a", prompt(40)))
    assert shape(step(scheduler)) == [("a", 0, 16)]
    assert shape(step(scheduler)) == [("a", 16, 16)]
    last = step(scheduler)
    assert shape(last) == [("a", 32, 8)] and last.chunks[0].samples  # the prompt's end samples
    assert shape(step(scheduler)) == [("a", 40, 1)]
    seq = scheduler.running[0].seqs[0]
    assert seq.tokens[40:] == [7, 7] and seq.computed == 41
    assert len(seq.blocks) == 11  # ceil(41 / 4): memory follows the tokens held


def test_the_chunk_budget_is_shared_in_admission_order_and_decodes_always_run():
    scheduler = make(chunk=16)
    scheduler.add(Request("short", prompt(6)))
    step(scheduler)  # short is decoding now
    scheduler.add(Request("long1", prompt(30, 300)))
    scheduler.add(Request("long2", prompt(30, 500)))
    assert shape(step(scheduler)) == [("short", 6, 1), ("long1", 0, 16)]
    assert shape(step(scheduler)) == [("short", 7, 1), ("long1", 16, 14), ("long2", 0, 2)]
    assert shape(step(scheduler)) == [("short", 8, 1), ("long1", 30, 1), ("long2", 2, 16)]


def test_admission_is_first_come_first_served_and_bounded_by_max_seqs():
    scheduler = make(max_seqs=3)
    scheduler.add(Request("a", prompt(3)))
    scheduler.add(Request("b", prompt(3), n=3))  # does not fit next to a: it waits, and so does c
    scheduler.add(Request("c", prompt(3)))
    assert [r.request_id for r in scheduler.running] == [] and shape(step(scheduler)) == [("a", 0, 3)]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    scheduler.finish(scheduler.running[0])
    step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["b"] and [r.request_id for r in scheduler.waiting] == ["c"]


def test_n_choices_share_one_prefill_and_fork_with_a_copy_of_the_partial_block():
    scheduler = make()
    scheduler.add(Request("n", prompt(6), n=3))
    plan = step(scheduler)
    assert shape(plan) == [("n", 0, 6)]
    (chunk,) = plan.chunks
    leader, *others = scheduler.running[0].seqs
    assert chunk.samples == [leader, *others]
    full, partial = leader.blocks
    assert all(seq.blocks[0] is full for seq in others) and full.refs == 3
    assert [source for source, _ in chunk.copies] == [partial.id, partial.id]
    assert {target for _, target in chunk.copies} == {seq.blocks[1].id for seq in others}
    assert shape(step(scheduler)) == [("n", 6, 1)] * 3


def test_preemption_recomputes_the_newest_request_and_keeps_its_tokens():
    scheduler = make(num_blocks=6, caching=False)
    scheduler.add(Request("old", prompt(8)))
    scheduler.add(Request("new", prompt(8, 200)))
    step(scheduler)  # both prefilled: 2 blocks each
    assert scheduler.pool.num_free == 2
    for _ in range(5):  # positions 8..12: the third blocks are taken, then a fourth is needed
        plan = step(scheduler)
    assert plan.preempted and plan.preempted[0].request_id == "new"
    assert [r.request_id for r in scheduler.running] == ["old"]
    new = scheduler.waiting[0]
    assert new.request_id == "new" and new.seqs[0].computed == 0 and new.seqs[0].blocks == []
    assert len(new.seqs[0].tokens) > 8, "its output so far is kept, to be recomputed"
    scheduler.finish(scheduler.running[0])
    plan = step(scheduler)
    assert shape(plan) == [("new", 0, len(new.seqs[0].tokens) - 1)]


def test_abort_frees_blocks_at_once_and_drops_a_waiting_request():
    scheduler = make(max_seqs=1)
    scheduler.add(Request("a", prompt(10)))
    scheduler.add(Request("b", prompt(10)))
    step(scheduler)
    assert scheduler.pool.num_used == 3
    scheduler.finish(scheduler.waiting[0])
    scheduler.finish(scheduler.running[0])
    assert scheduler.pool.num_used == 0 and not scheduler.waiting and not scheduler.running
    assert step(scheduler).empty


def test_a_shared_prefix_is_computed_once_and_counted():
    scheduler = make()
    system = prompt(12)
    scheduler.add(Request("first", system + [1, 2]))
    step(scheduler)
    scheduler.finish(scheduler.running[0])
    scheduler.add(Request("second", system + [3, 4, 5]))
    plan = step(scheduler)
    assert shape(plan) == [("second", 12, 3)], "the 3 full blocks of the prefix come from the cache"
    assert (scheduler.prefix_queries, scheduler.prefix_hits) == (14 + 15, 12)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    scheduler = make()
    scheduler.add(Request("a", prompt(8)))
    step(scheduler)
    scheduler.finish(scheduler.running[0])
    scheduler.add(Request("b", prompt(8)))
    assert shape(step(scheduler)) == [("b", 4, 4)], "the last block is recomputed: its logits start the output"


def test_a_request_that_scores_its_prompt_computes_all_of_it_and_still_fills_the_cache():
    scheduler = make()
    scheduler.add(Request("a", prompt(12)))
    step(scheduler)
    scheduler.finish(scheduler.running[0])
    scheduler.add(Request("scored", prompt(12), reuse_cache=False))  # prompt logprobs: every position's logits
    assert shape(step(scheduler)) == [("scored", 0, 12)]
    scheduler.finish(scheduler.running[0])
    scheduler.add(Request("b", prompt(12)))
    assert shape(step(scheduler)) == [("b", 8, 4)]


def test_without_caching_nothing_is_reused():
    scheduler = make(caching=False)
    for name in ("a", "b"):
        scheduler.add(Request(name, prompt(12)))
        assert shape(step(scheduler)) == [(name, 0, 12)]
        scheduler.finish(scheduler.running[0])
    assert scheduler.prefix_hits == 0


def test_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(4, BLOCK)
    a, b = pool.allocate(2)
    keys = block_keys(prompt(8), BLOCK)
    pool.cache(a, keys[0])
    pool.cache(b, keys[1])
    pool.free([a, b])  # the tail (b) is freed first, so it goes first
    assert pool.num_free == 4
    taken = pool.allocate(3)  # two never-used blocks, then b
    assert b in taken and a not in taken
    assert pool.cached_prefix(prompt(8) + [0]) == [a]


def test_a_request_larger_than_the_cache_is_refused():
    with pytest.raises(ValueError, match="blocks"):
        make(num_blocks=2).check_fits(Request("big", prompt(20)))


def test_a_forked_request_that_no_longer_fits_waits_instead_of_looping():
    """Preempted after its fork, a request's choices each need their own blocks on readmission."""
    scheduler = make(num_blocks=13, caching=False)  # each request fits alone (13 and 5 blocks), not both
    scheduler.add(Request("n", prompt(6), n=3))
    step(scheduler)  # forked: 1 shared block + 3 partial ones
    scheduler.add(Request("other", prompt(10, 300)))
    preempted, finished = 0, []
    for _ in range(200):  # each schedule() returns; requests end at 20 tokens, every one gets there
        preempted += len(step(scheduler).preempted)
        for request in list(scheduler.running):
            if all(len(seq.tokens) >= 20 for seq in request.seqs):
                scheduler.finish(request)
                finished.append(request.request_id)
    assert preempted and sorted(finished) == ["n", "other"]
