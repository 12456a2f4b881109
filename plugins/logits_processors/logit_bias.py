"""Logits processor ``logit_bias``: OpenAI's ``logit_bias`` (token id -> bias added to its logit).

-100 effectively bans a token and +100 forces it, as in OpenAI's API. One batched
``index_put_`` per step over every biased (row, token) pair.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import torch

from modserve.core.contract import BuildContext, LogitsProcessor, LogitsRow, hookimpl
from modserve.core.sampling_params import SamplingParams

MODSERVE_CONTRACT = "2.0"


class LogitBiasConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_entries: Annotated[int, msgspec.Meta(ge=1)] = 300  # most biased tokens per request (OpenAI allows 300)
    max_abs_bias: Annotated[float, msgspec.Meta(gt=0)] = 100.0  # biases outside [-this, this] are refused


class LogitBias(LogitsProcessor):
    Config = LogitBiasConfig
    request_field = "logit_bias"

    def __init__(self, config: LogitBiasConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.vocab_size = ctx.model.vocab_size

    def check(self, params: SamplingParams) -> None:
        bias = params.logit_bias or {}
        if len(bias) > self.config.max_entries:
            raise ValueError(f"logit_bias: at most {self.config.max_entries} entries, got {len(bias)}")
        for token, value in bias.items():
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"logit_bias: token id {token} is outside the vocabulary [0, {self.vocab_size})")
            if not -self.config.max_abs_bias <= value <= self.config.max_abs_bias:
                raise ValueError(f"logit_bias: bias {value} for token {token} is outside [-{self.config.max_abs_bias:g}, {self.config.max_abs_bias:g}]")

    def apply(self, logits: torch.Tensor, rows: list[LogitsRow], which: list[int]) -> None:
        row_ids, token_ids, values = [], [], []
        for i, row in zip(which, rows):
            bias = row.request.sampling_params.logit_bias
            row_ids += [i] * len(bias)
            token_ids += bias.keys()
            values += bias.values()
        device = logits.device
        index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


@hookimpl
def register_logits_processors():
    return {"logit_bias": LogitBias}
