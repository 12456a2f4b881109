"""Options every speculative proposer shares, and what a proposer is given at build time.

Speculation pays only when drafts are accepted and the batch is small enough that
verifying extra tokens is nearly free. So the engine pauses it on its own: above
``disable_above_batch_size`` running requests, and for ``backoff_steps`` steps whenever
the recent acceptance rate falls below ``min_acceptance_rate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec


class SpeculativeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4  # drafts per request per step
    disable_above_batch_size: Annotated[int, msgspec.Meta(ge=1)] | None = None  # no drafts with more running requests
    min_acceptance_rate: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0  # pause when the moving acceptance falls below
    backoff_steps: Annotated[int, msgspec.Meta(ge=1)] = 16  # length of such a pause, in steps


@dataclass
class ProposerContext:
    """The target's facts a proposer may need (a draft model loads beside the target)."""

    spec: Any  # ModelSpec of the target
    model_source: Any  # ModelSource of the target
    target_model: Any  # the target LlamaForCausalLM (a layer-truncated draft shares its weights)
    tokenizer: Any
    dtype: Any
    device: Any
    max_model_len: int
    make_attention: Any  # ModelSpec -> AttentionBackend


class SpeculationGovernor:
    """Decides per step whether to ask the proposer for drafts."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.acceptance = 1.0  # exponential moving average of accepted / drafted
        self.paused_for = 0

    def should_propose(self, batch_size: int) -> bool:
        if self.paused_for > 0:
            self.paused_for -= 1
            return False
        limit = self.config.disable_above_batch_size
        return limit is None or batch_size <= limit

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            self.acceptance = 0.8 * self.acceptance + 0.2 * num_accepted / num_drafts
            if self.acceptance < self.config.min_acceptance_rate:
                self.paused_for = self.config.backoff_steps
                self.acceptance = self.config.min_acceptance_rate  # probe again after the pause
