"""Reasoning parsers: split a reasoning model's thinking from its answer.

Models such as Qwen3 or DeepSeek-R1 think in ``<think>...</think>`` before answering.
The pipeline picks a parser (``reasoning_parser:``); the chat API then returns the
thinking as ``reasoning_content`` and only the answer as ``content`` (and tool calls
are looked for in the answer only).

Like tool parsers, :meth:`ReasoningParser.split` is called on the whole output so far as
it grows, and each result must extend the previous one.
"""

from __future__ import annotations

from abc import abstractmethod

from modserve.core.contract.plugin import Plugin


class ReasoningParser(Plugin):
    """Built once per engine (``ctx.tokenizer`` is set); stateless across requests."""

    @abstractmethod
    def split(self, text: str, final: bool) -> tuple[str, str]:
        """``(reasoning, content)`` of the output so far. ``final=False``: hold back text that
        may be a partial marker."""
