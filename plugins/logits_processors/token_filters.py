"""Logits processors ``bad_words`` and ``allowed_token_ids``: vLLM's token filters.

``bad_words``: each word is tokenized as written and with a leading space (how it appears
mid-text); its last token is banned whenever the tokens before it (this step's drafts
included) end with the word's other tokens, so a one-token word is always banned.
``allowed_token_ids``: every other token is banned. Both touch only the rows of the requests
that ask (a per-request bool mask, built once).
"""

from __future__ import annotations

import torch

from modserve.core.contract import BuildContext, LogitsProcessor, LogitsRow, NoOptions, hookimpl
from modserve.core.request import Request
from modserve.core.sampling_params import SamplingParams

MODSERVE_CONTRACT = "2.0"


class BadWords(LogitsProcessor):
    Config = NoOptions
    request_field = "bad_words"

    def __init__(self, config: NoOptions, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.tokenizer = ctx.tokenizer.tokenizer
        self._sequences: dict[str, list[tuple[tuple[int, ...], int]]] = {}  # request -> (prefix, banned last token)

    def check(self, params: SamplingParams) -> None:
        if len(params.bad_words) > 512:
            raise ValueError(f"bad_words: at most 512 words, got {len(params.bad_words)}")

    def _words(self, request: Request) -> list[tuple[tuple[int, ...], int]]:
        found = self._sequences.get(request.request_id)
        if found is None:
            found = set()
            for word in request.sampling_params.bad_words:
                for text in (word, " " + word.lstrip()):
                    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
                    if ids:
                        found.add((tuple(ids[:-1]), ids[-1]))
            found = self._sequences[request.request_id] = sorted(found)
        return found

    def apply(self, logits: torch.Tensor, rows: list[LogitsRow], which: list[int]) -> None:
        banned_rows, banned_tokens = [], []
        for i, row in zip(which, rows):
            history = row.request.output_token_ids + list(row.drafts_before)
            for prefix, last in self._words(row.request):
                if not prefix or tuple(history[-len(prefix):]) == prefix:
                    banned_rows.append(i)
                    banned_tokens.append(last)
        if banned_rows:
            device = logits.device
            logits[torch.tensor(banned_rows, device=device), torch.tensor(banned_tokens, device=device)] = float("-inf")

    def release(self, request: Request) -> None:
        self._sequences.pop(request.request_id, None)


class AllowedTokenIds(LogitsProcessor):
    Config = NoOptions
    request_field = "allowed_token_ids"

    def __init__(self, config: NoOptions, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.vocab_size = ctx.model.vocab_size
        self._masks: dict[str, torch.Tensor] = {}  # request -> bool [vocab], True where banned

    def check(self, params: SamplingParams) -> None:
        ids = params.allowed_token_ids
        if not ids:
            raise ValueError("allowed_token_ids: must list at least one token id")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"allowed_token_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def apply(self, logits: torch.Tensor, rows: list[LogitsRow], which: list[int]) -> None:
        for i, row in zip(which, rows):
            rid = row.request.request_id
            if rid not in self._masks:
                banned = torch.ones(self.vocab_size, dtype=torch.bool, device=logits.device)
                banned[row.request.sampling_params.allowed_token_ids] = False
                self._masks[rid] = banned
            logits[i].masked_fill_(self._masks[rid], float("-inf"))

    def release(self, request: Request) -> None:
        self._masks.pop(request.request_id, None)


@hookimpl
def register_logits_processors():
    return {"bad_words": BadWords, "allowed_token_ids": AllowedTokenIds}
