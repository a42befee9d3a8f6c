"""Continuous batching in the torch engine, driven in-process with the real tiny model."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest

from factory.tinymodel import memorised_pairs
from service.engine.base import (EngineError, GenerationRequest, RequestTooLargeError,
                                 SamplingParams)
from service.engine.torch_engine import TorchEngine

PAIRS = memorised_pairs()
_ids = itertools.count()


@pytest.fixture
async def engine(tiny_model_dir):
    engine = TorchEngine(tiny_model_dir, max_num_seqs=32)
    await engine.start()
    yield engine
    await engine.shutdown()


def request(engine: TorchEngine, prompt: str, **params) -> GenerationRequest:
    ids = engine.tokenizer(prompt)["input_ids"]
    return GenerationRequest(f"r{next(_ids)}", ids, SamplingParams(**params))


async def collect(engine: TorchEngine, req: GenerationRequest) -> dict[int, list[int]]:
    """Token ids per choice."""
    tokens: dict[int, list[int]] = {}
    async for deltas in engine.generate(req):
        for d in deltas:
            tokens.setdefault(d.index, []).extend(d.token_ids)
    return tokens


def varied_requests(engine, count: int) -> list[GenerationRequest]:
    """Different prompt lengths and different output lengths (max_tokens, or the natural stop)."""
    reqs = []
    for i in range(count):
        prompt, _ = PAIRS[i]
        reqs.append(request(engine, prompt * (1 + i % 3), temperature=0, max_tokens=5 + 7 * i,
                            ignore_eos=i % 2 == 0))
    return reqs


async def test_weights_load_on_the_thread_that_runs_the_steps(tiny_model_dir):
    """One thread runs every parallel torch op, so OpenMP keeps a single team (see TorchEngine.start)."""
    engine = TorchEngine(tiny_model_dir)
    loaders, real_load = [], engine._load

    def load() -> None:
        loaders.append(threading.current_thread())
        real_load()

    engine._load = load
    await engine.start()
    try:
        assert loaders == [engine._thread]
        assert await collect(engine, request(engine, PAIRS[0][0], temperature=0, max_tokens=4))
    finally:
        await engine.shutdown()


async def test_a_failed_load_fails_start(tiny_model_dir):
    engine = TorchEngine(tiny_model_dir)

    def load() -> None:  # a test double for unreadable weights
        raise OSError("weights unreadable")

    engine._load = load
    with pytest.raises(OSError, match="weights unreadable"):
        await engine.start()
    assert not engine.ready


async def test_greedy_outputs_do_not_change_in_a_batch(engine):
    reqs = varied_requests(engine, 16)
    alone = [await collect(engine, r) for r in reqs]
    together = await asyncio.gather(*(collect(engine, r) for r in reqs))
    assert together == alone
    assert len({len(t[0]) for t in alone}) > 8, "the requests really differ in length"


async def test_seeded_sampling_is_reproducible_in_mixed_batches(engine):
    sampled = [request(engine, PAIRS[i][0], temperature=1.2, top_p=0.95, top_k=50, seed=100 + i, max_tokens=24,
                       ignore_eos=True) for i in range(6)]
    greedy = varied_requests(engine, 6)
    alone = [await collect(engine, r) for r in sampled + greedy]
    together = await asyncio.gather(*(collect(engine, r) for r in sampled + greedy))
    assert together == alone
    n_choices = request(engine, "The", temperature=1.0, seed=5, n=3, max_tokens=12, ignore_eos=True)
    assert await collect(engine, n_choices) == (await asyncio.gather(collect(engine, n_choices), *(
        collect(engine, r) for r in greedy)))[0]


async def test_short_request_joins_and_leaves_while_a_long_one_runs(engine):
    long = request(engine, "A", temperature=0, max_tokens=480, ignore_eos=True)
    long_alone = await collect(engine, long)
    progress: list[int] = []

    async def run_long():
        tokens = []
        async for deltas in engine.generate(long):
            tokens += [t for d in deltas for t in d.token_ids]
            progress.append(len(tokens))
        return {0: tokens}

    task = asyncio.create_task(run_long())
    while not progress or progress[-1] < 20:
        await asyncio.sleep(0.001)
    short = request(engine, PAIRS[3][0], temperature=0, max_tokens=30)
    short_tokens = await collect(engine, short)
    assert progress[-1] < 480, "the short request finished while the long one was still decoding"
    assert engine.stats().running == 1
    assert short_tokens == await collect(engine, short)
    assert await task == long_alone


async def test_abort_mid_batch_frees_the_blocks_and_spares_the_others(engine):
    survivor = request(engine, PAIRS[1][0], temperature=0, max_tokens=200, ignore_eos=True)
    expected = await collect(engine, survivor)
    victim = request(engine, "B", temperature=0, max_tokens=400, ignore_eos=True)
    victim_stream = engine.generate(victim)
    survivor_task = asyncio.create_task(collect(engine, survivor))
    received = 0
    async for deltas in victim_stream:
        received += sum(len(d.token_ids) for d in deltas)
        if received >= 5:
            break
    await victim_stream.aclose()  # what a client disconnect does
    for _ in range(200):
        if engine.stats().running <= 1:
            break
        await asyncio.sleep(0.001)
    assert engine.stats().running <= 1
    assert await survivor_task == expected
    assert engine.stats().running == 0 and engine.pool.num_used == 0


async def test_requests_wait_for_slots(tiny_model_dir):
    engine = TorchEngine(tiny_model_dir, max_num_seqs=2)
    await engine.start()
    try:
        reqs = [request(engine, "C", temperature=0, max_tokens=480, ignore_eos=True) for _ in range(4)]
        running = [engine.generate(r) for r in reqs[:2]]
        await asyncio.gather(*(anext(s) for s in running))  # both admitted: every slot is taken
        waiting = [engine.generate(r) for r in reqs[2:4]]
        assert engine.stats().running == 2 and engine.stats().waiting == 2
        for stream in running:  # finishing the running ones lets the waiting ones in
            await stream.aclose()
        assert all([await anext(s) for s in waiting])
        for stream in waiting:
            await stream.aclose()
    finally:
        await engine.shutdown()


async def test_kv_cache_usage_moves_with_the_batch(engine):
    assert engine.stats().kv_cache_usage == 0
    seen = []
    async for _ in engine.generate(request(engine, "D", temperature=0, max_tokens=300, n=4, ignore_eos=True)):
        seen.append(engine.stats().kv_cache_usage)
    assert max(seen) > seen[0] > 0
    # 4 choices x ~300 tokens of a 32 x 512 cache
    assert max(seen) == pytest.approx(4 * 301 / (32 * 512), abs=0.005)
    assert engine.stats().kv_cache_usage == 0


async def test_a_failing_request_fails_alone(engine, monkeypatch):
    # Fault injection (a test double): a forward pass that raises cannot be caused with valid input.
    real_forward = engine.runner.forward
    poison = engine.tokenizer("poison")["input_ids"]

    def forward(chunks, *rest):
        if any(tokens == poison for tokens, _, _ in chunks):
            raise RuntimeError("injected prefill failure")
        return real_forward(chunks, *rest)

    monkeypatch.setattr(engine.runner, "forward", forward)
    good = request(engine, PAIRS[2][0], temperature=0, max_tokens=20)
    expected = await collect(engine, good)
    bad = GenerationRequest("bad", poison, SamplingParams(max_tokens=5))
    results = await asyncio.gather(collect(engine, good), collect(engine, bad), return_exceptions=True)
    assert results[0] == expected
    assert isinstance(results[1], EngineError) and "injected" not in str(results[1]), "internal text is for the log"
    assert engine.ready


async def test_a_broken_engine_turns_unready(engine, monkeypatch):
    # Fault injection (a test double): every decode fails, as on a GPU that has faulted.
    def forward(chunks, *rest):
        if all(len(tokens) == 1 for tokens, _, _ in chunks):  # decode steps only
            raise RuntimeError("device lost")
        return real_forward(chunks, *rest)

    real_forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", forward)
    for i in range(3):
        with pytest.raises(EngineError):
            await collect(engine, request(engine, f"E{i}", max_tokens=5, ignore_eos=True))
    assert not engine.ready
    with pytest.raises(EngineError, match="in a row"):
        engine.generate(request(engine, "F"))


async def test_decodes_that_fail_beside_a_prompt_that_passes_are_the_engines_failure(engine, monkeypatch):
    # Fault injection (a test double): once broken, every decode fails and prompts pass, as on a GPU
    # that has faulted. A prompt that joins a decode's step must not hide the failed decode.
    real_forward, broken = engine.runner.forward, threading.Event()

    def forward(chunks, *rest):
        if broken.is_set() and any(len(tokens) == 1 for tokens, _, _ in chunks):
            raise RuntimeError("device lost")
        return real_forward(chunks, *rest)

    monkeypatch.setattr(engine.runner, "forward", forward)

    async def decoding_then_joined() -> None:
        async for _ in engine.generate(request(engine, "A", max_tokens=50, ignore_eos=True)):
            if not broken.is_set():  # A decodes; B's prompt joins its next step
                broken.set()
                joined.append(asyncio.ensure_future(collect(engine, request(engine, "B" * 40, max_tokens=5))))

    joined: list[asyncio.Future] = []
    with pytest.raises(EngineError):
        await decoding_then_joined()
    with pytest.raises(EngineError):
        await joined[0]
    with pytest.raises(EngineError):
        await collect(engine, request(engine, "C", max_tokens=5))
    assert not engine.ready, "three steps of failed decodes in a row"


async def test_a_prefix_cache_hit_gives_the_same_greedy_output_and_is_counted(tiny_model_dir):
    cached = TorchEngine(tiny_model_dir, max_num_seqs=8)
    uncached = TorchEngine(tiny_model_dir, max_num_seqs=8, enable_prefix_caching=False)
    for engine in (cached, uncached):
        await engine.start()
    try:
        system = " ".join(prompt for prompt, _ in PAIRS[:4])  # a shared prefix of several blocks
        reqs = [request(cached, system + " " + PAIRS[i][0], temperature=0, max_tokens=24, ignore_eos=True)
                for i in range(4, 8)]
        first = await collect(cached, reqs[0])
        hits_before = cached.stats().prefix_cache_hits
        outputs = [first] + list(await asyncio.gather(*(collect(cached, r) for r in reqs[1:])))
        stats = cached.stats()
        shared = len(cached.tokenizer(system)["input_ids"]) // 16 * 16
        assert stats.prefix_cache_hits - hits_before >= 3 * (shared - 16), "later requests found the prefix"
        assert stats.prefix_cache_queries >= sum(len(r.prompt_token_ids) for r in reqs)
        assert outputs == [await collect(uncached, r) for r in reqs], "greedy outputs do not change with a hit"
        assert uncached.stats().prefix_cache_hits == 0
    finally:
        for engine in (cached, uncached):
            await engine.shutdown()


async def test_kv_memory_follows_the_tokens_held(tiny_model_dir):
    """32 sequences of 64 + 8 tokens at max_model_len 512 touch (make resident) the blocks their
    tokens fill, under 1/4 of what one max_model_len slot each would reserve. Counted once they
    are done, as the blocks ever zeroed: how many still run at a given moment is the engine's
    speed (a fast one finished all 32 before every first token reached this test)."""
    engine = TorchEngine(tiny_model_dir, max_num_seqs=32, max_model_len=512)
    await engine.start()
    try:
        reqs = [GenerationRequest(f"m{i}", [1] + [10 + i] * 63, SamplingParams(temperature=0, max_tokens=8,
                                                                                ignore_eos=True)) for i in range(32)]
        outputs = await asyncio.gather(*(collect(engine, r) for r in reqs))
        assert all(len(tokens[0]) == 8 for tokens in outputs)
        per_slot = 32 * engine.pool.blocks_for(512)
        assert engine.runner.zeroed <= 32 * engine.pool.blocks_for(64 + 8) <= per_slot / 4, (
            f"{engine.runner.zeroed} blocks touched")
    finally:
        await engine.shutdown()


async def test_a_request_larger_than_the_kv_cache_is_refused_at_once(tiny_model_dir):
    engine = TorchEngine(tiny_model_dir, max_num_seqs=4, max_model_len=256, kv_cache_tokens=256)
    await engine.start()
    try:
        with pytest.raises(RequestTooLargeError, match="NIM_KV_CACHE_TOKENS"):
            engine.generate(request(engine, "G", n=4, max_tokens=200))
        assert await collect(engine, request(engine, "G", n=1, max_tokens=200, temperature=0))
    finally:
        await engine.shutdown()


async def test_preempted_requests_finish_with_the_outputs_they_would_have_had(tiny_model_dir):
    """A cache too small for the batch: sequences are preempted, recomputed, and greedy output holds."""
    engine = TorchEngine(tiny_model_dir, max_num_seqs=8, max_model_len=256, kv_cache_tokens=320,
                         enable_prefix_caching=False)
    await engine.start()
    try:
        reqs = [request(engine, PAIRS[i][0], temperature=0, max_tokens=100, ignore_eos=True) for i in range(6)]
        alone = [await collect(engine, r) for r in reqs]
        assert await asyncio.gather(*(collect(engine, r) for r in reqs)) == alone
        assert engine.scheduler.preemptions > 0
    finally:
        await engine.shutdown()


def with_vocabulary_rows(model_dir, out, rows: int):
    """A copy of the model with `rows` vocabulary rows. Past its tokenizer's, padding as many real
    models have (Qwen2.5: 151936 rows for 151665 tokens), drawn wider than the trained rows so that
    sampling picks them often; short of it, a tokenizer given tokens the model was not resized for."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            kept = weights[name][:rows]
            extra = torch.randn(rows - len(kept), kept.shape[1], generator=generator) * 3 * kept.std()
            weights[name] = torch.cat([kept, extra])
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "vocab_size": rows}))
    return out


async def test_tokens_past_the_tokenizers_vocabulary_have_no_text_and_the_engine_lives_on(tiny_model_dir, tmp_path):
    """A sampled id in the model's padded rows decodes to no text (as vLLM's detokenizer does), with
    its logprob's token text too; it used to end the engine (an IndexError in the detokenizer's table)."""
    engine = TorchEngine(with_vocabulary_rows(tiny_model_dir, tmp_path / "padded", 640 + 64))
    await engine.start()
    try:
        known = len(engine.tokenizer)
        assert engine.vocab_size == known + 64
        req = request(engine, "Hello", temperature=1.0, seed=0, max_tokens=64, ignore_eos=True, logprobs=1)
        ids, text, shown = [], "", []
        async for deltas in engine.generate(req):
            for d in deltas:
                ids += d.token_ids
                text += d.text
                shown += [(t.token_id, t.token) for lp in d.logprobs for t in (lp, *lp.top)]
        padded = [i for i in ids if i >= known]
        assert len(ids) == 64 and padded, "the seed's draws reach the padded rows"
        assert text == engine.tokenizer.decode([i for i in ids if i < known], skip_special_tokens=True)
        assert all(token == "" for token_id, token in shown if token_id >= known)
        after = await collect(engine, request(engine, PAIRS[0][0], temperature=0, max_tokens=4))
        assert len(after[0]) == 4
    finally:
        await engine.shutdown()


async def test_a_prompt_id_past_the_models_embedding_rows_is_refused_and_the_engine_lives_on(tiny_model_dir, tmp_path):
    """A tokenizer may know ids the model has no embedding row for (tokens added and the embeddings
    not resized). Such a prompt is a 400 before it is queued; three of them in a row used to fail
    three forward passes, which the engine takes for a broken device, and end it."""
    engine = TorchEngine(with_vocabulary_rows(tiny_model_dir, tmp_path / "short", 600))
    await engine.start()
    try:
        for i in range(4):
            with pytest.raises(RequestTooLargeError, match="past this model's vocabulary of 600"):
                engine.generate(GenerationRequest(f"past{i}", [5, 6, 620], SamplingParams(max_tokens=3)))
        assert engine.ready
        within = await collect(engine, GenerationRequest("within", [5, 6, 599], SamplingParams(max_tokens=3)))
        assert len(within[0]) == 3
    finally:
        await engine.shutdown()


async def test_an_empty_prompt_is_refused_and_takes_no_place(engine):
    """A prompt of no tokens (an empty text from a tokenizer without BOS, or without special tokens)
    has nothing to compute a first token from: it was queued and never ran, holding its client for
    as long as the client waited."""
    with pytest.raises(RequestTooLargeError, match="no tokens"):
        engine.generate(GenerationRequest("empty", [], SamplingParams(max_tokens=3)))
    assert engine.stats().waiting == engine.stats().running == 0
    after = await collect(engine, request(engine, PAIRS[0][0], temperature=0, max_tokens=2))
    assert len(after[0]) == 2
