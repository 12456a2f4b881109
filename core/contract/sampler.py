"""Samplers: one token per sampled logits row, batched."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from modserve.core.contract.plugin import Plugin

if TYPE_CHECKING:
    import torch

    from modserve.core.sampling_batch import SamplingBatch

@dataclass
class SamplerOutput:
    """``token_ids [R]``; ``logprobs [R]`` of the chosen tokens; optional top-N per row."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None  # [R, N] float
    top_token_ids: torch.Tensor | None = None  # [R, N] long


class Sampler(Plugin):
    """Turns one logits row per sampled position into a token (batched tensor math).

    Built with ``ctx.model`` (``vocab_size``). Logits processors have already run on
    ``logits`` (biases, constraints) when either method is called.
    """

    @abstractmethod
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """``logits [R, V]`` float32, one row per sampled position; ``batch`` holds the rows'
        sampling settings as tensors (temperature, top-k/p, min-p, penalties, seeds).

        ``logits`` hold only for this step: the model reuses their storage in the next one,
        so a sampler that keeps logits across steps keeps a copy."""

    @abstractmethod
    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution ``sample`` draws from (after penalties, temperature, top-k/p, min-p)."""

