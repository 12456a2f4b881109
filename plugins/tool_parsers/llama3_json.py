"""Tool parser ``llama3_json``: Llama 3.1-3.3's JSON tool calls.

The model answers either with text or, from its first character, with calls: an optional
``<|python_tag|>`` and then ``{"name": ..., "parameters": {...}}`` objects separated by
``;``. An output that starts like a call but does not parse stays text.
"""

from __future__ import annotations

from typing import Any

from modserve.core.contract import ToolCall, ToolParse, ToolParser, hookimpl
from modserve.core.contract.parsing import call_from, call_json, decode_prefix, tools_json

MODSERVE_CONTRACT = "2.1"

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ToolParse:
        body = text.lstrip()
        if not final and (not body or TAG.startswith(body)):
            return ToolParse("")  # the answer has not shown which it is yet
        body = body[len(TAG) :] if body.startswith(TAG) else body
        if not body.lstrip().startswith("{"):
            return ToolParse(text)
        calls: list[ToolCall] = []
        pos = 0
        while True:
            decoded = decode_prefix(body, pos)
            call = call_from(decoded[0], "parameters") if decoded is not None else None
            if call is None:  # unfinished, or not a call
                if not final and (decoded is None or calls):
                    return ToolParse("", calls)
                return ToolParse(text if not calls else body[pos:].strip(), calls)
            calls.append(call)
            pos = decoded[1]
            rest = body[pos:].lstrip()
            if not rest:
                return ToolParse("", calls)
            if not rest.startswith(";"):
                return ToolParse(rest if final else "", calls)
            pos = len(body) - len(rest) + 1

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "; ".join(call_json(c, "parameters") for c in calls)

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return (
            "Given the following functions, respond with a JSON object for a function call with its proper "
            'arguments, in the format {"name": function name, "parameters": object of argument names and '
            "values}, or answer in plain text if no function fits. Do not use variables.\n\n"
            f"{tools_json(tools)}"
        )


@hookimpl
def register_tool_parsers():
    return {"llama3_json": Llama3JsonToolParser}
