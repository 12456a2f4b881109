"""Speculative proposer ``ngram`` (prompt lookup): copy what followed the last n-gram before.

Find the most recent earlier occurrence of the context's last ``n`` tokens (``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose the tokens that followed
it. No extra model: it pays off on inputs the output copies from (code edits, quotes).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np

from modserve.core.contract import Proposer, SpeculativeConfig, hookimpl
from modserve.core.request import Request

MODSERVE_CONTRACT = "2.0"


class NgramConfig(SpeculativeConfig, kw_only=True):
    prompt_lookup_min: Annotated[int, msgspec.Meta(ge=1)] = 1  # shortest suffix n-gram to look up
    prompt_lookup_max: Annotated[int, msgspec.Meta(ge=1)] = 3  # longest suffix n-gram to look up

    def __post_init__(self) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min: must be <= prompt_lookup_max ({self.prompt_lookup_max}), got {self.prompt_lookup_min}"
            )


class NgramProposer(Proposer):
    Config = NgramConfig

    def propose(self, requests: list[Request], k: int) -> list[list[int]]:
        return [lookup(r.all_token_ids, self.config.prompt_lookup_min, self.config.prompt_lookup_max, k) for r in requests]


def lookup(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Tokens after the most recent earlier match of the longest suffix n-gram (n_max..n_min)."""
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, len(arr) - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # starts that end before the suffix
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


@hookimpl
def register_speculative_decoders():
    return {"ngram": NgramProposer}
