"""Reasoning parser ``think``: thinking inside ``<think>...</think>`` before the answer.

Qwen3, QwQ and DeepSeek-R1 style. ``starts_in_reasoning: true`` is for chat templates that
open the ``<think>`` block in the prompt, so the output starts inside it. An output cut off
before ``</think>`` is all reasoning; one that does not start with ``<think>`` (and does not
start inside it) is all answer.
"""

from __future__ import annotations

import msgspec

from modserve.core.contract import ReasoningParser, hookimpl
from modserve.core.contract.parsing import partial_suffix

MODSERVE_CONTRACT = "2.1"


class ThinkConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    start: str = "<think>"
    end: str = "</think>"
    starts_in_reasoning: bool = False  # the chat template already wrote `start` at the end of the prompt


class ThinkReasoningParser(ReasoningParser):
    Config = ThinkConfig

    def split(self, text: str, final: bool) -> tuple[str, str]:
        start, end = self.config.start, self.config.end
        body = text.lstrip()
        if body.startswith(start):
            body = body[len(start) :]
        elif not final and start.startswith(body):
            return "", ""  # may still open with the start marker
        elif not self.config.starts_in_reasoning:
            return "", text
        close = body.find(end)
        if close < 0:
            return (body if final else body[: len(body) - partial_suffix(body, end)]).strip(), ""
        return body[:close].strip(), body[close + len(end) :].lstrip()


@hookimpl
def register_reasoning_parsers():
    return {"think": ThinkReasoningParser}
