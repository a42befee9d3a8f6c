"""The in-process torch engine: transformers weights, continuous batching on a worker thread.

Scheduling is per token step, as in vLLM and TGI, and split as in vLLM V1: the policy is
`Scheduler` (pure, no model), the memory `BlockPool` (a paged KV cache with prefix caching), and
this engine only executes the scheduler's plans. Each step of the worker thread:
1. takes new requests and drops aborted ones (their KV blocks are free at once),
2. asks the scheduler for a plan: prompt chunks within a per-step token budget (so a long prompt
   delays the running sequences' next token by one chunk of compute), and one token for every
   decoding sequence, each at its own position in its own blocks,
3. runs the chunks and the decodes as two batched forward passes (`LlamaRunner`) and samples each
   sequence with its own parameters,
4. hands each request its new tokens; finished sequences free their blocks, so a short request
   never waits for a long one and a new one can join at the next step.

The worker thread owns the model, so the event loop never waits on a forward pass; results cross
back to the loop through each request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import logging
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from service.adapters import Adapter, AdapterError, ModelShape
from service.engine.base import (ChoiceDelta, Engine, EngineError, EngineStats, GenerationRequest,
                                 RequestTooLargeError, SamplingError, SamplingParams, SpecDecodeCounts, TokenLogprob,
                                 join_deltas)
from service.engine.grammar import Constraint, GrammarCompiler, compile_pool
from service.engine.kv_blocks import BlockPool
from service.engine.llama_runner import LlamaRunner
from service.engine.lora import LoraLimits, LoraPool
from service.engine.ngram import NgramConfig
from service.engine.sampling import (bias_tensors, make_generator, native_draw, process_logits, sample_token,
                                     scored_tokens, token_logprob)
from service.engine.scheduler import Chunk, Request, Scheduler, Sequence, StepPlan
from service.engine.sequence import SequenceOutput, detokenizer_factory
from service.profiles import SPARE_CORE_FROM, cpu_cores

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PREFILL_CHUNK_TOKENS = 256
BLOCK_SIZE = 16  # tokens per KV-cache block (vLLM's default)
COMPUTE_BOUND_PARAMETERS = 10_000_000  # from here on, the forward pass takes every core of a small machine
MAX_CONSECUTIVE_FAILURES = 3  # forward passes failing in a row: the engine is broken, not a request


def default_cpu_threads(parameters: int) -> int:
    """Forward-pass threads on CPU, as benchmarks/engine_vs_vllm_cpu.py measured on 2 cores.

    A small model's step is mostly per-step overhead: with every core in torch's pool, its threads
    and the HTTP side preempt each other (the 0.4M-parameter tiny model lost 13-39% of its tok/s).
    A larger model's step is its matmuls, and on few cores every core pays (the 76M model gained
    34-74%); from SPARE_CORE_FROM cores on, one more core adds little to the matmuls and the HTTP
    side keeps a core of its own.
    """
    cores = cpu_cores()
    return cores if parameters >= COMPUTE_BOUND_PARAMETERS and cores < SPARE_CORE_FROM else max(1, cores - 1)


def plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that changes the logits first: the row's argmax, shared by the step's rows."""
    return params.greedy and not params.adjusts_logits


def can_speculate(params: SamplingParams, grammar) -> bool:
    """N-gram drafts are checked against greedy choices, so only requests decoded greedily from the
    logits alone speculate: no penalties or biases (they change with every kept token), no
    logprobs, no grammar."""
    return plain_greedy(params) and params.logprobs is None and params.prompt_logprobs is None and grammar is None


@dataclass(eq=False)
class _RequestState:
    request: GenerationRequest
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    outputs: list[SequenceOutput]
    generators: list[torch.Generator]
    scheduled: Request
    slot: int = 0  # the LoRA pool's slot of the request's adapter; 0: the base model (or none yet)
    matchers: list | None = None  # per choice, the grammar's matcher of a constrained request
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, filled as its chunks run
    aborted: bool = False
    done: bool = False
    error: EngineError | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def adapter(self) -> Adapter | None:
        return self.request.adapter

    @functools.cached_property
    def prompt_tokens(self) -> torch.Tensor | None:
        """The prompt's distinct token ids where a repetition penalty needs them: made once, not at
        every step (an 8000-token prompt's took 1.2 ms a sampled token)."""
        if self.params.repetition_penalty == 1.0:
            return None
        return torch.tensor(sorted(set(self.request.prompt_token_ids)), dtype=torch.long)

    @functools.cached_property
    def bias(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The logit bias as tensors, made once (sampling.bias_tensors)."""
        return bias_tensors(self.params)

    @functools.cached_property
    def stop_ids(self) -> torch.Tensor | None:
        """The ids that would end a choice (its stop and end-of-sequence ids), made once where
        min_tokens holds them back."""
        if not self.params.min_tokens or not self.outputs[0].stop_ids:
            return None
        return torch.tensor(sorted(self.outputs[0].stop_ids), dtype=torch.long)

    @functools.cached_property
    def allowed(self) -> torch.Tensor | None:
        """The only ids a choice may take (allowed_token_ids), made once."""
        return torch.tensor(self.params.allowed_token_ids, dtype=torch.long) if self.params.allowed_token_ids else None

    def emit(self, item: list[ChoiceDelta] | BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


_NOTHING = object()  # no item held back (None is the end of a stream)


def _deliver(batch: list[tuple[_RequestState, list[ChoiceDelta]]]) -> None:
    """Runs on the event loop: hand each request its step's deltas."""
    for state, items in batch:
        state.queue.put_nowait(items)


class TorchEngine(Engine):
    def __init__(self, model_dir: Path, *, device: str = "cpu", precision: str = "fp32",
                 max_model_len: int | None = None, max_num_seqs: int = 32,
                 cpu_threads: int | None = None, kv_cache_tokens: int | None = None,
                 enable_prefix_caching: bool = True, lora: LoraLimits | None = None,
                 speculation: NgramConfig | None = None, compile_decode: bool = False) -> None:
        if precision not in DTYPES:
            raise ValueError(f"the torch engine runs {', '.join(DTYPES)}; not {precision!r}")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = DTYPES[precision]
        self.max_num_seqs = max_num_seqs
        self.cpu_threads = cpu_threads  # None: chosen from the model once it is loaded
        self._load_tokenizer(max_model_len)
        # The pool's default holds every sequence at full length, as per-slot reservation did; it
        # costs only what is touched (see LlamaRunner), and NIM_KV_CACHE_TOKENS caps it.
        tokens = kv_cache_tokens or max_num_seqs * self.max_model_len
        if tokens < self.max_model_len:
            raise ValueError(f"NIM_KV_CACHE_TOKENS={tokens} cannot hold one sequence of max_model_len="
                             f"{self.max_model_len} tokens")
        self.pool = BlockPool(-(-tokens // BLOCK_SIZE), BLOCK_SIZE, enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, max_num_seqs, PREFILL_CHUNK_TOKENS, speculation)
        self.speculation = speculation
        self.compile_decode = compile_decode
        self.spec_counts = SpecDecodeCounts() if speculation else None
        self.lora_limits = lora
        self.lora: LoraPool | None = None  # made at load, when adapters are served
        self._incoming: deque[_RequestState] = deque()
        self._parked: deque[_RequestState] = deque()  # in _states, waiting for a LoRA slot
        self._states: list[_RequestState] = []  # admitted to the scheduler, not yet done
        self._cond = threading.Condition()
        self._stopping = False
        self._ready = False
        self._dead: str | None = None
        self._failures = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop `on_death` is called on

    def describe(self) -> str:
        return (f"torch (in-process) on {self.device.type}, {self.dtype}, max_num_seqs={self.max_num_seqs}, "
                f"max_model_len={self.max_model_len}, KV cache {self.pool.num_blocks} x {BLOCK_SIZE} tokens, "
                f"prefix caching {'on' if self.pool.enable_caching else 'off'}, "
                f"{self.cpu_threads or 'auto'} CPU thread(s), speculation {self.speculation.model_dump_json() if self.speculation else 'off'}, "
                f"compiled decode {'on' if self.compile_decode else 'off'}")

    def _load_tokenizer(self, max_model_len: int | None) -> None:
        """Tokenizer, context limit and stop ids: cheap, so the HTTP layer has them before the weights."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        config = AutoConfig.from_pretrained(self.model_dir)
        limit = getattr(config, "max_position_embeddings", None) or self.tokenizer.model_max_length
        if max_model_len and max_model_len > limit:
            raise ValueError(f"NIM_MAX_MODEL_LEN={max_model_len} exceeds the model's limit of {limit}")
        self.max_model_len = max_model_len or limit
        self.vocab_size = config.vocab_size  # the logits' width, which may exceed the tokenizer's
        try:
            eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
        except OSError:  # no generation_config.json
            eos = config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos_ids)
        known = len(self.tokenizer)  # ids past it are padded rows of the logits: no text (vLLM's detokenizer too)
        self._token_text = lru_cache(maxsize=65536)(lambda i: self.tokenizer.decode([i]) if i < known else "")
        self._detokenizer = detokenizer_factory(self.tokenizer)
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._grammar_pool = compile_pool(cpu_cores())

    async def compile_grammar(self, constraint: Constraint):
        return await asyncio.get_running_loop().run_in_executor(self._grammar_pool, self._compile_grammar, constraint)

    def _compile_grammar(self, constraint: Constraint):
        with self._grammars_lock:  # made on first use: requests without constraints never import xgrammar
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, list(self.eos_ids))
        return self._grammars.compile(constraint)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the weights on the engine's own thread, which then runs the steps.

        One thread runs every parallel torch op of the process, so OpenMP keeps one team of
        threads, as many as the cores: with a second team (the model loaded on another thread),
        libgomp counts more threads than cores and stops spinning between parallel regions, and a
        decode step of the 76M model took 22.8 ms instead of 17.3 ms on 2 cores."""
        self._loop = asyncio.get_running_loop()
        loaded: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._worker, args=(loaded,), name="torch-engine", daemon=True)
        self._thread.start()
        await asyncio.wrap_future(loaded)
        # Everything alive now (torch, transformers, the model's modules) lives as long as the
        # process: keep it out of the cyclic collector, whose full passes over millions of
        # start-up objects otherwise stall decode steps for tens of milliseconds.
        gc.collect()
        gc.freeze()
        self._ready = True

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
        self.model = model.to(self.device).eval()
        parameters = sum(p.numel() for p in self.model.parameters())  # before packing releases the originals
        self.cpu_threads = self.cpu_threads or default_cpu_threads(parameters)
        if self.lora_limits:
            self.lora = LoraPool(ModelShape.from_config(self.model.config.to_dict()), self.lora_limits, self.dtype,
                                 self.device)
            log.info("LoRA pool: %d slots of rank %d, %.1f MiB each", self.lora_limits.max_loras,
                     self.lora_limits.max_rank, self.lora.bytes_per_slot / 2**20)
        self.runner = LlamaRunner(self.model, self.pool.num_blocks, BLOCK_SIZE, self.max_model_len, pack_weights=True,
                                  lora=self.lora, compile_decode=self.compile_decode)
        log.info("matmuls: %s", self.runner.matmul_kernels())
        log.info("sampled tokens: %s", "one call each (cpu_sampling.cpp) for temperature alone"
                 if native_draw(self.device) else "aten ops")  # decided here, not at the first sampled token
        log.info("KV cache: %d blocks x %d tokens (%.1f MiB at most, touched as used) on %s",
                 self.pool.num_blocks, BLOCK_SIZE, self.pool.num_blocks * self.runner.bytes_per_block / 2**20,
                 self.device)

    def _compile(self) -> None:
        """The compiled decode step, compiled before the first request (see compiled_decode)."""
        if self.runner.compiled is None:
            return
        began = time.monotonic()
        self.runner.compiled.warm_up()
        log.info("compiled decode step ready in %.1f s (inductor cache: %s)", time.monotonic() - began,
                 os.environ.get("TORCHINDUCTOR_CACHE_DIR", "inductor's default"))

    @property
    def ready(self) -> bool:
        return self._ready and self._dead is None and not self._stopping

    async def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            for state in [*self._incoming, *self._states]:
                state.aborted = True
            self._cond.notify_all()
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        if self._thread:
            await asyncio.to_thread(self._thread.join, 30)

    # -- requests (event-loop side) --------------------------------------------------------
    def generate(self, request: GenerationRequest) -> AsyncIterator[list[ChoiceDelta]]:
        """Take the request now (raising EngineError or RequestTooLargeError at once), stream it later.
        How many requests may wait is the runtime's `Admission`, before a request gets here."""
        if not self.ready:
            raise EngineError(self._dead or "the engine is not ready")
        if request.adapter and not self.lora:
            raise EngineError("this engine serves no LoRA adapters (NIM_PEFT_SOURCE)")
        params, prompt = request.params, request.prompt_token_ids
        if not prompt:  # nothing to compute a first token from: the scheduler would never run it
            raise RequestTooLargeError("the prompt has no tokens; a model generates from at least one", "prompt")
        if max(prompt) >= self.vocab_size:  # a tokenizer may know more ids than the model has rows
            raise RequestTooLargeError(f"prompt token id {max(prompt)} is past this model's vocabulary of "
                                       f"{self.vocab_size} embedding rows")
        max_new = min(params.max_tokens, self.max_model_len - len(prompt))
        # KV computed with one adapter is never another's: each adapter's prefix cache is its own, and
        # each cache salt's (vLLM's cache_salt: one tenant's cached prompts cannot be timed by another)
        adapter = (request.adapter.name, request.adapter.version) if request.adapter else None
        root = hash((adapter, request.cache_salt)) if adapter or request.cache_salt is not None else 0
        scheduled = Request(request.request_id, prompt, params.n, len(prompt) + max_new, cache_root=root,
                            reuse_cache=params.prompt_logprobs is None,
                            speculate=self.speculation is not None and can_speculate(params, request.grammar))
        self.scheduler.check_fits(scheduled)  # RequestTooLargeError: a 400 before anything is queued
        outputs = [SequenceOutput(i, self._detokenizer(prompt, params.skip_special_tokens), params, self.eos_ids,
                                  max_new) for i in range(params.n)]
        state = _RequestState(request, asyncio.Queue(), asyncio.get_running_loop(), outputs,
                              [make_generator(params, i, self.device) for i in range(params.n)], scheduled)
        if request.grammar is not None:
            state.matchers = [self._grammars.matcher(request.grammar) for _ in range(params.n)]
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt)
        scheduled.owner = state
        with self._cond:
            self._incoming.append(state)
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
            states = [s for s in (*self._incoming, *self._states) if s.request.request_id == request_id]
        for state in states:
            self._abort_state(state)

    def _abort_state(self, state: _RequestState) -> None:
        """Requests not yet taken leave at once; the others are dropped at the start of the next step."""
        with self._cond:
            state.aborted = True
            if state in self._incoming:
                self._incoming.remove(state)
                state.done = True
            self._cond.notify()

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(running=len(scheduler.running), waiting=len(self._incoming) + len(scheduler.waiting),
                           max_num_seqs=self.max_num_seqs, kv_cache_usage=self.pool.num_used / self.pool.num_blocks,
                           prefix_cache_queries=scheduler.prefix_queries, prefix_cache_hits=scheduler.prefix_hits,
                           spec_decode=self.spec_counts)

    # -- the worker thread -----------------------------------------------------------------
    def _worker(self, loaded: concurrent.futures.Future) -> None:
        try:
            self._load()
            if self.device.type == "cpu":
                torch.set_num_threads(self.cpu_threads)  # per thread: the rest of the process keeps its own
            self._compile()
        except BaseException as exc:
            loaded.set_exception(exc)
            return
        loaded.set_result(None)
        try:
            while True:
                with self._cond:
                    while not self._incoming and not self._states and not self._stopping:
                        self._cond.wait()
                    if self._stopping and not self._states:
                        break
                    incoming = list(self._incoming)
                    self._incoming.clear()
                    self._states += incoming
                self._schedule_new(incoming)
                with torch.inference_mode():
                    self._step()
        except Exception as exc:  # the scheduler itself broke: nothing it holds can be trusted
            log.exception("torch engine loop died")
            self._die(f"engine loop died: {type(exc).__name__}: {exc}")
            return
        self._die("the engine has shut down")  # whatever still waits is told so (only `_stopping` ends the loop)

    def _schedule_new(self, incoming: list[_RequestState]) -> None:
        """Hand new requests to the scheduler; one whose adapter finds no free LoRA slot waits
        (parked) until a request ends and frees one."""
        parked, self._parked = [*self._parked, *(s for s in incoming if s.adapter)], deque()
        for state in incoming:
            if not state.adapter:
                self.scheduler.add(state.scheduled)
        for state in parked:
            if state.aborted:
                continue
            try:
                slot = self.lora.acquire(state.adapter)
            except (AdapterError, OSError, ValueError, RuntimeError) as exc:  # its files went bad since the scan
                log.error("LoRA adapter %s could not be loaded: %s", state.adapter.name, exc)
                state.error = EngineError(f"the LoRA adapter {state.adapter.name!r} could not be loaded")
                state.aborted = True
                continue
            if slot is None:
                self._parked.append(state)
            else:
                state.slot = slot
                self.scheduler.add(state.scheduled)

    def _step(self) -> None:
        deltas: dict[_RequestState, list[ChoiceDelta]] = defaultdict(list)
        for state in self._states:
            if state.aborted:
                deltas[state] += [out.finish("abort") for out in state.outputs if not out.finished]
        self._release_finished(deltas)
        plan = self.scheduler.schedule()
        if plan.chunks:
            sampled = self._execute(plan, deltas)
            self.scheduler.update(plan, sampled)
        ready = [(state, items) for state, items in deltas.items() if items]
        if ready:
            # One wake-up of the event loop per step, however many requests got tokens.
            ready[0][0].loop.call_soon_threadsafe(_deliver, ready)
        self._release_finished({})

    def _execute(self, plan: StepPlan, deltas: dict) -> dict[Sequence, list[int]]:
        """Every chunk of the plan in one forward pass, prompt chunks and decodes together: the
        weights are read once a step. A chunk whose prompt logprobs are asked for, and a decode
        with an n-gram draft, get the logits after each of their tokens, the others after their
        last. A chunk whose forward failed leaves the plan."""
        scored = [c for c in plan.chunks if not c.decode and c.seq.request.owner.prompt_logprobs is not None
                  and c.start + 1 < len(c.seq.request.prompt)]  # it holds prompt tokens to score
        done = self._forward(plan.chunks, deltas, [c in scored or bool(c.draft) for c in plan.chunks])
        plan.chunks = [chunk for chunk, _ in done]
        self.runner.copy_blocks([pair for chunk in plan.chunks for pair in chunk.copies])
        sampled: dict[Sequence, list[int]] = {}
        rows, seqs = [], []
        for chunk, logits in done:
            if chunk in scored:
                self._score_prompt(chunk, logits)
            if chunk.draft:
                self._verify(chunk, logits, deltas, sampled)
            elif chunk.samples:
                rows.append(logits[-1:].expand(len(chunk.samples), -1))
                seqs += chunk.samples
        if seqs:  # every sampling row of the step at once: one argmax, one read of the tokens (a GPU sync)
            self._sample(seqs, torch.cat(rows), deltas, sampled)
        return sampled

    def _verify(self, chunk: Chunk, logits: torch.Tensor, deltas: dict, sampled: dict) -> None:
        """Keep the draft's tokens up to the first that greedy decoding would not have chosen, then
        the model's own token there: what decoding one token a step would have produced. The
        choice's tokens of the step come to the client as one delta, as vLLM streams them."""
        seq, draft = chunk.seq, chunk.draft
        state, output = seq.request.owner, seq.request.owner.outputs[seq.index]
        if state.error or output.finished:
            return
        chosen = logits.argmax(dim=-1).tolist()
        kept = next((i for i, token in enumerate(draft) if chosen[i] != token), len(draft))
        self.spec_counts.add(len(draft), kept)
        steps = [output.append(token, None) for token in chosen[:kept + 1] if not output.finished]
        sampled[seq] = [token for delta in steps for token in delta.token_ids]
        deltas[state].append(join_deltas(steps))

    def _score_prompt(self, chunk: Chunk, logits: torch.Tensor) -> None:
        """Row i of a chunk's logits predicts the token after its i-th: record each prompt token's logprob."""
        state = chunk.seq.request.owner
        prompt = state.request.prompt_token_ids
        rows = min(len(chunk.tokens), len(prompt) - 1 - chunk.start)
        if rows > 0:
            scored = scored_tokens(logits[:rows], prompt[chunk.start + 1:chunk.start + 1 + rows],
                                   state.params.prompt_logprobs, self._token_text, ranked=True)
            state.prompt_logprobs[chunk.start + 1:chunk.start + 1 + rows] = scored

    def _forward(self, group: list[Chunk], deltas: dict, every_position: list[bool]) -> list[tuple[Chunk, torch.Tensor]]:
        """One forward for the group; if it fails, each chunk alone. A chunk that fails while others
        pass failed for its own input and ends its request only; a group in which none passes, or
        whose decodes all fail, is the engine's failure, until a decode step works again (a prefill
        that works does not prove the device well: a faulted GPU may fail only decodes)."""
        def run(chunks: list[Chunk], flags: list[bool]) -> list[torch.Tensor]:
            """Each chunk's logits: [1, vocab] after its last token, or where flagged a row per token."""
            slots = [c.seq.request.owner.slot for c in chunks] if self.lora else None
            logits = self.runner.forward([(c.tokens, c.seq.block_table(), c.start) for c in chunks], slots, flags)
            return list(logits.split([len(c.tokens) if every else 1 for c, every in zip(chunks, flags)]))

        try:
            done, failed = list(zip(group, run(group, every_position))), []
        except Exception as exc:
            done, failed = [], []
            if len(group) == 1:
                failed.append((group[0], exc))
            else:  # which of them fails alone?
                for chunk, every in zip(group, every_position):
                    try:
                        done.append((chunk, run([chunk], [every])[0]))
                    except Exception as alone:
                        failed.append((chunk, alone))
        for chunk, exc in failed:
            self._fail(chunk.seq.request.owner, exc, deltas)
        failed_decodes = [exc for chunk, exc in failed if chunk.decode]
        if (failed and not done) or (failed_decodes and not any(chunk.decode for chunk, _ in done)):
            self._engine_failed((failed_decodes or [exc for _, exc in failed])[-1])
        elif not failed_decodes and any(chunk.decode for chunk in group):  # a decode that works: a working engine
            self._failures = 0
        return done

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, deltas: dict, sampled: dict) -> None:
        """Each sequence samples with its own parameters and generator; greedy rows share one argmax.
        Rows under a grammar first lose the tokens it forbids (on a copy: the logits stay as computed)."""
        constrained = [(row, seq.request.owner.matchers[seq.index]) for row, seq in enumerate(seqs)
                       if seq.request.owner.matchers and not seq.request.owner.outputs[seq.index].finished]
        stuck: set[int] = set()
        if constrained:
            logits = logits.clone()
            stuck = self._grammars.mask(logits, constrained)
        argmax = [plain_greedy(seq.request.owner.params) for seq in seqs]
        greedy = logits.argmax(dim=-1).tolist() if any(argmax) else []
        for row, seq in enumerate(seqs):
            state = seq.request.owner
            params, output = state.params, state.outputs[seq.index]
            if state.error or output.finished:
                continue
            try:
                if row in stuck:
                    raise SamplingError("the request's constraint admits no further token")
                if argmax[row]:
                    token = greedy[row]
                else:
                    adjusted = process_logits(logits[row], params, output.token_ids, state.prompt_tokens, state.bias,
                                              state.stop_ids, state.allowed)
                    token = sample_token(adjusted, params, state.generators[seq.index])
                logprob = (token_logprob(logits[row], token, params.logprobs, self._token_text)
                           if params.logprobs is not None else None)
            except SamplingError as exc:  # the request's parameters: a 400 for it, no fault of the engine
                self._fail(state, exc, deltas)
                continue
            sampled[seq] = [token]
            first = not output.token_ids
            delta = output.append(token, logprob)
            if first and state.prompt_logprobs is not None:
                delta.prompt_logprobs = state.prompt_logprobs
            deltas[state].append(delta)
        if constrained:
            self._follow_grammars([seq for seq in seqs if seq in sampled and seq.request.owner.matchers], sampled, deltas)

    def _follow_grammars(self, seqs: list[Sequence], sampled: dict, deltas: dict) -> None:
        """Advance each constrained choice's matcher by its token. A grammar ends only on a stop token,
        which ends the choice unless ignore_eos passes it: then the grammar's end does."""
        matchers = [seq.request.owner.matchers[seq.index] for seq in seqs]
        tokens = [sampled[seq][-1] for seq in seqs]  # constrained choices never speculate: one token each
        for seq, matcher, token, accepted in zip(seqs, matchers, tokens, self._grammars.accept(matchers, tokens)):
            state, output = seq.request.owner, seq.request.owner.outputs[seq.index]
            if not accepted:
                self._fail(state, EngineError(f"token {token} broke the request's grammar"), deltas)
            elif not output.finished and token in self.eos_ids and matcher.is_terminated():
                deltas[state].append(output.finish("stop"))

    def _fail(self, state: _RequestState, exc: Exception, deltas: dict) -> None:
        """End one request with an error; the client learns what it can act on, the log the rest (a
        request's own parameters, a SamplingError, are its 400: no traceback)."""
        if isinstance(exc, SamplingError):
            log.info("request %s refused while sampling: %s", state.request.request_id, exc)
        else:
            log.error("generation failed for %s: %s", state.request.request_id, exc, exc_info=exc)
        deltas[state] += [out.finish("error") for out in state.outputs if not out.finished]
        state.error = exc if isinstance(exc, SamplingError) else EngineError("the engine failed to generate this request")

    def _engine_failed(self, exc: Exception) -> None:
        self._failures += 1
        if self._failures >= MAX_CONSECUTIVE_FAILURES:
            self._dead = f"{self._failures} forward passes failed in a row; last: {type(exc).__name__}: {exc}"

    def _release_finished(self, deltas: dict) -> None:
        """Between steps: free the blocks of ended choices and requests, and end their streams."""
        finished = []
        for state in self._states:
            if state.aborted or all(out.finished for out in state.outputs):
                self.scheduler.finish(state.scheduled)
                finished.append(state)
            else:
                for seq, out in zip(state.scheduled.seqs, state.outputs):
                    if out.finished and not seq.finished:
                        self.scheduler.finish_seq(seq)
        with self._cond:
            for state in finished:
                self._states.remove(state)
                state.done = True
        for state in finished:
            if state.slot:
                self.lora.release(state.adapter)
                state.slot = 0
        for state in finished:
            if deltas.get(state):
                state.emit(deltas.pop(state))
            if state.error:
                state.emit(state.error)
            state.emit(None)
        if self._dead:
            self._die(self._dead)

    def _die(self, reason: str) -> None:
        """Fail everything in flight; readiness turns 503, new requests are refused, and unless
        this is a shutdown the runtime hears of it (`on_death`) and exits so that the pod restarts."""
        self._dead = reason
        with self._cond:
            stopping = self._stopping
            states = [*self._incoming, *self._states]
            self._incoming.clear()
            self._states.clear()
        error = EngineError("the engine has shut down" if stopping else "the engine failed; the server restarts")
        for state in states:
            state.done = True
            state.emit(error)
            state.emit(None)
        if not stopping and self.on_death and self._loop:
            self._loop.call_soon_threadsafe(self.on_death, reason)
