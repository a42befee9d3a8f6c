"""The in-process torch engine: transformers weights, generation on a worker thread.

Requests run one at a time in arrival order; the `n` choices of a request decode together as one
batch sharing the prompt. The worker thread owns the model, so the event loop never waits on a
forward pass; results cross back to the loop through each request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from service.engine.base import (ChoiceDelta, Engine, EngineError, EngineStats, GenerationRequest,
                                 QueueFullError)
from service.engine.sampling import make_generator, process_logits, sample_token, token_logprob
from service.engine.sequence import SequenceOutput

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SUPPORTED_PRECISIONS = frozenset(DTYPES)


@dataclass
class _RequestState:
    request: GenerationRequest
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    aborted: bool = False
    done: bool = False
    seqs: list[SequenceOutput] = field(default_factory=list)

    def emit(self, item: list[ChoiceDelta] | BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class TorchEngine(Engine):
    def __init__(self, model_dir: Path, *, device: str = "cpu", precision: str = "fp32",
                 max_model_len: int | None = None, max_num_seqs: int = 32, max_queue: int = 256) -> None:
        if precision not in DTYPES:
            raise ValueError(f"the torch engine runs {', '.join(DTYPES)}; not {precision!r}")
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = DTYPES[precision]
        self.max_num_seqs = max_num_seqs
        self.max_queue = max_queue
        self._load_tokenizer(max_model_len)
        self._waiting: deque[_RequestState] = deque()
        self._running: _RequestState | None = None
        self._cond = threading.Condition()
        self._stopping = False
        self._ready = False
        self._dead: str | None = None
        self._kv_tokens = 0
        self._thread: threading.Thread | None = None

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

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self._worker, name="torch-engine", daemon=True)
        self._thread.start()
        self._ready = True

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
        self.model = model.to(self.device).eval()

    @property
    def ready(self) -> bool:
        return self._ready and self._dead is None and not self._stopping

    async def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            for state in self._waiting:
                state.aborted = True
            self._cond.notify_all()
        if self._thread:
            await asyncio.to_thread(self._thread.join, 30)

    # -- requests --------------------------------------------------------------------------
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
        try:
            while (item := await state.queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not state.done:
                self._abort_state(state)

    def abort(self, request_id: str) -> None:
        with self._cond:
            states = list(self._waiting) + ([self._running] if self._running else [])
        for state in states:
            if state.request.request_id == request_id:
                self._abort_state(state)

    def _abort_state(self, state: _RequestState) -> None:
        with self._cond:
            state.aborted = True
            if state in self._waiting:
                self._waiting.remove(state)
                state.done = True

    def stats(self) -> EngineStats:
        capacity = self.max_num_seqs * self.max_model_len
        return EngineStats(running=1 if self._running else 0, waiting=len(self._waiting),
                           max_num_seqs=self.max_num_seqs, kv_cache_usage=min(1.0, self._kv_tokens / capacity))

    # -- the worker thread -----------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if not self._waiting:
                    return
                state = self._running = self._waiting.popleft()
            try:
                with torch.inference_mode():
                    self._run(state)
            except Exception as exc:  # a failed forward fails this request only
                log.exception("generation failed for request %s", state.request.request_id)
                if unfinished := [seq.finish("error") for seq in state.seqs if not seq.finished]:
                    state.emit(unfinished)
                state.emit(EngineError(f"generation failed: {type(exc).__name__}: {exc}"))
            finally:
                state.done = True
                state.emit(None)
                with self._cond:
                    self._running = None
                self._kv_tokens = 0

    def _run(self, state: _RequestState) -> None:
        request, params = state.request, state.request.params
        prompt = request.prompt_token_ids
        max_new = min(params.max_tokens, self.max_model_len - len(prompt))
        state.seqs = [SequenceOutput(i, self.tokenizer, prompt, params, self.eos_ids, max_new) for i in range(params.n)]
        generators = [make_generator(params, i, self.device) for i in range(params.n)]
        input_ids = torch.tensor([prompt], device=self.device).expand(params.n, -1)
        out = self.model(input_ids=input_ids, use_cache=True)
        cache = out.past_key_values
        while True:
            self._kv_tokens = params.n * (len(prompt) + len(state.seqs[0].token_ids))
            if state.aborted:
                state.emit([seq.finish("abort") for seq in state.seqs if not seq.finished])
                return
            logits = out.logits[:, -1, :].float()
            deltas, next_ids = [], []
            for seq, generator, row in zip(state.seqs, generators, logits):
                if seq.finished:
                    next_ids.append(seq.token_ids[-1])
                    continue
                token = sample_token(process_logits(row, params, seq.token_ids), params, generator)
                logprob = (token_logprob(row, token, params.logprobs, self._token_text)
                           if params.logprobs is not None else None)
                deltas.append(seq.append(token, logprob))
                next_ids.append(token)
            state.emit(deltas)
            if all(seq.finished for seq in state.seqs):
                return
            step = torch.tensor(next_ids, device=self.device).unsqueeze(1)
            out = self.model(input_ids=step, past_key_values=cache, use_cache=True)
