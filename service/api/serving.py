"""OpenAI chat and completions logic: validation, prompts, generation, responses. No FastAPI here.

A handler returns a response model, or an async generator of SSE strings for `stream: true`.
Expected failures raise `ServingError` before any byte is sent; once a stream has started, a failure
becomes an error frame followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from jinja2 import TemplateError

from service.adapters import Adapter, AdapterRegistry
from service.admission import Admission
from service.api.encoding import prompt_encoder
from service.api.errors import ServingError, bad_request, from_exception, sse_error
from service.api.protocol import (ChatChoice, ChatChoiceLogprobs, ChatChunkChoice, ChatCompletionChunk,
                                  ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatLogprob,
                                  ChatLogprobTop, ChatResponseMessage, CompletionChoice, CompletionLogprobs,
                                  CompletionRequest, CompletionResponse, SamplingFields, Usage)
from service.engine.base import ChoiceDelta, Engine, GenerationRequest, SamplingParams, TokenLogprob
from service.metrics import ServiceMetrics

DONE = "data: [DONE]\n\n"


@dataclass
class ChoiceState:
    """Everything one choice accumulated, for the final response and for usage."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.stop_reason is not None else self.stop_reason


@dataclass
class Job:
    """One HTTP request's generation: its prompts, parameters and what came back so far."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    model: str  # the id the request named: the base model's or a LoRA adapter's
    adapter: Adapter | None = None
    choices: dict[int, ChoiceState] = field(default_factory=dict)

    @property
    def usage(self) -> Usage:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


@dataclass
class SSEStream:
    """A streaming answer: the SSE chunks, and the job whose usage they report."""

    job: Job
    chunks: AsyncIterator[str]

    def __aiter__(self) -> AsyncIterator[str]:
        return self.chunks

    async def aclose(self) -> None:
        await self.chunks.aclose()

    @property
    def usage(self) -> Usage:
        return self.job.usage


class OpenAIServing:
    def __init__(self, engine: Engine, tokenizer, model_name: str, metrics: ServiceMetrics, admission: Admission,
                 adapters: AdapterRegistry | None = None) -> None:
        self.engine, self.tokenizer, self.model_name, self.metrics = engine, tokenizer, model_name, metrics
        self.admission, self.adapters = admission, adapters
        self._encode = prompt_encoder(tokenizer)

    # -- chat ------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, request_id: str):
        adapter = self._resolve_model(req.model)
        self._check_chat_support(req)
        self.admission.check_size(1, req.n)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False))
        except TemplateError as exc:  # the template's own refusal (a role order it does not take)
            raise bad_request(f"messages cannot be rendered by the model's chat template: {exc}", "messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = self._sampling(req, [prompt], max_tokens, "max_completion_tokens" if req.max_completion_tokens else "max_tokens",
                                logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        job = Job(f"chatcmpl-{request_id}", [prompt], params, req.model, adapter)
        events = self._run(job)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEStream(job, self._chat_stream(job, events, include_usage))
        await self._drain(events)
        choices = [ChatChoice(index=i, message=ChatResponseMessage(content=c.text),
                              logprobs=self._chat_logprobs(c.logprobs) if req.logprobs else None,
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for i, c in sorted(job.choices.items())]
        return ChatCompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=job.usage)

    def _check_chat_support(self, req: ChatCompletionRequest) -> None:
        if req.tools:
            raise bad_request("tools are not supported by this model", "tools")
        if req.tool_choice not in (None, "none"):
            raise bad_request("tool_choice is not supported by this model", "tool_choice")
        if req.response_format and req.response_format.type != "text":
            raise bad_request(f"response_format {req.response_format.type!r} is not supported", "response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")

    async def _chat_stream(self, job: Job, events, include_usage: bool) -> AsyncIterator[str]:
        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            body = ChatCompletionChunk(id=job.request_id, model=job.model, choices=choices, usage=usage)
            return f"data: {body.model_dump_json(exclude_none=False)}\n\n"

        try:
            for index in range(job.params.n):
                yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
            async for index, delta in events:
                if delta.text or delta.finish_reason or delta.logprobs and job.params.logprobs is not None:
                    logprobs = self._chat_logprobs(delta.logprobs) if job.params.logprobs is not None else None
                    yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=delta.text), logprobs=logprobs,
                                                 finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)])
            if include_usage:
                yield chunk([], job.usage)
        except Exception as exc:  # a started stream reports failure in-band
            yield sse_error(from_exception(exc))
        yield DONE

    def _chat_logprobs(self, logprobs: list[TokenLogprob]) -> ChatChoiceLogprobs:
        def entry(token: str, logprob: float) -> dict:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return ChatChoiceLogprobs(content=[
            ChatLogprob(**entry(lp.token, lp.logprob), top_logprobs=[ChatLogprobTop(**entry(t.token, t.logprob)) for t in lp.top])
            for lp in logprobs])

    # -- completions -----------------------------------------------------------------------
    async def completion(self, req: CompletionRequest, request_id: str):
        adapter = self._resolve_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported", "echo")
        prompts = self._completion_prompts(req.prompt, req.n)
        params = self._sampling(req, prompts, req.max_tokens, "max_tokens", logprobs=req.logprobs)
        job = Job(f"cmpl-{request_id}", prompts, params, req.model, adapter)
        echoes = [self.tokenizer.decode(p, skip_special_tokens=True) if req.echo else "" for p in prompts]
        events = self._run(job)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEStream(job, self._completion_stream(job, events, include_usage, echoes))
        await self._drain(events)
        choices = [CompletionChoice(index=i, text=echoes[i // params.n] + c.text,
                                    logprobs=self._completion_logprobs(c.logprobs, 0) if req.logprobs is not None else None,
                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                   for i, c in sorted(job.choices.items())]
        return CompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=job.usage)

    def _completion_prompts(self, prompt, n: int) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [prompt]
        elif not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        elif isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = prompt
        self.admission.check_size(len(prompts), n)  # before any prompt is encoded
        vocab = len(self.tokenizer)
        token_lists = []
        for item in prompts:
            if isinstance(item, str):
                token_lists.append(self._encode(item))
                continue
            if not item or any(not 0 <= t < vocab for t in item):
                raise bad_request(f"token prompts must be non-empty with ids in [0, {vocab})", "prompt")
            token_lists.append(list(item))
        return token_lists

    async def _completion_stream(self, job: Job, events, include_usage: bool, echoes: list[str]) -> AsyncIterator[str]:
        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            body = CompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=usage)
            return f"data: {body.model_dump_json()}\n\n"

        offsets: dict[int, int] = {}
        try:
            for index in range(len(job.prompts) * job.params.n):
                if echoes[index // job.params.n]:
                    yield chunk([CompletionChoice(index=index, text=echoes[index // job.params.n])])
            async for index, delta in events:
                if delta.text or delta.finish_reason or delta.logprobs and job.params.logprobs is not None:
                    logprobs = None
                    if job.params.logprobs is not None:
                        logprobs = self._completion_logprobs(delta.logprobs, offsets.get(index, 0))
                        offsets[index] = offsets.get(index, 0) + sum(len(lp.token) for lp in delta.logprobs)
                    yield chunk([CompletionChoice(index=index, text=delta.text, logprobs=logprobs,
                                                  finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)])
            if include_usage:
                yield chunk([], job.usage)
        except Exception as exc:
            yield sse_error(from_exception(exc))
        yield DONE

    @staticmethod
    def _completion_logprobs(logprobs: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for lp in logprobs:
            result.text_offset.append(offset)
            offset += len(lp.token)
            result.tokens.append(lp.token)
            result.token_logprobs.append(lp.logprob)
            result.top_logprobs.append({t.token: t.logprob for t in lp.top})
        return result

    # -- shared ----------------------------------------------------------------------------
    def _resolve_model(self, model: str) -> Adapter | None:
        """The LoRA adapter `model` names, None for the base model; 404 model_not_found for any other."""
        if model == self.model_name:
            return None
        adapter = self.adapters.get(model) if self.adapters else None
        if adapter is None:
            also = f" and {len(self.adapters.adapters)} LoRA adapter(s), listed at /v1/models" if self.adapters else ""
            raise ServingError(404, f"the model `{model}` does not exist; this server serves `{self.model_name}`{also}",
                               "model", code="model_not_found")
        return adapter

    def _sampling(self, req: SamplingFields, prompts: list[list[int]], max_tokens: int | None, max_param: str,
                  logprobs: int | None) -> SamplingParams:
        limit = self.engine.max_model_len
        longest = max(len(p) for p in prompts)
        prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        if longest >= limit:
            raise bad_request(f"this model's maximum context length is {limit} tokens; the prompt has {longest} tokens",
                              prompt_param)
        if max_tokens is not None and longest + max_tokens > limit:
            raise bad_request(f"this model's maximum context length is {limit} tokens; {longest} prompt tokens plus "
                              f"{max_param}={max_tokens} exceed it", max_param)
        vocab = len(self.tokenizer)
        if any(t >= vocab for t in req.stop_token_ids or ()):
            raise bad_request(f"stop_token_ids must be token ids of this model, in [0, {vocab})", "stop_token_ids")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise bad_request("stop strings must not be empty", "stop")
        return SamplingParams(
            n=req.n, max_tokens=max_tokens if max_tokens is not None else limit - longest,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=max(req.top_k or 0, 0), seed=req.seed,
            stop=tuple(stop), stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            logprobs=logprobs, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            logit_bias=self._logit_bias(req.logit_bias))

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        result = []
        for key, value in (bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < len(self.tokenizer):
                raise bad_request(f"logit_bias key {key!r} is not a token id of this model", "logit_bias")
            if not -100 <= value <= 100:
                raise bad_request("logit_bias values must be within [-100, 100]", "logit_bias")
            result.append((int(key), float(value)))
        return tuple(result)

    def _run(self, job: Job) -> AsyncIterator[tuple[int, ChoiceDelta]]:
        """Admit every prompt now (so a full queue is a 503 before any byte is sent), stream later."""
        streams, admitted = [], []
        try:
            for i, prompt in enumerate(job.prompts):
                request = GenerationRequest(f"{job.request_id}-{i}", prompt, job.params, job.adapter)
                streams.append(self._observed(self.engine.generate(request), len(prompt), job.params.n, job.model))
                admitted.append(request.request_id)
        except Exception:
            for request_id in admitted:
                self.engine.abort(request_id)
            raise
        return self._merge(job, streams)

    async def _merge(self, job: Job, streams: list[AsyncIterator[list[ChoiceDelta]]]) -> AsyncIterator[tuple[int, ChoiceDelta]]:
        queue: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(position: int, stream) -> None:
            try:
                async for deltas in stream:
                    await queue.put((position, deltas))
            except BaseException as exc:
                await queue.put(exc)
                raise
            finally:
                await queue.put(end)

        def record(position: int, deltas: list[ChoiceDelta]):
            for delta in deltas:
                index = position * job.params.n + delta.index
                job.choices.setdefault(index, ChoiceState()).add(delta)
                yield index, delta

        if len(streams) == 1:  # the usual single prompt: no task and no extra queue hop per token
            async for deltas in streams[0]:
                for item in record(0, deltas):
                    yield item
            return
        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        open_streams = len(streams)
        try:
            while open_streams:
                item = await queue.get()
                if item is end:
                    open_streams -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                for merged in record(*item):
                    yield merged
        finally:
            for task in tasks:
                task.cancel()

    async def _observed(self, stream: AsyncIterator[list[ChoiceDelta]], prompt_len: int, n: int, model_name: str):
        """Pass a stream through, recording its metrics when it ends, however it ends."""
        start = last = time.perf_counter()
        ttft, gaps, tokens = None, [], 0
        reasons: dict[int, str] = {}
        try:
            async for deltas in stream:
                now = time.perf_counter()
                per_choice: dict[int, int] = {}
                for d in deltas:
                    per_choice[d.index] = per_choice.get(d.index, 0) + len(d.token_ids)
                steps = max(per_choice.values(), default=0)  # engine steps in this delivery
                if steps:
                    if ttft is None:
                        ttft = now - start
                    else:  # a lagging consumer gets several steps at once: one gap per token
                        gaps += [(now - last) / steps] * steps
                    last = now
                tokens += sum(per_choice.values())
                for d in deltas:
                    if d.finish_reason:
                        reasons[d.index] = d.finish_reason
                yield deltas
        finally:
            await stream.aclose()
            values = list(reasons.values())
            reason = ("error" if "error" in values else "abort" if "abort" in values or len(values) < n
                      else reasons[0])
            self.metrics.record(prompt_tokens=prompt_len, generation_tokens=tokens, finished_reason=reason,
                                ttft=ttft, token_gaps=gaps, e2e=time.perf_counter() - start, model_name=model_name)

    @staticmethod
    async def _drain(events: AsyncIterator) -> None:
        async for _ in events:
            pass
