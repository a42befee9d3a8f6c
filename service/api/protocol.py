"""OpenAI API schemas (requests and responses). Schemas only: the logic lives in `serving.py`.

Requests forbid unknown fields so an unsupported parameter is refused with 400, never ignored, and
are strict, as OpenAI's API is: `"temperature": "0.5"` or `false` is a 400, not a coercion. Numbers
keep JSON Schema's meaning, which our OpenAPI document states: an integer stands for a float, and
an integral float (`2.0`) for an integer. Text must be valid Unicode: a lone surrogate, which JSON can
carry and no tokenizer can encode, is a 400 naming the field. Our own extensions (vLLM's) are
marked with a description.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field


class OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text: a lone surrogate {text[exc.start]!r} at character {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Integers: strict, but 2.0 is one (JSON Schema's "integer"). Bounds sit inside the type, before the
# validator, so that the schema states them as minimum/maximum (on an optional field, a Field's
# bounds would come out as a bare "ge").
Int = Annotated[int, BeforeValidator(_integral)]
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
TokenId = Annotated[int, Field(ge=0), BeforeValidator(_integral)]
TopK = Annotated[int, Field(ge=-1), BeforeValidator(_integral)]
LogprobCount = Annotated[int, Field(ge=0, le=20), BeforeValidator(_integral)]
ChoiceCount = Annotated[int, Field(ge=1, le=128), BeforeValidator(_integral)]


class ResponseBase(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- errors and shared parts ---------------------------------------------------------------
class ErrorInfo(ResponseBase):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(ResponseBase):
    error: ErrorInfo


class StreamOptions(OpenAIBase):
    include_usage: bool = False


class ResponseFormat(OpenAIBase):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class Usage(ResponseBase):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SamplingFields(OpenAIBase):
    """Fields chat and completions share, in the OpenAI documentation's order."""

    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: ChoiceCount = 1
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: Int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    user: str | None = None
    top_k: TopK | None = Field(None, description="Extension: sample from the k likeliest tokens (-1 or 0 = all).")
    stop_token_ids: list[TokenId] | None = Field(
        None, description="Extension: token ids that end a choice.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past the end-of-sequence token.")


# -- chat completions ----------------------------------------------------------------------
class TextPart(OpenAIBase):
    type: Literal["text"]
    text: Text


class ChatMessage(OpenAIBase):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class ChatLogprobTop(ResponseBase):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatChoiceLogprobs(ResponseBase):
    content: list[ChatLogprob] | None = None


class ChatResponseMessage(ResponseBase):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(ResponseBase):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, description="Extension: the stop string or token that ended it.")


class ChatCompletionResponse(ResponseBase):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(ResponseBase):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(ResponseBase):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseBase):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# -- completions ---------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    model: str
    prompt: Text | list[Text] | list[Int] | list[list[Int]]
    best_of: PositiveInt | None = None
    echo: bool = False
    logprobs: LogprobCount | None = None
    max_tokens: PositiveInt | None = 16
    suffix: str | None = None


class CompletionLogprobs(ResponseBase):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ResponseBase):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(ResponseBase):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- models and management -----------------------------------------------------------------
class ModelCard(ResponseBase):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "system"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(ResponseBase):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(ResponseBase):
    object: Literal["health.response"] = "health.response"
    message: str
    status: str
