"""JSON writing shared by the tool parsers: a call, a list of tool signatures."""

from __future__ import annotations

import json
from typing import Any

from modserve.core.contract import ToolCall


def call_json(call: ToolCall, arguments_key: str = "arguments") -> str:
    return json.dumps({"name": call.name, arguments_key: json.loads(call.arguments)}, ensure_ascii=False)


def tools_json(tools: list[dict[str, Any]]) -> str:
    """One function description per line."""
    return "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
