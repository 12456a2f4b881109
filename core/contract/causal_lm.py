"""The module a model plugin builds: what the runner calls on it, every step.

Kept apart from :mod:`modserve.core.contract.model` because it imports torch, which the
light commands (``modserve validate``, ``modserve plugins``) do not load.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from modserve.core.contract.attention import AttentionMetadata
    from modserve.core.contract.kv import LayerKVCache


class CausalLM(nn.Module):
    """What the runner calls on a model module; built on the meta device, then loaded."""

    # Contract 2.5: ``forward`` never waits on the device (no ``.item()``, ``.tolist()``, no
    # shapes from tensor values), so a graph captured over it replays correctly; see
    # :attr:`AttentionBackend.capturable`. Contract 2.7: and outside the calls of its attention
    # backend's ``forward`` it reads the step only from ``input_ids``, ``positions``,
    # ``meta.query_start_loc`` and ``meta.request_lens``, so graph pieces captured between
    # those calls replay any step (:mod:`modserve.core.piecewise_graphs`).
    capturable: ClassVar[bool] = False

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerKVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of one flat varlen batch (every layer through attention)."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits ``[R, vocab]`` (None on tensor-parallel ranks other than 0); they may
        live in a buffer reused by the next call."""

    @abstractmethod
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; unknown or missing names are errors."""

    @abstractmethod
    def to_device(self, device: torch.device, dtype: torch.dtype) -> CausalLM:
        """Move loaded weights and build device-side tables (RoPE)."""

    def use_cpu_fused_ops(self) -> bool:
        """Switch to fused CPU kernels for the elementwise work, if the model has them; returns
        whether it did (the CPU platform calls it)."""
        return False
