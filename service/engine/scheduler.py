"""The torch engine's scheduling policy, with no model: after vLLM V1's split.

`schedule()` returns a `StepPlan`: which token chunk of which sequence runs in the next forward
pass. The worker executes the plan and samples; `update(plan, sampled)` applies the results.

Every sequence is its tokens (prompt, then output) and how many of them have KV in its blocks;
a step computes the rest, or a chunk of it. One rule then covers prefill (many tokens), decode
(the one token sampled last step), a prompt partly found in the prefix cache, and a preempted
sequence that is recomputed. The policy:
- Running sequences go first, in admission order. A decode (one token) always runs; longer chunks
  share a budget of `chunk_tokens` per step, so a long prompt delays the others by one chunk.
- Waiting requests are admitted first come, first served, while the batch has room (`max_seqs`)
  and the KV cache has blocks for their first chunk; one that does not fit stops admission, so a
  large request is not starved by smaller ones behind it.
- When a running sequence needs a block and none is free, the most recently admitted request is
  preempted: its blocks are freed and it goes back to the head of the queue, to be recomputed from
  its tokens so far (the prefix cache often still holds them). Outputs do not change.
- A request's `n` choices share one prefill: the leader computes the prompt; the others then hold
  its full blocks and get a copy of its last, partial one.
- With n-gram speculation (`service.engine.ngram`), a decode of a request that allows it carries
  the guessed tokens after its own (`Chunk.draft`) where the cache has blocks for them without
  preempting anyone. Their KV counts as computed only for the guesses the step kept; blocks of the
  prefix cache hold only kept tokens, since a block is cached once it is full of computed ones. A
  sequence whose draft was refused in full drafts again only after 1, 2, 4 .. 16 plain steps
  (reset when a guess is kept): text that does not repeat pays for few refused drafts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from service.engine.base import RequestTooLargeError
from service.engine.kv_blocks import Block, BlockKey, BlockPool, chain_key
from service.engine.ngram import NgramConfig, NgramIndex

MAX_DRAFT_BACKOFF = 16  # the most plain steps between a sequence's drafts while they are refused


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int
    tokens: list[int]
    computed: int = 0  # tokens whose KV is in `blocks`
    blocks: list[Block] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)  # of the full, computed blocks
    finished: bool = False
    draft_backoff: int = 0  # steps without a draft after the last draft refused in full (0: none refused)
    draft_wait: int = 0  # steps left before the next draft
    ngrams: NgramIndex | None = None  # made at its first draft

    @property
    def to_compute(self) -> int:
        return len(self.tokens) - self.computed

    def block_table(self) -> list[int]:
        return [block.id for block in self.blocks]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    n: int = 1
    max_len: int = 0  # the most tokens (prompt and output) a choice may reach; 0: the prompt and one more
    owner: Any = None  # the engine's record of the request
    cache_root: int = 0  # seeds its prefix-cache keys: requests of different roots share no KV (LoRA adapters)
    reuse_cache: bool = True  # False: its prompt is computed in full (prompt logprobs need every position's logits)
    speculate: bool = False  # its decodes may carry n-gram guesses (greedy choices only: the engine decides)
    seqs: list[Sequence] = field(init=False)
    forked: bool = field(init=False)  # the choices past the first have their own blocks

    def __post_init__(self) -> None:
        self.seqs = [Sequence(self, i, list(self.prompt)) for i in range(self.n)]
        self.forked = self.n == 1
        self.max_len = self.max_len or len(self.prompt) + 1

    def active(self) -> list[Sequence]:
        """The sequences scheduled on their own: all of them, or only the leader before the fork."""
        return [seq for seq in (self.seqs if self.forked else self.seqs[:1]) if not seq.finished]


@dataclass
class Chunk:
    seq: Sequence
    start: int
    tokens: list[int]
    samples: list[Sequence]  # who samples from the logits after the chunk's last token (none mid-prompt)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, target) blocks, after the forward
    draft: list[int] = field(default_factory=list)  # guessed tokens after the decode's own (the last of `tokens`)

    @property
    def decode(self) -> bool:
        """One token of the sequence's own (a decode, or a prompt's last), with or without a draft."""
        return len(self.tokens) - len(self.draft) == 1


@dataclass
class StepPlan:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, pool: BlockPool, max_seqs: int, chunk_tokens: int = 256,
                 speculation: NgramConfig | None = None) -> None:
        self.pool = pool
        self.speculation = speculation
        self._draft_tokens = 0  # per sequence in this step, as the batch size has it (NgramConfig.tokens_for)
        self.max_seqs = max_seqs
        self.chunk_tokens = chunk_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache (vLLM's names)
        self.prefix_hits = 0  # of which found there
        self.preemptions = 0

    # -- requests in and out ------------------------------------------------------------------
    def check_fits(self, request: Request) -> None:
        """Refuse a request that could not run even alone: its choices at their longest need more blocks
        than the cache has (sharing the prompt's would save some; the bound need not be tight)."""
        need = request.n * self.pool.blocks_for(request.max_len)
        if need > self.pool.num_blocks:
            raise RequestTooLargeError(
                f"{request.n} choice(s) of {request.max_len} tokens need {need} KV-cache blocks of "
                f"{self.pool.block_size} tokens; the cache has {self.pool.num_blocks} (NIM_KV_CACHE_TOKENS)")

    def add(self, request: Request) -> None:
        """Queue a request that `check_fits` accepted."""
        self.waiting.append(request)

    def finish(self, request: Request) -> None:
        """The request ended (stopped, aborted, failed): its blocks are free from this call on.
        Call it between steps, never between `schedule` and `update`."""
        if request in self.running:
            self.running.remove(request)
            for seq in request.seqs:
                self._free(seq)
        elif request in self.waiting:
            self.waiting.remove(request)

    def finish_seq(self, seq: Sequence) -> None:
        """One choice ended while others go on: it is not scheduled again and frees its blocks."""
        seq.finished = True
        if seq.request in self.running:
            self._free(seq)

    @property
    def num_running_seqs(self) -> int:
        return sum(request.n for request in self.running)

    # -- a step ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._draft_tokens = self.speculation.tokens_for(self.num_running_seqs) if self.speculation else 0
        budget = self.chunk_tokens
        for request in list(self.running):
            if request in plan.preempted:
                continue
            for seq in request.active():
                budget = self._schedule_seq(seq, budget, plan)
                if request in plan.preempted:
                    break
        self._admit(budget, plan)
        return plan

    def _schedule_seq(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """Plan the sequence's next chunk if the budget and the cache allow; returns the budget left."""
        size = 1 if seq.to_compute == 1 else min(seq.to_compute, budget)
        if size == 0:
            return budget
        request = seq.request
        completes_prompt = not request.forked and seq.computed + size == len(seq.tokens)
        need = self.pool.blocks_for(seq.computed + size) - len(seq.blocks)
        if completes_prompt and len(seq.tokens) % self.pool.block_size:
            need += request.n - 1  # each other choice's copy of the last, partial block
        while need > self.pool.num_free:
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return budget
        draft = self._draft(seq) if size == 1 else []
        seq.blocks += self.pool.allocate(self.pool.blocks_for(seq.computed + size + len(draft)) - len(seq.blocks))
        chunk = Chunk(seq, seq.computed, seq.tokens[seq.computed:seq.computed + size] + draft, [seq], draft=draft)
        if completes_prompt:
            chunk.copies = self._fork(request)
            chunk.samples = request.seqs
        elif seq.computed + size < len(seq.tokens):
            chunk.samples = []
        plan.chunks.append(chunk)
        return budget - size if size > 1 else budget

    def _draft(self, seq: Sequence) -> list[int]:
        """The n-gram guess for a decode, within the request's length; none where its KV would need
        blocks the cache does not have free (speculation never preempts)."""
        if self.speculation is None or not seq.request.speculate or not seq.request.forked:
            return []  # before the fork, the leader's token is every choice's: it takes no draft
        if seq.draft_wait:
            seq.draft_wait -= 1
            return []
        count = min(self._draft_tokens, seq.request.max_len - len(seq.tokens) - 1)
        if count <= 0:
            return []
        seq.ngrams = seq.ngrams or NgramIndex(self.speculation)
        draft = seq.ngrams.propose(seq.tokens, count)
        if draft and self.pool.blocks_for(seq.computed + 1 + len(draft)) - len(seq.blocks) > self.pool.num_free:
            return []
        return draft

    def _fork(self, request: Request) -> list[tuple[int, int]]:
        """The other choices hold the leader's full prompt blocks and a copy of its partial one."""
        leader, copies = request.seqs[0], []
        full = len(leader.tokens) // self.pool.block_size
        for seq in request.seqs[1:]:
            shared = leader.blocks[:full]
            self.pool.acquire(shared)
            seq.blocks = shared
            if len(leader.blocks) > full:
                (copy,) = self.pool.allocate(1)
                seq.blocks = shared + [copy]
                copies.append((leader.blocks[full].id, copy.id))
        request.forked = True
        return copies

    def _admit(self, budget: int, plan: StepPlan) -> None:
        while self.waiting and self.num_running_seqs + self.waiting[0].n <= self.max_seqs:
            if plan.preempted:  # memory is short: admitting now would only preempt again
                return
            request = self.waiting[0]
            leader = request.seqs[0]
            hit = self._cached_prefix(leader)
            size = min(leader.to_compute - len(hit) * self.pool.block_size, max(budget, 1))
            if budget <= 0 and size > 1:
                return
            fresh = self.pool.blocks_for(len(hit) * self.pool.block_size + size) - len(hit)
            if fresh + sum(block.refs == 0 for block in hit) > self.pool.num_free:
                return
            self.waiting.popleft()
            for seq in request.active():
                self._take_cached_prefix(seq, hit if seq is leader else self._cached_prefix(seq))
            self.running.append(request)
            for seq in request.active():
                budget = self._schedule_seq(seq, budget, plan)

    def _cached_prefix(self, seq: Sequence) -> list[Block]:
        request = seq.request
        return self.pool.cached_prefix(seq.tokens, request.cache_root) if request.reuse_cache else []

    def _take_cached_prefix(self, seq: Sequence, hit: list[Block]) -> None:
        self.pool.acquire(hit)
        self.prefix_queries += len(seq.tokens)
        self.prefix_hits += len(hit) * self.pool.block_size
        seq.blocks, seq.computed = hit, len(hit) * self.pool.block_size
        seq.keys = [block.key for block in hit]  # found in the cache, so keyed already

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Free the request's blocks and requeue it first; it is recomputed from its tokens."""
        self.running.remove(request)
        self.preemptions += 1
        for seq in request.seqs:
            self._free(seq)
        plan.chunks = [chunk for chunk in plan.chunks if chunk.seq.request is not request]
        plan.preempted.append(request)
        self.waiting.appendleft(request)

    def _free(self, seq: Sequence) -> None:
        self.pool.free(seq.blocks)
        seq.blocks, seq.keys, seq.computed = [], [], 0

    # -- results -----------------------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: dict[Sequence, list[int]]) -> None:
        """Apply a step: the chunks' KV is in the cache, and each sequence's new tokens join it (one,
        or after a draft the guesses kept and the model's next token)."""
        for seq, tokens in sampled.items():
            seq.tokens += tokens
        for chunk in plan.chunks:
            seq = chunk.seq
            kept = max(len(sampled.get(seq, ())) - 1, 0) if chunk.draft else 0
            seq.computed = chunk.start + len(chunk.tokens) - len(chunk.draft) + kept
            if chunk.draft:
                seq.draft_backoff = 0 if kept else min(max(2 * seq.draft_backoff, 1), MAX_DRAFT_BACKOFF)
                seq.draft_wait = seq.draft_backoff
            self._cache_full_blocks(seq)
            for other in chunk.samples:
                if other is not seq:  # a choice forked off this prompt
                    other.computed, other.keys = seq.computed, list(seq.keys)

    def _cache_full_blocks(self, seq: Sequence) -> None:
        size = self.pool.block_size
        for index in range(len(seq.keys), seq.computed // size):
            key = chain_key(seq.keys[-1] if seq.keys else None, seq.tokens[index * size:(index + 1) * size],
                            seq.request.cache_root)
            seq.keys.append(key)
            self.pool.cache(seq.blocks[index], key)
