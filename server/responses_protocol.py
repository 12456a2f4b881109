"""``POST /v1/responses`` bodies as ``msgspec`` structs: OpenAI's Responses API, the subset
served here (``server/fields.py`` lists what is refused)."""

from __future__ import annotations

from typing import Any, Literal

from msgspec import UNSET, Struct, UnsetType

from modserve.server.protocol import PositiveInt

# ----------------------------------------------------------------- request


class ResponseTextFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema: dict[str, Any] | None = None
    description: str | None = None  # refused when set (it would not reach the model)
    strict: bool | None = None  # the output always conforms: it is decoded under the schema's grammar


class ResponseTextConfig(Struct, kw_only=True):
    format: ResponseTextFormat | None = None
    verbosity: str | None = None  # refused when set


class FunctionTool(Struct, kw_only=True):
    """The Responses API's flat function tool (``{"type": "function", "name": ...}``)."""

    type: str  # only "function" is supported
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(Struct, kw_only=True):
    type: Literal["function"]
    name: str


class ResponsesRequest(Struct, kw_only=True):
    # a string (one user message) or a list of items: messages ({role, content}), function_call,
    # function_call_output
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None  # a system message before the input
    max_output_tokens: PositiveInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: ResponseTextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None  # echoed back in the response
    user: str | None = None


# ----------------------------------------------------------------- response


class OutputText(Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(Struct, tag_field="type", tag="reasoning_text"):
    text: str


class OutputItem(Struct, omit_defaults=True):
    """A message, a function call or reasoning; only the fields of its ``type`` are set."""

    type: Literal["message", "function_call", "reasoning"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: str | None = None  # message
    content: list[OutputText | ReasoningText] | None = None  # message, reasoning
    summary: list[Any] | None = None  # reasoning
    call_id: str | None = None  # function_call
    name: str | None = None
    arguments: str | None = None


class InputTokensDetails(Struct):
    cached_tokens: int


class OutputTokensDetails(Struct):
    reasoning_tokens: int


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct):
    reason: str  # max_output_tokens


class ResponseObject(Struct):
    id: str
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    output: list[OutputItem]
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[FunctionTool]
    text: ResponseTextConfig
    metadata: dict[str, str]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: Any = None
    object: str = "response"
    store: bool = False  # nothing is stored: previous_response_id is refused
    truncation: str = "disabled"
    user: str | None = None


class ResponseEvent(Struct, omit_defaults=True):
    """One streamed event (``event: <type>``); only the fields of its ``type`` are set."""

    type: str
    sequence_number: int
    response: ResponseObject | UnsetType = UNSET
    output_index: int | UnsetType = UNSET
    item: OutputItem | UnsetType = UNSET
    item_id: str | UnsetType = UNSET
    content_index: int | UnsetType = UNSET
    part: OutputText | ReasoningText | UnsetType = UNSET
    delta: str | UnsetType = UNSET
    text: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET
    logprobs: list[Any] | UnsetType = UNSET
    message: str | UnsetType = UNSET  # error
    code: str | None | UnsetType = UNSET
    param: str | None | UnsetType = UNSET
