"""Tool-call parsers: find the tool calls in a model's text output (``tool_choice: auto``).

Models trained for tool use write calls in a format of their own (Hermes/Qwen's
``<tool_call>{...}</tool_call>``, Llama 3's bare JSON object). A parser turns that text
into OpenAI ``tool_calls`` and says how to write calls back into a conversation and how
to describe tools to a model whose chat template does not take them. The pipeline picks
one (``tool_parser:``); ``tool_choice`` ``required`` or a named function need no parser (the
server constrains the output to JSON built from the tools' schemas).

The server calls :meth:`ToolParser.parse` on the whole output so far as it grows: every
result must extend the previous one (its ``content`` a prefix of the next, its ``calls``
the first calls of the next), so a stream can send only what is new.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

from modserve.core.contract.plugin import Plugin


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends ``function.arguments``


@dataclass(frozen=True)
class ToolParse:
    content: str  # the text that is not a tool call (so far)
    calls: list[ToolCall] = field(default_factory=list)  # the calls complete so far


class ToolParser(Plugin):
    """Built once per engine (``ctx.tokenizer`` is set); stateless across requests."""

    @abstractmethod
    def parse(self, text: str, final: bool) -> ToolParse:
        """Split ``text`` (the output so far) into content and complete calls.

        ``final=False``: hold back any text that may still become part of a call (a
        partial start marker, an unfinished call). ``final=True``: the output is complete;
        a call that does not parse is returned as content, never dropped."""

    @abstractmethod
    def render_calls(self, calls: list[ToolCall]) -> str:
        """Earlier assistant ``tool_calls`` as the model writes them, for a chat template
        that does not render ``tool_calls`` itself."""

    @abstractmethod
    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """A system-prompt text describing ``tools`` (OpenAI ``{"type": "function", "function":
        {...}}`` dicts) and this format, for a chat template that does not take ``tools``."""
