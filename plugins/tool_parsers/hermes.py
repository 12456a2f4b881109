"""Tool parser ``hermes``: calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format of Hermes 2/3, Qwen 2.5/3 and most open tool-use fine-tunes. Text before the
first call is content; calls follow one another (whitespace between them); anything after
the last call that is not another call is content too. A call whose JSON does not parse
stays text.
"""

from __future__ import annotations

from typing import Any

from modserve.core.contract import ToolCall, ToolParse, ToolParser, hookimpl
from modserve.core.contract.parsing import call_from, call_json, decode_prefix, held, tools_json

MODSERVE_CONTRACT = "2.1"

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ToolParse:
        first = text.find(START)
        if first < 0:
            return ToolParse(text if final else text[: len(text) - held(text, START)])
        calls: list[ToolCall] = []
        pos = first
        while text.startswith(START, pos):
            end = text.find(END, pos)
            if end < 0:  # still being written: held back, or text if the output ended here
                if not final:
                    return ToolParse(text[:first].rstrip(), calls)
                break
            call = self._decode(text[pos + len(START) : end])
            if call is None:  # malformed: it and all after it stay text
                break
            calls.append(call)
            pos = end + len(END)
            after = text[pos:].lstrip()
            if not final and START.startswith(after):  # maybe the next call's start
                return ToolParse(text[:first].rstrip(), calls)
            pos = len(text) - len(after)
        if not calls:
            return ToolParse(text if final else text[: len(text) - held(text, START)])
        rest = text[pos:]
        rest = rest if final else rest[: len(rest) - held(rest, START)]
        before = text[:first].rstrip()
        return ToolParse(f"{before}\n{rest}" if before and rest else before or rest, calls)

    @staticmethod
    def _decode(body: str) -> ToolCall | None:
        decoded = decode_prefix(body, 0)
        if decoded is None or body[decoded[1] :].strip():
            return None
        return call_from(decoded[0], "arguments")

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(f"{START}\n{call_json(c)}\n{END}" for c in calls)

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return (
            "You may call one or more functions to answer the user. The functions, as JSON "
            f"signatures, are inside <tools></tools> tags:\n<tools>\n{tools_json(tools)}\n</tools>\n\n"
            f"To call a function, write a JSON object with its name and arguments inside {START}{END} tags:\n"
            f'{START}\n{{"name": <function-name>, "arguments": <arguments-object>}}\n{END}'
        )


@hookimpl
def register_tool_parsers():
    return {"hermes": HermesToolParser}
