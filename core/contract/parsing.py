"""Helpers for parser plugins (tool calls, reasoning) that read a growing output: partial
markers to hold back, JSON values that may be unfinished, call objects read and written."""

from __future__ import annotations

import json
from typing import Any

from modserve.core.contract.tool_parser import ToolCall

_DECODER = json.JSONDecoder()


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is the start of ``marker`` (text a stream
    must hold back: the next token may complete the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def held(text: str, *markers: str) -> int:
    """Characters to hold back at the end of ``text``: trailing whitespace (it may turn out to
    separate content from a marker) and any partial marker."""
    n = max((partial_suffix(text, m) for m in markers), default=0)
    body = text[: len(text) - n]
    return len(text) - len(body.rstrip())


def decode_prefix(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at ``pos`` (after whitespace) and the index after it; None if
    no complete value starts there (yet)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def call_from(obj: Any, arguments_key: str) -> ToolCall | None:
    """``{"name": ..., <arguments_key>: {...}}`` as a call (``arguments`` also accepted, and
    arguments given as a JSON string); None when ``obj`` is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def call_json(call: ToolCall, arguments_key: str = "arguments") -> str:
    """A call written back as ``{"name": ..., <arguments_key>: {...}}``."""
    return json.dumps({"name": call.name, arguments_key: json.loads(call.arguments)}, ensure_ascii=False)


def tools_json(tools: list[dict[str, Any]]) -> str:
    """The tools' function signatures, one JSON object per line (for instructions in a prompt)."""
    return "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
