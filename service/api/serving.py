"""OpenAI chat and completions logic: validation, prompts, generation, responses. No FastAPI here.

A handler returns a response model, or an async generator of SSE strings for `stream: true`.
Expected failures raise `ServingError` before any byte is sent; once a stream has started, a failure
becomes an error frame followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from jinja2 import TemplateError

from service.adapters import Adapter, AdapterRegistry
from service.admission import Admission
from service.api.chat_messages import reserved_template_names, template_kwargs, template_messages
from service.api.encoding import prompt_encoder
from service.api.errors import ServingError, allowed_beside, bad_request, empty_prompt, from_exception, sse_error
from service.api.protocol import (ChatChoice, ChatChoiceLogprobs, ChatChunkChoice, ChatCompletionChunk,
                                  ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatLogprob,
                                  ChatLogprobTop, ChatResponseMessage, CompletionChoice, CompletionLogprobs,
                                  CompletionRequest, CompletionResponse, DeltaFunction, DeltaToolCall, PromptLogprob,
                                  PromptLogprobs, ResponseFunction, ResponseToolCall, SamplingFields,
                                  StructuredOutputs, Usage)
from service.api.tool_calls import HermesParser, ToolCallDelta, tool_constraint
from service.api.truncation import keep_count, special_split, truncated
from service.engine.base import ChoiceDelta, Engine, GenerationRequest, SamplingParams, TokenLogprob, TopLogprob
from service.engine.grammar import MAX_NESTING, Constraint, GrammarError, nesting
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
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.prompt_logprobs = delta.prompt_logprobs or self.prompt_logprobs
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
    grammar: object = None  # the compiled constraint every choice follows
    cache_salt: str | None = None  # vLLM's: its prompts share prefix cache only with the same salt's
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


def shown(token: TokenLogprob | TopLogprob, as_ids: bool) -> str:
    """A logprobs entry's token: its text, or "token_id:N" (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token.token_id}" if as_ids else token.token


MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS default: each is looked at for every token
MAX_BAD_WORD_TOKENS = 1024  # vLLM's VLLM_MAX_BAD_WORDS_TOTAL_TOKENS default: what a step compares at most
# The sampling fields' values where neither the request nor the model's generation config sets them
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
           "frequency_penalty": 0.0, "repetition_penalty": 1.0}


class OpenAIServing:
    def __init__(self, engine: Engine, tokenizer, model_name: str, metrics: ServiceMetrics, admission: Admission,
                 adapters: AdapterRegistry | None = None, tool_call_parser: str | None = None,
                 defaults: dict[str, float | int] | None = None, max_stop_strings: int = 4) -> None:
        """`defaults`: the sampling fields' values where a request leaves them unset (the model's
        generation config: service.generation_defaults). `max_stop_strings`: NIM_MAX_STOP_STRINGS."""
        self.engine, self.tokenizer, self.model_name, self.metrics = engine, tokenizer, model_name, metrics
        self.admission, self.adapters, self.tool_call_parser = admission, adapters, tool_call_parser
        self.defaults, self.max_stop_strings = defaults or {}, max_stop_strings
        self._encode = prompt_encoder(tokenizer)
        self._specials = special_split(self._encode)  # the special tokens a text's encoding adds (BOS)
        self._reserved = reserved_template_names(tokenizer)
        # Prompts are rendered and encoded here, not on the event loop: 2 MB of text took the tiny
        # model's tokenizer 1.8 s, every stream of the server waiting. One thread, as vLLM's
        # tokenizer executor: requests are encoded in the order they came.
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def _tokenized(self, render: Callable, *args):
        """`render(*args)` (a prompt's rendering and encoding) on the tokenizing thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, render, *args)

    # -- chat ------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, request_id: str):
        adapter = self._resolve_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        self.admission.check_size(1, req.n)
        functions = self._functions(req)
        calls = functions is not None and req.tool_choice != "none"  # the reply is parsed for tool calls
        forced = calls and not isinstance(req.tool_choice, str | None)  # named: OpenAI ends it with "stop"
        prompt = await self._tokenized(self._chat_prompt, req, functions)
        grammar = await self._compile(*self._chat_constraint(req, functions if calls else None))
        max_tokens = req.max_completion_tokens or req.max_tokens
        max_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        params = self._sampling(req, [prompt], max_tokens, max_param, prompt_logprobs=req.prompt_logprobs,
                                logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                bad_words=await self._bad_word_ids(req.bad_words))
        job = Job(f"chatcmpl-{request_id}", [prompt], params, req.model, adapter, grammar, req.cache_salt)
        events = self._run(job)
        role = "assistant" if req.add_generation_prompt else req.messages[-1].role  # vLLM's: the turn goes on
        ids, as_ids = bool(req.return_token_ids), bool(req.return_tokens_as_token_ids)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEStream(job, self._chat_stream(job, events, include_usage, calls, forced, role, ids, as_ids))
        await self._drain(events)
        choices = []
        for i, c in sorted(job.choices.items()):
            message = self._chat_message(c.text, calls, role)
            finish = self._finish_reason(c.finish_reason, bool(message.tool_calls) and not forced)
            choices.append(ChatChoice(index=i, message=message, finish_reason=finish, stop_reason=c.stop_reason,
                                      logprobs=self._chat_logprobs(c.logprobs, as_ids) if req.logprobs else None,
                                      token_ids=c.token_ids if ids else None))
        prompt_logprobs = None
        if req.prompt_logprobs is not None:
            prompt_logprobs = self._prompt_logprobs(prompt, job.choices[0].prompt_logprobs)
        return ChatCompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=job.usage,
                                      prompt_logprobs=prompt_logprobs, prompt_token_ids=prompt if ids else None)

    def _functions(self, req: ChatCompletionRequest) -> list[dict] | None:
        """The request's functions (OpenAI's tool definitions), once the tool choice is checked."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice needs tools", "tool_choice")
            return None
        if choice != "none" and self.tool_call_parser is None:
            raise bad_request("tool calls are not supported by this server: it runs without NIM_TOOL_CALL_PARSER", "tools")
        if any(nesting(tool.function.parameters) > MAX_NESTING for tool in req.tools):
            raise bad_request(f"tools: a function's parameters nest deeper than {MAX_NESTING} levels", "tools")
        functions = [tool.function.model_dump(exclude_none=True) for tool in req.tools]
        if not isinstance(choice, str | None) and choice.function.name not in {f["name"] for f in functions}:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not one of the tools", "tool_choice")
        return functions

    def _chat_prompt(self, req: ChatCompletionRequest, functions: list[dict] | None) -> list[int]:
        """The conversation rendered by the model's chat template, then encoded as vLLM encodes it
        (apply_chat_template's own encoding is the same call without special tokens)."""
        try:
            variables = template_kwargs(req.chat_template_kwargs, self._reserved)
        except ValueError as exc:
            raise bad_request(f"chat_template_kwargs: {exc}", "chat_template_kwargs") from None
        tools = [{"type": "function", "function": f} for f in functions] if functions else None
        try:
            template = self.tokenizer.get_chat_template(tools=tools)  # looked up once, used twice
            text = self.tokenizer.apply_chat_template(
                template_messages(req.messages, template), tools=tools, chat_template=template, tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, **variables)
        except TemplateError as exc:  # the template's own refusal (a role order it does not take)
            raise bad_request(f"messages cannot be rendered by the model's chat template: {exc}", "messages") from None
        except (ValueError, TypeError, LookupError, AttributeError) as exc:  # what the request's values did to it
            param = ("chat_template_kwargs" if req.chat_template_kwargs else
                     "continue_final_message" if req.continue_final_message else "messages")
            raise bad_request(f"the model's chat template cannot render this request: {exc}", param) from None
        if not (ids := self._encode(text, req.add_special_tokens)):
            raise bad_request("the chat template rendered the messages as no tokens", "messages")
        return self._truncated(req, ids, text=True)

    def _truncated(self, req: SamplingFields, ids: list[int], text: bool) -> list[int]:
        """The prompt cut as truncate_prompt_tokens asks (service.api.truncation), else as it is."""
        if req.truncate_prompt_tokens is None:
            return ids
        specials = self._specials if text and req.add_special_tokens else (0, 0)
        try:
            keep = keep_count(req.truncate_prompt_tokens, self.engine.max_model_len)
            return truncated(ids, keep, req.truncation_side, specials)
        except ValueError as exc:
            raise bad_request(str(exc), "truncate_prompt_tokens") from None

    def _chat_constraint(self, req: ChatCompletionRequest, functions: list[dict] | None) -> tuple[Constraint | None, str]:
        """The one constraint a chat request may carry, and the parameter that named it."""
        given: list[tuple[str, Callable[[], Constraint]]] = []
        if (fmt := req.response_format) and fmt.type == "json_object":
            given.append(("response_format", lambda: Constraint("json_object")))
        elif fmt and fmt.type == "json_schema":
            given.append(("response_format", lambda: Constraint.json_schema(fmt.json_schema.schema_ or {})))
        if req.structured_outputs:
            given.append(("structured_outputs", lambda: self._structured(req.structured_outputs)))
        if functions:
            choice = req.tool_choice if isinstance(req.tool_choice, str | None) else req.tool_choice.model_dump()
            parallel = req.parallel_tool_calls is not False
            given.append(("tools", lambda: tool_constraint(functions, choice or "auto", parallel)))
        if len(given) > 1:
            raise bad_request(f"{given[0][0]} and {given[1][0]} each constrain the reply; give one", given[1][0])
        if given and req.allowed_token_ids is not None:
            raise allowed_beside(given[0][0])
        return (self._constraint(*given[0]), given[0][0]) if given else (None, "")

    @staticmethod
    def _constraint(param: str, build: Callable[[], Constraint]) -> Constraint:
        try:
            return build()
        except GrammarError as exc:  # a schema nested too deep, or not JSON
            raise bad_request(f"{param}: {exc}", param) from None

    @staticmethod
    def _structured(fields: StructuredOutputs) -> Constraint:
        spacing = not fields.disable_any_whitespace
        if fields.json_ is not None:
            return Constraint.json_schema(fields.json_, any_whitespace=spacing)
        if fields.json_object:
            return Constraint("json_object")
        if fields.choice is not None:
            return Constraint.choice(fields.choice)
        for kind in ("regex", "grammar", "structural_tag"):
            if getattr(fields, kind) is not None:
                return Constraint(kind, getattr(fields, kind))
        raise bad_request("structured_outputs.json_object: false constrains nothing", "structured_outputs")

    async def _compile(self, constraint: Constraint | None, param: str):
        """The engine's grammar for the constraint, compiled off the event loop; 400 when it cannot be."""
        if constraint is None:
            return None
        try:
            return await self.engine.compile_grammar(constraint)
        except GrammarError as exc:
            raise bad_request(f"{param}: the constraint cannot be compiled: {exc}", param) from None

    def _chat_message(self, text: str, calls: bool, role: str) -> ChatResponseMessage:
        if not calls:
            return ChatResponseMessage(role=role, content=text)
        parser = HermesParser()
        content, _ = parser.feed(text)
        rest, _ = parser.finish()
        tool_calls = [ResponseToolCall(id=c.id, function=ResponseFunction(name=c.name, arguments=c.arguments))
                      for c in parser.calls]
        return ChatResponseMessage(role=role, content=(content + rest) or (None if tool_calls else ""),
                                   tool_calls=tool_calls)

    @staticmethod
    def _finish_reason(reason: str | None, called: bool) -> str | None:
        return "tool_calls" if reason == "stop" and called else reason

    async def _chat_stream(self, job: Job, events, include_usage: bool, calls: bool, forced: bool,
                           role: str, ids: bool, as_ids: bool) -> AsyncIterator[str]:
        """`ids`: return_token_ids, the prompt's ids in the first chunk and each chunk's new ones;
        `as_ids`: return_tokens_as_token_ids."""
        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None, prompt: list[int] | None = None) -> str:
            body = ChatCompletionChunk(id=job.request_id, model=job.model, choices=choices, usage=usage,
                                       prompt_token_ids=prompt)
            return f"data: {body.model_dump_json(exclude_none=False)}\n\n"

        parsers = {index: HermesParser() for index in range(job.params.n)} if calls else {}
        called: set[int] = set()
        try:
            for index in range(job.params.n):
                yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role=role, content=""))],
                            prompt=job.prompts[0] if ids and index == 0 else None)
            async for index, delta in events:
                content, tool_deltas = delta.text, []
                if calls:
                    content, tool_deltas = parsers[index].feed(delta.text)
                    if delta.finish_reason:
                        rest, more = parsers[index].finish()
                        content, tool_deltas = content + rest, tool_deltas + more
                    if tool_deltas:
                        called.add(index)
                logprobs = self._chat_logprobs(delta.logprobs, as_ids) if job.params.logprobs is not None else None
                if (content or tool_deltas or delta.finish_reason or delta.logprobs and logprobs is not None
                        or ids and delta.token_ids):
                    finish = self._finish_reason(delta.finish_reason, index in called and not forced)
                    body = ChatDelta(content=content if content or not tool_deltas else None,
                                     tool_calls=[self._tool_delta(d) for d in tool_deltas] or None)
                    yield chunk([ChatChunkChoice(index=index, delta=body, logprobs=logprobs,
                                                 finish_reason=finish, stop_reason=delta.stop_reason,
                                                 token_ids=delta.token_ids if ids else None)])
            if include_usage:
                yield chunk([], job.usage)
        except Exception as exc:  # a started stream reports failure in-band
            yield sse_error(from_exception(exc))
        yield DONE

    @staticmethod
    def _tool_delta(delta: ToolCallDelta) -> DeltaToolCall:
        return DeltaToolCall(index=delta.index, id=delta.id, type="function" if delta.id else None,
                             function=DeltaFunction(name=delta.name, arguments=delta.arguments))

    @staticmethod
    def _chat_logprobs(logprobs: list[TokenLogprob], as_ids: bool = False) -> ChatChoiceLogprobs:
        """`as_ids` (vLLM's return_tokens_as_token_ids): tokens named "token_id:N"; the chosen token's
        bytes stay its text's, the alternatives' are their names', as vLLM 0.32 writes them."""
        def entry(token: str, logprob: float, name: str | None = None) -> dict:
            return {"token": name or token, "logprob": logprob, "bytes": list(token.encode())}

        return ChatChoiceLogprobs(content=[
            ChatLogprob(**entry(lp.token, lp.logprob, shown(lp, as_ids)),
                        top_logprobs=[ChatLogprobTop(**entry(shown(t, as_ids), t.logprob)) for t in lp.top])
            for lp in logprobs])

    # -- completions -----------------------------------------------------------------------
    async def completion(self, req: CompletionRequest, request_id: str):
        adapter = self._resolve_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        prompts = await self._tokenized(self._completion_prompts, req)
        fields = req.structured_outputs
        if fields and req.allowed_token_ids is not None:
            raise allowed_beside("structured_outputs")
        constraint = self._constraint("structured_outputs", lambda: self._structured(fields)) if fields else None
        grammar = await self._compile(constraint, "structured_outputs")
        scored = req.logprobs if req.echo else None  # echo with logprobs scores the prompt (lm-eval's loglikelihood)
        asked = [k for k in (scored, req.prompt_logprobs) if k is not None]
        params = self._sampling(req, prompts, req.max_tokens, "max_tokens", logprobs=req.logprobs,
                                prompt_logprobs=max(asked) if asked else None,
                                bad_words=await self._bad_word_ids(req.bad_words))
        job = Job(f"cmpl-{request_id}", prompts, params, req.model, adapter, grammar, req.cache_salt)
        echoes = [self.tokenizer.decode(p, skip_special_tokens=True) if req.echo else "" for p in prompts]
        events = self._run(job)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEStream(job, self._completion_stream(job, events, include_usage, echoes, req))
        await self._drain(events)
        choices = []
        for i, c in sorted(job.choices.items()):
            prompt = prompts[i // params.n]
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._completion_logprobs(self._echoed(prompt, c.prompt_logprobs, scored) + c.logprobs, 0,
                                                     bool(req.return_tokens_as_token_ids))
            choices.append(CompletionChoice(
                index=i, text=echoes[i // params.n] + c.text, logprobs=logprobs, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_logprobs=self._prompt_logprobs(prompt, c.prompt_logprobs) if req.prompt_logprobs is not None else None,
                token_ids=c.token_ids if req.return_token_ids else None,
                prompt_token_ids=prompt if req.return_token_ids else None))
        return CompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=job.usage)

    def _echoed(self, prompt: list[int], scored: list[TokenLogprob | None] | None, top: int | None) -> list:
        """The prompt's entries of an echoed completion's logprobs: the first token has none (None)."""
        if top is None or scored is None:
            return []
        return [lp or TokenLogprob(prompt[0], self.tokenizer.decode([prompt[0]]), None) for lp in scored]

    def _prompt_logprobs(self, prompt: list[int], scored: list[TokenLogprob | None] | None) -> PromptLogprobs:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else the token and the likeliest."""
        result: PromptLogprobs = []
        for lp in scored or [None] * len(prompt):
            if lp is None:
                result.append(None)
                continue
            entry = {t.token_id: PromptLogprob(logprob=t.logprob, rank=rank, decoded_token=t.token)
                     for rank, t in enumerate(lp.top, 1)}
            entry[lp.token_id] = PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.token)
            result.append(entry)
        return result

    def _completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [prompt]
        elif not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        elif isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = prompt
        self.admission.check_size(len(prompts), req.n)  # before any prompt is encoded
        vocab = len(self.tokenizer)
        token_lists = []
        for item in prompts:
            if isinstance(item, str):
                if not (ids := self._encode(item, req.add_special_tokens)):
                    raise empty_prompt()
                token_lists.append(self._truncated(req, ids, text=True))
                continue
            if not item or any(not 0 <= t < vocab for t in item):
                raise bad_request(f"token prompts must be non-empty with ids in [0, {vocab})", "prompt")
            token_lists.append(self._truncated(req, list(item), text=False))
        return token_lists

    async def _completion_stream(self, job: Job, events, include_usage: bool, echoes: list[str],
                                 req: CompletionRequest) -> AsyncIterator[str]:
        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            body = CompletionResponse(id=job.request_id, model=job.model, choices=choices, usage=usage)
            return f"data: {body.model_dump_json()}\n\n"

        offsets: dict[int, int] = {}
        scored = req.logprobs if req.echo else None
        echoed: set[int] = set()  # with logprobs, a choice's echo waits for its prompt's logprobs
        ids, as_ids = bool(req.return_token_ids), bool(req.return_tokens_as_token_ids)
        unsent = set(range(len(job.prompts) * job.params.n)) if ids else set()  # choices yet to get their prompt's ids

        def prompt_ids(index: int) -> list[int] | None:
            """return_token_ids: the prompt's ids in a choice's first chunk, as vLLM sends them."""
            if index not in unsent:
                return None
            unsent.discard(index)
            return job.prompts[index // job.params.n]

        try:
            for index in range(len(job.prompts) * job.params.n):
                if echoes[index // job.params.n] and scored is None:
                    yield chunk([CompletionChoice(index=index, text=echoes[index // job.params.n],
                                                  token_ids=[] if ids else None, prompt_token_ids=prompt_ids(index))])
            async for index, delta in events:
                entries = delta.logprobs
                text = delta.text
                if scored is not None and index not in echoed:
                    echoed.add(index)
                    entries = self._echoed(job.prompts[index // job.params.n], delta.prompt_logprobs, scored) + entries
                    text = echoes[index // job.params.n] + text
                if text or delta.finish_reason or entries and job.params.logprobs is not None or ids and delta.token_ids:
                    logprobs = None
                    if job.params.logprobs is not None:
                        logprobs = self._completion_logprobs(entries, offsets.get(index, 0), as_ids)
                        offsets[index] = offsets.get(index, 0) + sum(len(shown(lp, as_ids)) for lp in entries)
                    prompt_logprobs = None
                    if req.prompt_logprobs is not None and delta.prompt_logprobs is not None:
                        prompt_logprobs = self._prompt_logprobs(job.prompts[index // job.params.n], delta.prompt_logprobs)
                    yield chunk([CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                  finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                                                  prompt_logprobs=prompt_logprobs,
                                                  token_ids=delta.token_ids if ids else None,
                                                  prompt_token_ids=prompt_ids(index))])
            if include_usage:
                yield chunk([], job.usage)
        except Exception as exc:
            yield sse_error(from_exception(exc))
        yield DONE

    @staticmethod
    def _completion_logprobs(logprobs: list[TokenLogprob], offset: int, as_ids: bool = False) -> CompletionLogprobs:
        """`as_ids`: tokens named "token_id:N", the offsets counting the names, as vLLM 0.32 writes them."""
        result = CompletionLogprobs()
        for lp in logprobs:
            token = shown(lp, as_ids)
            result.text_offset.append(offset)
            offset += len(token)
            result.tokens.append(token)
            result.token_logprobs.append(lp.logprob)
            result.top_logprobs.append({shown(t, as_ids): t.logprob for t in lp.top} if lp.logprob is not None else None)
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
                  logprobs: int | None, prompt_logprobs: int | None = None,
                  bad_words: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
        """`bad_words`: the request's as token ids (`_bad_word_ids`)."""
        limit = self.engine.max_model_len
        longest = max(len(p) for p in prompts)
        prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        if longest >= limit:
            raise bad_request(f"this model's maximum context length is {limit} tokens; the prompt has {longest} tokens",
                              prompt_param)
        if max_tokens is not None and max_tokens > limit:  # else each prompt's output stops at the context, as in vLLM
            raise bad_request(f"{max_param}={max_tokens} cannot be greater than this model's maximum context length, "
                              f"{limit} tokens", max_param)
        vocab = len(self.tokenizer)
        for name in ("stop_token_ids", "allowed_token_ids"):
            if any(t >= vocab for t in getattr(req, name) or ()):
                raise bad_request(f"{name} must be token ids of this model, in [0, {vocab})", name)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if any(not s for s in stop):
            raise bad_request("stop strings must not be empty", "stop")
        if len(stop) > self.max_stop_strings:  # each is looked for after every token of every choice
            raise bad_request(f"at most {self.max_stop_strings} stop strings (NIM_MAX_STOP_STRINGS); got {len(stop)}",
                              "stop")
        # each field the request's, else the model's (its generation config), else neutral
        sent = {name: value for name in NEUTRAL.keys() & req.model_fields_set
                if (value := getattr(req, name)) is not None}
        chosen = {**NEUTRAL, **self.defaults, **sent}
        if max_tokens is None:
            max_tokens = min(self.defaults.get("max_tokens", limit), limit - longest)
        if req.min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({req.min_tokens}) must be at most {max_param} ({max_tokens})", "min_tokens")
        return SamplingParams(
            n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, temperature=chosen["temperature"],
            top_p=chosen["top_p"], top_k=max(chosen["top_k"], 0), min_p=chosen["min_p"], seed=req.seed,
            stop=tuple(stop), include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            logprobs=logprobs, presence_penalty=chosen["presence_penalty"],
            frequency_penalty=chosen["frequency_penalty"], repetition_penalty=chosen["repetition_penalty"],
            logit_bias=self._logit_bias(req.logit_bias), prompt_logprobs=prompt_logprobs,
            bad_words=bad_words,
            allowed_token_ids=tuple(sorted(set(req.allowed_token_ids or ()))))

    async def _bad_word_ids(self, words: list[str] | None) -> tuple[tuple[int, ...], ...]:
        """The request's bad words as token ids, encoded on the tokenizing thread where there are any."""
        return await self._tokenized(self._bad_words, words) if words else ()

    def _bad_words(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad words as token ids: each word as written (leading spaces dropped) and, where it
        tokenizes as a new word of as many tokens, after a space, so that it is barred at the start of
        a text and within it (vLLM's SamplingParams.update_from_tokenizer)."""
        result: list[tuple[int, ...]] = []
        for word in dict.fromkeys(words):
            if not word:
                raise bad_request("bad_words cannot contain an empty string", "bad_words")
            plain = tuple(self._encode(word.lstrip(), False))
            if not plain:
                raise bad_request(f"bad_words entry {word!r} tokenizes to no tokens", "bad_words")
            spaced = tuple(self._encode(" " + word.lstrip(), False))
            result.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                result.append(spaced)
            if len(result) > MAX_BAD_WORDS:
                raise bad_request(f"at most {MAX_BAD_WORDS} bad words once tokenized; got more", "bad_words")
        if sum(map(len, result)) > MAX_BAD_WORD_TOKENS:  # each is compared with the output's end every step
            raise bad_request(f"bad_words come to more than {MAX_BAD_WORD_TOKENS} tokens", "bad_words")
        return tuple(result)

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        result, vocab = [], len(self.tokenizer)
        for key, value in (bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab:
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
                request = GenerationRequest(f"{job.request_id}-{i}", prompt, job.params, job.adapter, job.grammar,
                                            job.cache_salt)
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
