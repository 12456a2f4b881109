"""Engine logprob entries (``{token_id: Logprob}`` per token) in the two OpenAI shapes."""

from __future__ import annotations

from collections.abc import Callable

from modserve.core.outputs import Logprob, RequestOutput
from modserve.server.protocol import ChatLogprobs, CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob

Entry = dict[int, Logprob] | None


def completion_logprobs(
    entries: list[Entry], token_ids: list[int], token_text: Callable[[int], str], offset: int = 0
) -> CompletionLogprobs:
    """Legacy completions shape; an entry of ``None`` (a prompt's first token) gives nulls.

    ``text_offset`` counts characters from ``offset`` (where this piece of text starts)."""
    out = CompletionLogprobs([], [], [], [])
    for entry, tok in zip(entries, token_ids):
        chosen = entry.get(tok) if entry else None
        text = chosen.token if chosen is not None and chosen.token is not None else token_text(tok)
        out.tokens.append(text)
        out.token_logprobs.append(chosen.logprob if chosen is not None else None)
        out.top_logprobs.append(_top_by_text(entry, token_text) if entry else None)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(
    entries: list[dict[int, Logprob]], token_ids: list[int], top_n: int, token_text: Callable[[int], str]
) -> ChatLogprobs:
    """Chat shape: the chosen token plus the ``top_n`` most likely ones, with UTF-8 bytes."""
    content = []
    for entry, tok in zip(entries, token_ids):
        top = [
            TopLogprob(text, lp.logprob, list(text.encode()))
            for lp in sorted(entry.values(), key=lambda lp: -lp.logprob)[:top_n]
            for text in [_text(lp, token_text)]
        ]
        text = _text(entry[tok], token_text)
        content.append(TokenLogprob(text, entry[tok].logprob, list(text.encode()), top))
    return ChatLogprobs(content)


def prompt_logprob_rows(out: RequestOutput, n: int) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first ``None``), the token's own
    logprob and the ``n`` most likely, keyed by token id."""
    rows: list[dict[str, PromptLogprob] | None] = []
    for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs or []):
        if entry is None:
            rows.append(None)
            continue
        keep = sorted(entry.values(), key=lambda lp: -lp.logprob)[:n]
        if token_id in entry and entry[token_id] not in keep:
            keep.append(entry[token_id])
        rows.append({str(lp.token_id): PromptLogprob(lp.logprob, lp.token) for lp in keep})
    return rows


def _top_by_text(entry: dict[int, Logprob], token_text: Callable[[int], str]) -> dict[str, float]:
    """Keyed by token text, as the legacy format is; when two tokens share a text the likelier wins."""
    top: dict[str, float] = {}
    for lp in sorted(entry.values(), key=lambda lp: -lp.logprob):
        top.setdefault(_text(lp, token_text), lp.logprob)
    return top


def _text(lp: Logprob, token_text: Callable[[int], str]) -> str:
    return lp.token if lp.token is not None else token_text(lp.token_id)
