"""Request and response bodies of the OpenAI-compatible API as ``msgspec`` structs.

Requests decode strictly (no type coercion) but ignore unknown fields, so clients such
as ``vllm bench serve`` or lm-evaluation-harness may send extras. Value ranges that
``SamplingParams`` already checks are left to it; only limits of the wire format live
here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


# ----------------------------------------------------------------- requests


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class SamplingFields(Struct, kw_only=True):
    """Fields shared by completions and chat (OpenAI's plus vLLM's sampling extras)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: PositiveInt = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    priority: Int64 = 0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None  # prefix-cache isolation: only requests with the same salt share cached KV
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias; the logit_bias logits processor
    structured_outputs: dict[str, Any] | None = None  # vLLM's: {json | regex | choice | grammar | json_object}
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for the same constraints
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    bad_words: list[str] | None = None  # vLLM's token filters (logits processors bad_words, allowed_token_ids)
    allowed_token_ids: list[int] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: str | list[str | int | list[int]]
    max_tokens: PositiveInt | None = 16
    logprobs: NonNegInt | None = None
    echo: bool = False
    prompt_logprobs: NonNegInt | None = None  # vLLM's: top-N logprobs of every prompt token, in the choice


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCallIn(Struct, kw_only=True):
    name: str
    arguments: str  # a JSON object's text


class ToolCallIn(Struct, kw_only=True):
    """An earlier assistant turn's tool call, sent back in the conversation."""

    function: FunctionCallIn
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # role assistant
    tool_call_id: str | None = None  # role tool: the call this message answers


class FunctionDef(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # arguments always match `parameters` (enforced with tool_choice required or named)


class ToolDef(Struct, kw_only=True):
    type: str  # only "function" is supported (400 otherwise)
    function: FunctionDef | None = None


class NamedFunction(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Struct, kw_only=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    description: str | None = None  # refused when set (it would not reach the model)
    strict: bool | None = None  # the output always conforms: it is decoded under the schema's grammar


class ResponseFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NonNegInt | None = None
    add_generation_prompt: bool = True
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool = True  # false: at most one call per answer
    chat_template_kwargs: dict[str, Any] | None = None  # extra chat-template variables (e.g. enable_thinking)
    prompt_logprobs: NonNegInt | None = None  # vLLM's: top-N logprobs of every prompt token, in the response


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


# ----------------------------------------------------------------- responses


class PromptTokensDetails(Struct):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(Struct):
    logprob: float
    decoded_token: str | None = None


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: per prompt token (the first null), token id (as a key) -> its logprob, chosen and top-N
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | UnsetType = UNSET


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None | UnsetType = UNSET  # a stream shows it only with include_usage


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprob]


class FunctionCall(Struct):
    name: str
    arguments: str  # a JSON object's text


class ToolCallOut(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(Struct):
    content: str | None  # null when the answer is only tool calls
    role: str = "assistant"
    tool_calls: list[ToolCallOut] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET  # with a reasoning parser: the thinking before the answer


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class FunctionDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    """One streamed piece of a tool call: the first carries ``id``, ``type`` and the name;
    the ``arguments`` of all pieces of one ``index`` concatenate to the call's arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    # vLLM's: per prompt token (the first null), token id (as a key) -> its logprob, chosen and top-N
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | UnsetType = UNSET


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None | UnsetType = UNSET
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | UnsetType = UNSET  # on the first chunk


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "modserve"


class TokenizerInfo(Struct):
    """``GET /tokenizer_info``: what lm-evaluation-harness reads to render chats itself."""

    tokenizer_class: str
    vocab_size: int
    model_max_length: int
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_id: int | None
    pad_token: str | None = None


class ModelList(Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(Struct):
    prompt: str


class HealthResponse(Struct):
    status: str


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct):
    error: ErrorBody


encoder = msgspec.json.Encoder()
