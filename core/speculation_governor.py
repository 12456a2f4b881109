"""Whether to ask the speculative proposer for drafts this step.

Speculation pays only when drafts are accepted and the batch is small enough that
verifying extra tokens is nearly free. So the engine pauses it on its own: above
``disable_above_batch_size`` running requests, and for ``backoff_steps`` steps whenever
the recent acceptance rate falls below ``min_acceptance_rate``.
"""

from __future__ import annotations

from modserve.core.contract import SpeculativeConfig


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
