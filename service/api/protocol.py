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

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator,
                      model_serializer, model_validator)


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


class JsonSchema(OpenAIBase):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBase):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self


class StructuredOutputs(OpenAIBase):
    """vLLM's `structured_outputs`: exactly one constraint, and how JSON may be spaced."""

    json_: dict[str, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, min_length=1)
    grammar: Text | None = None
    json_object: bool | None = None
    structural_tag: Text | None = None
    disable_any_whitespace: bool = False

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputs:
        given = [name for name in ("json_", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object, structural_tag; "
                             f"got {len(given)}")
        return self


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
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Extension (vLLM's): constrain the output to a JSON schema, regex, choice or grammar.")
    prompt_logprobs: LogprobCount | None = Field(
        None, description="Extension (vLLM's): each prompt token's logprob and this many likeliest alternatives.")
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = Field(
        None, description="Extension (vLLM's): each prompt or output token's logit divided by this where positive, "
                          "multiplied where not (1 = off).")
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = Field(
        None, description="Extension (vLLM's): drop the tokens less likely than this times the likeliest's "
                          "probability (0 = off).")
    include_stop_str_in_output: bool = Field(
        False, description="Extension (vLLM's): keep the stop string or stop token that ended a choice at the end "
                           "of its text.")
    skip_special_tokens: bool = Field(
        True, description="Extension (vLLM's): leave special tokens (end of sequence, chat markers) out of the "
                          "text; false writes them.")
    spaces_between_special_tokens: Literal[True] = Field(
        True, description="Extension (vLLM's): only its default, true, is served.")
    bad_words: list[str] | None = Field(
        None, description="Extension (vLLM's): words the output may not write, at its start or after a space: each "
                          "word's last token is never chosen right after the rest of it (at most 128 as tokens).")
    truncate_prompt_tokens: Annotated[int, Field(ge=-1), BeforeValidator(_integral)] | None = Field(
        None, description="Extension (vLLM's): serve only this many of the prompt's tokens, the last unless "
                          "truncation_side is right (-1: the context less one). A text prompt cut without a side "
                          "keeps the special tokens its encoding adds (BOS), as vLLM's tokenizer cuts it.")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="Extension (vLLM's): with truncate_prompt_tokens, right keeps the first tokens and left "
                          "the last (of the whole encoding, BOS included).")
    cache_salt: str | None = Field(
        None, min_length=1, description="Extension (vLLM's): prompts share prefix-cached KV only with requests of "
                                        "the same salt; a secret per tenant keeps its cached prompts from being "
                                        "timed by another.")
    return_tokens_as_token_ids: bool | None = Field(
        None, description="Extension (vLLM's): logprobs name tokens \"token_id:N\" rather than by their text.")
    return_token_ids: bool | None = Field(
        None, description="Extension (vLLM's): the prompt's token ids and each choice's beside the text; a stream "
                          "gives the prompt's in its first chunk (a completions choice: in that choice's first) and "
                          "each chunk's new ids.")
    allowed_token_ids: list[TokenId] | None = Field(
        None, min_length=1, description="Extension (vLLM's): the only token ids a choice may take.")
    min_tokens: Annotated[int, Field(ge=0), BeforeValidator(_integral)] = Field(
        0, description="Extension (vLLM's): generate at least this many tokens before a stop token or string may "
                       "end a choice.")

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        """OpenAI's API and vLLM refuse stream_options without a stream; it would be ignored."""
        if options is not None and info.data.get("stream") is False:  # absent when stream itself failed
            raise ValueError("stream_options is only allowed when stream is true")
        return options


# -- chat completions ----------------------------------------------------------------------
class TextPart(OpenAIBase):
    type: Literal["text"]
    text: Text


class FunctionCall(OpenAIBase):
    name: str
    arguments: str


class ToolCall(OpenAIBase):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(OpenAIBase):
    role: Role
    content: Text | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(OpenAIBase):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIBase):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIBase):
    name: str


class NamedToolChoice(OpenAIBase):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = Field(
        True, description="Extension (vLLM's): end the prompt with the chat template's cue for the assistant's turn.")
    continue_final_message: bool = Field(
        False, description="Extension (vLLM's): leave the final message open for the model to continue (a prefill "
                           "of the assistant's reply); needs add_generation_prompt false.")
    add_special_tokens: bool = Field(
        False, description="Extension (vLLM's): add the tokenizer's special tokens (BOS) to the rendered prompt, "
                           "beside those the chat template writes.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extension (vLLM's): more variables for the chat template, such as enable_thinking.")

    @field_validator("continue_final_message")
    @classmethod
    def _open_or_cued(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):  # vLLM's rule: the prompt ends one way
            raise ValueError("cannot be true while add_generation_prompt is true")
        return value


class ChatLogprobTop(ResponseBase):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatChoiceLogprobs(ResponseBase):
    content: list[ChatLogprob] | None = None


class ResponseFunction(ResponseBase):
    name: str | None = None
    arguments: str | None = None


class ResponseToolCall(ResponseBase):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class ChatResponseMessage(ResponseBase):
    role: Role = "assistant"  # the last message's, where a request has no generation cue (vLLM's)
    content: str | None = None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


def _absent(value) -> bool:
    return value is None


def token_ids_field(description: str):
    """A vLLM extension's token ids: absent from the JSON unless the request asked (return_token_ids)."""
    return Field(None, description=f"Extension (vLLM's): {description}, with return_token_ids.", exclude_if=_absent)


class ChatChoice(ResponseBase):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, description="Extension: the stop string or token that ended it.")
    token_ids: list[int] | None = token_ids_field("the choice's token ids")


class PromptLogprob(ResponseBase):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ChatCompletionResponse(ResponseBase):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(None, description="Extension (vLLM's): see the request's.")
    prompt_token_ids: list[int] | None = token_ids_field("the prompt's token ids")


class OmitNone(ResponseBase):
    """Fields left None are absent, as in OpenAI's stream: a client that merges deltas (the official
    one's stream helper) would otherwise take a later null for the value an earlier delta set."""

    @model_serializer(mode="wrap")
    def _omit_none(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunction(OmitNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OmitNone):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class ChatDelta(ResponseBase):
    role: Role | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(ResponseBase):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = token_ids_field("the chunk's new token ids")


class ChatCompletionChunk(ResponseBase):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = token_ids_field("the prompt's token ids, in the first chunk")


# -- completions ---------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    model: str
    prompt: Text | list[Text] | list[Int] | list[list[Int]]
    best_of: PositiveInt | None = None
    echo: bool = False
    logprobs: LogprobCount | None = None
    max_tokens: PositiveInt | None = 16
    suffix: str | None = None
    add_special_tokens: bool = Field(
        True, description="Extension (vLLM's): add the tokenizer's special tokens (BOS) to a text prompt.")


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
    prompt_logprobs: PromptLogprobs | None = Field(None, description="Extension (vLLM's): see the request's.")
    token_ids: list[int] | None = token_ids_field("the choice's token ids (a stream's chunk: its new ones)")
    prompt_token_ids: list[int] | None = token_ids_field("its prompt's token ids (a stream: in the choice's first chunk)")


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
