"""Tool calling on the chat API, request side: ``tools`` and ``tool_choice`` become a plan
that says how the prompt shows the tools and how the output is constrained and read.

- ``auto`` (the default with tools): the model decides; the pipeline's tool parser reads
  calls out of its text. Refused when the pipeline has no ``tool_parser``.
- ``required`` / a named function: the output is decoded under a JSON schema built from the
  tools' parameter schemas (a list of ``{"name", "parameters"}`` objects, or the named
  function's arguments), so every call parses and its arguments match its schema.
- ``none``: the tools are left out of the prompt; the answer is text.

Tools reach the model through its chat template when the template reads ``tools``;
otherwise the parser's instructions are put in the system message. Earlier assistant
``tool_calls`` are rendered by the template if it reads them, else written into the
message's content in the parser's format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from modserve.core.contract import ToolCall, ToolParser
from modserve.core.contract.parsing import call_json, tools_json
from modserve.core.sampling_params import StructuredOutputs
from modserve.core.tokenizer import TokenizerBundle
from modserve.server.errors import bad_request
from modserve.server.protocol import ChatCompletionRequest, ChatMessage

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["none", "auto", "required", "named"]
    tools: list[dict[str, Any]]  # {"type": "function", "function": {...}}, as chat templates take them
    name: str | None = None  # the named function
    parallel: bool = True  # false: at most one call

    def schemas(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"].get("parameters") or _ANY_OBJECT for t in self.tools}

    def constraint(self) -> StructuredOutputs | None:
        """The output grammar of ``required`` and named choices (None for ``auto`` and ``none``)."""
        if self.mode == "named":
            return StructuredOutputs(json=self.schemas()[self.name])
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in self.schemas().items()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputs(json=array)


def plan_tools(body: ChatCompletionRequest, parser: ToolParser | None) -> ToolPlan | None:
    """The request's tool plan (None without tools); 400 naming the field for a bad tool or choice."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice: needs tools", "tool_choice")
        return None
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(body.tools):
        where = f"tools[{i}]"
        if tool.type != "function":
            raise bad_request(f"{where}.type: only 'function' tools are supported, got {tool.type!r}", f"{where}.type")
        fn = tool.function
        if fn is None:
            raise bad_request(f"{where}.function: required for a function tool", f"{where}.function")
        if not _NAME.fullmatch(fn.name):
            raise bad_request(
                f"{where}.function.name: must be 1-64 letters, digits, '_' or '-', got {fn.name!r}", f"{where}.function.name"
            )
        if any(t["function"]["name"] == fn.name for t in tools):
            raise bad_request(f"{where}.function.name: {fn.name!r} is given twice", f"{where}.function.name")
        spec: dict[str, Any] = {"name": fn.name}
        if fn.description is not None:
            spec["description"] = fn.description
        if fn.parameters is not None:
            spec["parameters"] = fn.parameters
        tools.append({"type": "function", "function": spec})
    if choice is None or isinstance(choice, str):
        mode, name = choice or "auto", None
    else:
        mode, name = "named", choice.function.name
        if name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice.function.name: no tool named {name!r} in tools", "tool_choice")
    if mode == "auto":
        if parser is None:
            raise bad_request(
                "tool_choice: 'auto' needs a tool parser in the server's pipeline (tool_parser:); "
                "use 'required' or a named function, or ask the operator to set one",
                "tool_choice",
            )
        strict = next((i for i, t in enumerate(body.tools) if t.function.strict), None)
        if strict is not None:
            raise bad_request(
                f"tools[{strict}].function.strict: enforced only with tool_choice 'required' or a named function "
                "(with 'auto' the model's free text is parsed, not constrained)",
                f"tools[{strict}].function.strict",
            )
    return ToolPlan(mode, tools, name, body.parallel_tool_calls)


def render_messages(
    messages: list[ChatMessage], plan: ToolPlan | None, parser: ToolParser | None, tokenizer: TokenizerBundle
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages as chat-template dicts (text content only), and the ``tools`` the template is
    given. 400 naming the message for a non-text part or an unreadable tool call."""
    template = tokenizer.chat_template or ""
    template_calls = "tool_calls" in template
    rendered: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": _text(m.content, f"messages[{i}].content")}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = [_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
            if template_calls:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}}
                    for c, (_, args) in zip(m.tool_calls, calls)
                ]
            else:
                written = _render_calls([ToolCall(n, json.dumps(a, ensure_ascii=False)) for n, a in calls], parser)
                msg["content"] = f"{msg['content']}\n{written}" if msg["content"] else written
        rendered.append(msg)
    if plan is None or plan.mode == "none":
        return rendered, None
    if "tools" in tokenizer.template_variables:
        return rendered, plan.tools
    note = parser.instructions(plan.tools) if parser is not None else _instructions(plan.tools)
    if rendered and rendered[0]["role"] == "system":
        rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{note}"}
    else:
        rendered.insert(0, {"role": "system", "content": note})
    return rendered, None


def _text(content: str | list | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(f"{where}[{j}]: only text content parts are supported, got type {part.type!r}", where)
    return "".join(part.text for part in content)


def _call(call: Any, where: str) -> tuple[str, dict[str, Any]]:
    return call.function.name, arguments_object(call.function.arguments, f"{where}.function.arguments")


def arguments_object(text: str, where: str) -> dict[str, Any]:
    """A tool call's arguments (a JSON object's text) as a dict; 400 naming ``where`` otherwise."""
    try:
        args = json.loads(text)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise bad_request(f"{where}: must be a JSON object's text", where)
    return args


def _render_calls(calls: list[ToolCall], parser: ToolParser | None) -> str:
    if parser is not None:
        return parser.render_calls(calls)
    return f"[{', '.join(call_json(c, 'parameters') for c in calls)}]"  # the list `required` decodes


def _instructions(tools: list[dict[str, Any]]) -> str:
    """Without a tool parser (only ``required`` and named choices): the functions, described."""
    return f"You can call these functions (JSON signatures):\n{tools_json(tools)}"
