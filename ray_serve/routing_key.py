"""The prefix key of an HTTP request, computed at the ingress before any engine sees it.

The ingress holds no tokenizer (it needs no model files), so the units of a prefix are the
characters of the request's text as the chat template would meet them: tool definitions,
then each message's role and text, in order; a completion's prompt string (or its token ids
when it is given as tokens); a Responses request's instructions and input. Two requests that
share a leading run of that text render to prompts sharing a leading run of tokens, which is
what the engines' prefix cache keeps. A block of text is ``block_size * CHARS_PER_TOKEN``
characters, about one KV block of English BPE tokens.
"""

from __future__ import annotations

import json
from typing import Any

from modserve.server.prefix_affinity import prefix_key

CHARS_PER_TOKEN = 4  # typical for English text under BPE vocabularies of 32k-150k entries


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text is keyed
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _messages(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for m in messages:
        if isinstance(m, dict):
            parts.append(f"\x1e{m.get('role', '')}\x1f{_text(m.get('content'))}")
    return "".join(parts)


def _tools(tools: Any) -> str:
    return json.dumps(tools, sort_keys=True, separators=(",", ":")) if tools else ""


def prompt_units(path: str, body: bytes) -> tuple[str | list[int] | None, str | None]:
    """``(units, cache_salt)`` of a generation request; ``(None, None)`` for anything else
    (other routes, bodies that are not JSON objects: the engine replica answers those)."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return None, None
    if not isinstance(data, dict):
        return None, None
    salt = data.get("cache_salt") if isinstance(data.get("cache_salt"), str) else None
    if path.endswith("/chat/completions"):
        return _tools(data.get("tools")) + _messages(data.get("messages")), salt
    if path.endswith("/completions"):
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]  # a batch of prompts: keyed by its first
        if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return prompt, salt
        return None, salt
    if path.endswith("/responses"):
        given = data.get("input")
        text = given if isinstance(given, str) else _messages(
            [i for i in given if isinstance(i, dict) and "role" in i] if isinstance(given, list) else None
        )
        instructions = data.get("instructions") if isinstance(data.get("instructions"), str) else ""
        return _tools(data.get("tools")) + instructions + "\x1d" + text, salt
    return None, None


class RoutingKeys:
    """Prefix keys at the ingress: token ids in blocks of ``block_size``, text in blocks of
    ``block_size * CHARS_PER_TOKEN`` characters."""

    def __init__(self, block_size: int, max_blocks: int = 4) -> None:
        self.block_size, self.max_blocks = block_size, max_blocks

    def key(self, path: str, body: bytes) -> int | None:
        units, salt = prompt_units(path, body)
        if units is None:
            return None
        block = self.block_size * CHARS_PER_TOKEN if isinstance(units, str) else self.block_size
        return prefix_key(units, block, self.max_blocks, salt)
