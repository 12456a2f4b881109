"""Tool calling and reasoning on the chat API, output side: one choice's growing text read
into ``reasoning_content``, ``content`` and ``tool_calls``, whole or as stream deltas.

The parsers are called on the whole text so far and return results that only grow
(:mod:`modserve.core.contract.tool_parser`), so a stream sends just what is new: content
and reasoning as text deltas; a call of ``auto`` or ``required`` once it is complete (id,
name and all its arguments in one delta); a named function's arguments token by token.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from modserve.core.contract import ReasoningParser, ToolParse, ToolParser
from modserve.core.contract.parsing import call_from, decode_prefix
from modserve.server.protocol import (
    AssistantMessage,
    Delta,
    FunctionCall,
    FunctionDelta,
    ToolCallDelta,
    ToolCallOut,
)
from modserve.server.tool_calls import ToolPlan


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ChoiceReader:
    """One choice's output. ``reasoning`` is None when the request is constrained (the
    grammar starts at the first token, so there is no thinking to split off)."""

    plan: ToolPlan | None
    tools: ToolParser | None
    reasoning: ReasoningParser | None
    text: str = ""
    sent_reasoning: str = ""
    sent_content: str = ""
    calls: list[ToolCallOut] = field(default_factory=list)

    @property
    def mode(self) -> str:
        return self.plan.mode if self.plan is not None else "none"

    def feed(self, delta: str, final: bool) -> Delta:
        """Add this step's text; the delta of what can be shown now."""
        if self.mode == "none" and self.reasoning is None:
            self.sent_content += delta  # plain text: nothing to parse, nothing else to keep
            return Delta(content=delta or None)
        self.text += delta
        if self.mode == "named":
            return self._named(delta)
        reasoning, content = self.reasoning.split(self.text, final) if self.reasoning is not None else ("", self.text)
        parsed = self._calls(content, final)
        new_calls = [ToolCallOut(call_id(), FunctionCall(c.name, c.arguments)) for c in parsed.calls[len(self.calls):]]
        out = Delta(
            content=_grown(self.sent_content, parsed.content),
            reasoning_content=_grown(self.sent_reasoning, reasoning),
            tool_calls=[
                ToolCallDelta(len(self.calls) + k, c.id, "function", FunctionDelta(c.function.name, c.function.arguments))
                for k, c in enumerate(new_calls)
            ] or None,
        )
        self.sent_content, self.sent_reasoning = parsed.content, reasoning
        self.calls += new_calls
        return out

    def _calls(self, content: str, final: bool) -> ToolParse:
        if self.mode == "auto":
            parsed = self.tools.parse(content, final)
            return ToolParse(parsed.content, parsed.calls[:1]) if not self.plan.parallel else parsed
        if self.mode == "required":
            return _array_calls(content, final)
        return ToolParse(content)

    def _named(self, delta: str) -> Delta:
        if not self.calls:
            self.calls.append(ToolCallOut(call_id(), FunctionCall(self.plan.name, "")))
            head = self.calls[0]
            return Delta(tool_calls=[ToolCallDelta(0, head.id, "function", FunctionDelta(head.function.name, delta))])
        self.calls[0].function.arguments += delta
        return Delta(tool_calls=[ToolCallDelta(0, function=FunctionDelta(arguments=delta))]) if delta else Delta()

    def message(self) -> AssistantMessage:
        """The whole answer (after the final ``feed``)."""
        if self.mode == "named":
            self.calls[0].function.arguments = self.text
        msg = AssistantMessage(self.sent_content if self.sent_content or not self.calls else None)
        if self.calls:
            msg.tool_calls = self.calls
        if self.reasoning is not None and self.sent_reasoning:
            msg.reasoning_content = self.sent_reasoning
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``tool_calls`` when the model chose to call (``auto``, ``required``), as OpenAI says;
        a named function ends with ``stop``."""
        if engine_reason == "stop" and self.calls and self.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason


def _grown(sent: str, now: str) -> str | None:
    return now[len(sent):] or None


def _array_calls(text: str, final: bool) -> ToolParse:
    """``required``: the output is a JSON list of ``{"name", "parameters"}`` (the grammar sees
    to it); the calls complete so far. What is left when the output ended early is content."""
    start = text.lstrip()
    if not start.startswith("["):
        return ToolParse(text if final else "")
    pos, calls = len(text) - len(start) + 1, []
    while True:
        decoded = decode_prefix(text, pos)
        call = call_from(decoded[0], "parameters") if decoded is not None else None
        if call is None:
            break
        calls.append(call)
        rest = text[decoded[1]:].lstrip()
        pos = len(text) - len(rest) + (1 if rest.startswith(",") else 0)
    rest = text[pos:].strip()
    return ToolParse(rest if final and rest not in ("", "]") else "", calls)
