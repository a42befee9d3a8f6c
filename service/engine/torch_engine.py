"""The in-process torch engine: transformers weights, continuous batching on a worker thread.

Scheduling is per token step, as in vLLM and TGI. Each step of the worker thread:
1. admits waiting requests while KV-cache slots are free (one slot per choice; `n` choices share
   one prefill and copy its cache),
2. prefills prompts in chunks of at most `PREFILL_CHUNK_TOKENS` tokens in total. Chunking (rather
   than whole prompts, batched) bounds how long one step can take, so a long prompt delays the
   running sequences' next token by at most one chunk of compute,
3. decodes one token for every running sequence in one batched forward pass, each sequence at its
   own position in its own cache slot (`LlamaRunner`),
4. hands each request its new tokens; finished sequences free their slots at once, so a short
   request never waits for a long one and a new one can join at the next step.

The worker thread owns the model, so the event loop never waits on a forward pass; results cross
back to the loop through each request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import logging
import os
import threading
from collections import defaultdict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from service.engine.base import (ChoiceDelta, Engine, EngineError, EngineStats, GenerationRequest,
                                 QueueFullError, SamplingParams)
from service.engine.llama_runner import LlamaRunner
from service.engine.sampling import make_generator, process_logits, sample_token, token_logprob
from service.engine.sequence import SequenceOutput, detokenizer_factory

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PREFILL_CHUNK_TOKENS = 256
MAX_CONSECUTIVE_FAILURES = 3  # forward passes failing in a row: the engine is broken, not a request


@dataclass(eq=False)
class _Sequence:
    """One choice of a request, bound to one KV-cache slot."""

    state: _RequestState
    output: SequenceOutput
    generator: torch.Generator
    slot: int
    cached: int = 0  # tokens written to the slot's cache
    next_token: int | None = None  # sampled, not yet in the cache


@dataclass(eq=False)
class _RequestState:
    request: GenerationRequest
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    aborted: bool = False
    done: bool = False
    seqs: list[_Sequence] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the leader's cache
    error: EngineError | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def emit(self, item: list[ChoiceDelta] | BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


_NOTHING = object()  # no item held back (None is the end of a stream)


def _deliver(batch: list[tuple[_RequestState, list[ChoiceDelta]]]) -> None:
    """Runs on the event loop: hand each request its step's deltas."""
    for state, items in batch:
        state.queue.put_nowait(items)


class TorchEngine(Engine):
    def __init__(self, model_dir: Path, *, device: str = "cpu", precision: str = "fp32",
                 max_model_len: int | None = None, max_num_seqs: int = 32, max_queue: int = 256,
                 cpu_threads: int | None = None) -> None:
        if precision not in DTYPES:
            raise ValueError(f"the torch engine runs {', '.join(DTYPES)}; not {precision!r}")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = DTYPES[precision]
        self.max_num_seqs = max_num_seqs
        self.max_queue = max_queue
        # On CPU the forward pass leaves one core to the event loop: with every core in torch's
        # pool, its threads and the HTTP side preempt each other and each step takes twice as long.
        self.cpu_threads = cpu_threads or max(1, len(os.sched_getaffinity(0)) - 1)
        self._load_tokenizer(max_model_len)
        self._waiting: deque[_RequestState] = deque()
        self._active: list[_RequestState] = []
        self._free_slots = list(range(max_num_seqs))  # a heap: the lowest free slot first
        self._cond = threading.Condition()
        self._stopping = False
        self._ready = False
        self._dead: str | None = None
        self._failures = 0
        self._thread: threading.Thread | None = None

    def describe(self) -> str:
        return (f"torch (in-process) on {self.device.type}, {self.dtype}, max_num_seqs={self.max_num_seqs}, "
                f"max_model_len={self.max_model_len}, {self.cpu_threads} CPU thread(s)")

    def _load_tokenizer(self, max_model_len: int | None) -> None:
        """Tokenizer, context limit and stop ids: cheap, so the HTTP layer has them before the weights."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        config = AutoConfig.from_pretrained(self.model_dir)
        limit = getattr(config, "max_position_embeddings", None) or self.tokenizer.model_max_length
        if max_model_len and max_model_len > limit:
            raise ValueError(f"NIM_MAX_MODEL_LEN={max_model_len} exceeds the model's limit of {limit}")
        self.max_model_len = max_model_len or limit
        try:
            eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
        except OSError:  # no generation_config.json
            eos = config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos_ids)
        self._token_text = lru_cache(maxsize=65536)(lambda i: self.tokenizer.decode([i]))
        self._detokenizer = detokenizer_factory(self.tokenizer)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        # Everything alive now (torch, transformers, the model's modules) lives as long as the
        # process: keep it out of the cyclic collector, whose full passes over millions of
        # start-up objects otherwise stall decode steps for tens of milliseconds.
        gc.collect()
        gc.freeze()
        self._thread = threading.Thread(target=self._worker, name="torch-engine", daemon=True)
        self._thread.start()
        self._ready = True

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
        self.model = model.to(self.device).eval()
        self.runner = LlamaRunner(self.model, self.max_num_seqs, self.max_model_len)
        log.info("KV cache: %d slots x %d tokens, %.1f MiB on %s", self.max_num_seqs, self.max_model_len,
                 self.runner.cache_bytes / 2**20, self.device)

    @property
    def ready(self) -> bool:
        return self._ready and self._dead is None and not self._stopping

    async def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            for state in [*self._waiting, *self._active]:
                state.aborted = True
            self._cond.notify_all()
        if self._thread:
            await asyncio.to_thread(self._thread.join, 30)

    # -- requests (event-loop side) --------------------------------------------------------
    def generate(self, request: GenerationRequest) -> AsyncIterator[list[ChoiceDelta]]:
        """Admit the request now (raising QueueFullError/EngineError at once), stream it later."""
        if not self.ready:
            raise EngineError(self._dead or "the engine is not ready")
        state = _RequestState(request, asyncio.Queue(), asyncio.get_running_loop())
        with self._cond:
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"{len(self._waiting)} requests are waiting already (NIM_MAX_QUEUE={self.max_queue})")
            self._waiting.append(state)
            self._cond.notify()
        return self._stream(state)

    async def _stream(self, state: _RequestState) -> AsyncIterator[list[ChoiceDelta]]:
        """Yield the request's deltas; when the consumer falls behind, several steps come as one list."""
        try:
            pending: object = _NOTHING
            while True:
                item = pending if pending is not _NOTHING else await state.queue.get()
                pending = _NOTHING
                while isinstance(item, list) and not state.queue.empty():
                    following = state.queue.get_nowait()
                    if not isinstance(following, list):
                        pending = following  # the end or an error: handled after this batch
                        break
                    item = item + following
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not state.done:
                self._abort_state(state)

    def abort(self, request_id: str) -> None:
        with self._cond:
            states = [s for s in (*self._waiting, *self._active) if s.request.request_id == request_id]
        for state in states:
            self._abort_state(state)

    def _abort_state(self, state: _RequestState) -> None:
        """Waiting requests leave at once; running ones are finished by the next step."""
        with self._cond:
            state.aborted = True
            if state in self._waiting:
                self._waiting.remove(state)
                state.done = True
            self._cond.notify()

    def stats(self) -> EngineStats:
        with self._cond:
            active, waiting = list(self._active), len(self._waiting)
        used = sum(seq.cached for state in active for seq in state.seqs)
        return EngineStats(running=len(active), waiting=waiting, max_num_seqs=self.max_num_seqs,
                           kv_cache_usage=min(1.0, used / (self.max_num_seqs * self.max_model_len)))

    # -- the worker thread -----------------------------------------------------------------
    def _worker(self) -> None:
        if self.device.type == "cpu":
            torch.set_num_threads(self.cpu_threads)  # per thread: the rest of the process keeps its own
        try:
            while True:
                with self._cond:
                    while not self._waiting and not self._active and not self._stopping:
                        self._cond.wait()
                    if self._stopping and not self._active:
                        break
                    self._admit()
                with torch.inference_mode():
                    self._step()
        except Exception as exc:  # the scheduler itself broke: nothing it holds can be trusted
            log.exception("torch engine loop died")
            self._die(f"engine loop died: {type(exc).__name__}: {exc}")
            return
        self._die("the engine has shut down")  # whatever still waits is told so

    def _admit(self) -> None:
        """Move waiting requests (in order) into the running batch while slots are free."""
        while self._waiting and len(self._free_slots) >= self._waiting[0].params.n:
            state = self._waiting.popleft()
            params, prompt = state.params, state.request.prompt_token_ids
            max_new = min(params.max_tokens, self.max_model_len - len(prompt))
            for index in range(params.n):
                output = SequenceOutput(index, self._detokenizer(prompt), params, self.eos_ids, max_new)
                generator = make_generator(params, index, self.device)
                state.seqs.append(_Sequence(state, output, generator, heapq.heappop(self._free_slots)))
            self._active.append(state)

    def _step(self) -> None:
        deltas: dict[_RequestState, list[ChoiceDelta]] = defaultdict(list)
        for state in self._active:
            if state.aborted:
                deltas[state] += [seq.output.finish("abort") for seq in state.seqs if not seq.output.finished]
        self._prefill(deltas)
        self._decode(deltas)
        ready = [(state, items) for state, items in deltas.items() if items]
        if ready:
            # One wake-up of the event loop per step, however many requests got tokens.
            ready[0][0].loop.call_soon_threadsafe(_deliver, ready)
        self._release_finished()

    def _prefill(self, deltas: dict) -> None:
        """The next prompt chunks of every request still prefilling, within one step's token budget."""
        budget, work = PREFILL_CHUNK_TOKENS, []
        for state in self._active:
            prompt = state.request.prompt_token_ids
            if budget <= 0 or state.aborted or state.prefilled == len(prompt):
                continue
            chunk = prompt[state.prefilled:state.prefilled + budget]
            work.append((state, chunk))
            budget -= len(chunk)
        if not work:
            return
        for (state, chunk), logits in self._prefill_forward(work, deltas):
            state.prefilled += len(chunk)
            if state.prefilled < len(state.request.prompt_token_ids):
                continue
            leader = state.seqs[0]
            for seq in state.seqs:
                if seq is not leader:
                    self.runner.copy_slot(leader.slot, seq.slot, state.prefilled)
                seq.cached = state.prefilled
            self._sample(state.seqs, logits.unsqueeze(0).expand(len(state.seqs), -1), deltas)

    def _prefill_forward(self, work: list, deltas: dict) -> list:
        """One forward for all chunks; if it fails, each chunk alone, so only a bad request fails."""
        def run(items):
            return self.runner.forward([(chunk, state.seqs[0].slot, state.prefilled) for state, chunk in items])

        try:
            return list(zip(work, run(work)))
        except Exception as exc:
            if len(work) == 1:
                self._fail([work[0][0]], exc, deltas)
                return []
        done = []
        for item in work:
            try:
                done.append((item, run([item])[0]))
            except Exception as exc:
                self._fail([item[0]], exc, deltas)
        return done

    def _decode(self, deltas: dict) -> None:
        batch = sorted((seq for state in self._active if not state.aborted for seq in state.seqs
                        if seq.next_token is not None and not seq.output.finished), key=lambda seq: seq.slot)
        if not batch:
            return
        try:
            logits = self.runner.forward([([s.next_token], s.slot, s.cached) for s in batch])
        except Exception as exc:
            self._fail(list({seq.state: None for seq in batch}), exc, deltas)
            return
        self._failures = 0
        for seq in batch:
            seq.cached += 1
        self._sample(batch, logits, deltas)

    def _sample(self, seqs: list[_Sequence], logits: torch.Tensor, deltas: dict) -> None:
        """Each sequence samples with its own parameters and generator; greedy rows share one argmax."""
        greedy = logits.argmax(dim=-1).tolist()
        for row, seq in enumerate(seqs):
            state, params = seq.state, seq.state.params
            try:
                if params.greedy and not (params.logit_bias or params.presence_penalty or params.frequency_penalty):
                    token = greedy[row]
                else:
                    token = sample_token(process_logits(logits[row], params, seq.output.token_ids), params, seq.generator)
                logprob = (token_logprob(logits[row], token, params.logprobs, self._token_text)
                           if params.logprobs is not None else None)
            except Exception as exc:  # e.g. a distribution with no finite value: this request only
                self._fail([state], exc, deltas)
                continue
            seq.next_token = token
            deltas[state].append(seq.output.append(token, logprob))

    def _fail(self, states: list[_RequestState], exc: Exception, deltas: dict) -> None:
        log.error("generation failed for %s: %s", [s.request.request_id for s in states], exc, exc_info=exc)
        for state in states:
            deltas[state] += [seq.output.finish("error") for seq in state.seqs if not seq.output.finished]
            state.error = EngineError(f"generation failed: {type(exc).__name__}: {exc}")
        self._failures += 1
        if self._failures >= MAX_CONSECUTIVE_FAILURES:
            self._dead = f"{self._failures} forward passes failed in a row; last: {type(exc).__name__}: {exc}"

    def _release_finished(self) -> None:
        with self._cond:
            for state in list(self._active):
                if state.aborted or all(seq.output.finished for seq in state.seqs):
                    self._active.remove(state)
                    for seq in state.seqs:
                        heapq.heappush(self._free_slots, seq.slot)
                    state.done = True
                    if state.error:
                        state.emit(state.error)
                    state.emit(None)
        if self._dead:
            self._die(self._dead)

    def _die(self, reason: str) -> None:
        """Fail everything in flight; readiness turns 503 and new requests are refused."""
        self._dead = reason
        with self._cond:
            states = [*self._waiting, *self._active]
            self._waiting.clear()
            self._active.clear()
        for state in states:
            state.done = True
            state.emit(EngineError(reason))
            state.emit(None)
