"""Attention backends: write this step's K/V into the paged cache and attend over it."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from modserve.core.contract.plugin import Plugin

if TYPE_CHECKING:
    import torch

    from modserve.core.contract.build_context import BuildContext
    from modserve.core.contract.kv import LayerKVCache


@dataclass
class AttentionSpec:
    """The model's attention shape and numeric settings, given to the backend at build time."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: torch.dtype
    device: torch.device
    block_size: int  # the KV backend's
    sliding_window: int | None = None  # the model's window, for information: layers get theirs from ``for_layer``


@dataclass
class AttentionMetadata:
    """One step's flat varlen batch, built once by the runner and shared by every layer.

    Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; those are
    its tokens at positions ``context_lens[i] .. seq_lens[i]-1``; its KV for positions
    ``0 .. seq_lens[i]-1`` lives in blocks ``block_tables[i]`` once this step's K/V are
    written through ``slot_mapping``. ``*_cpu`` fields are Python lists for host-side logic.
    """

    num_tokens: int
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    context_lens: torch.Tensor  # [B] int32
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    backend_state: object = None
    # [B] int32 (contract 2.4), each request's length: prompt and generated tokens, drafts
    # not counted, this step's included. LongRoPE picks its factors by it. None: not known.
    request_lens: torch.Tensor | None = None


class AttentionBackend(Plugin):
    """Writes a layer's new K/V into the paged cache and computes causal attention.

    ``forward`` gets ``q [T, num_heads, head_dim]``, ``k``/``v [T, num_kv_heads, head_dim]``
    (already rotated), the layer's :class:`LayerKVCache` and the step's
    :class:`AttentionMetadata`; it returns ``[T, num_heads, head_dim]``. Each query token
    attends to every earlier position of its own request (cached context included) and
    to itself. ``prepare`` is called once per step before the first layer.

    Built after the KV backend: ``self.spec`` (``ctx.attention_spec()``) carries its block
    size. Raise ``ValueError`` naming what this backend cannot run (dtype, device, head size,
    a sliding window). Subclasses call ``super().__init__(config, ctx)``.

    Per-layer settings (contract 2.2 addition): a model whose layers differ from the plain
    causal attention above asks for each such layer's backend with :meth:`for_layer`
    (a sliding window, logit soft-capping). The default refuses anything but the plain
    settings, so a backend written before the hook keeps serving every other model.
    """

    # Contract 2.5: once ``prepare`` has run, ``forward`` over a decode-only batch (one query
    # token per request) reads the step only from the metadata's tensors, never from its
    # ``*_cpu`` lists or ``max_*`` ints, and never waits on the device, and it skips rows
    # whose slot is -1 (writes no K/V for them). Then a graph captured over it (with
    # ``prepare`` run once, on ``max_model_len`` long rows) replays any such batch correctly.
    capturable: ClassVar[bool] = False

    def __init__(self, config: Any, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.spec = ctx.attention_spec()

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Precompute per-step state (masks, index tensors) into ``meta.backend_state``."""

    def for_layer(self, sliding_window: int | None = None, logit_softcap: float | None = None) -> AttentionBackend:
        """The backend for one layer with its own settings; called once per layer at model build.

        ``sliding_window``: a query at position ``p`` attends only to positions ``> p - window``
        (HF's ``kv_idx > q_idx - sliding_window``). ``logit_softcap``: scaled scores ``s``
        become ``cap * tanh(s / cap)`` before the mask and softmax (Gemma 2). The result
        shares this backend's per-step state (``prepare`` is still called once, on this
        object) and its ``forward`` has the same contract. Both None: this backend itself.
        Default: refuse anything else with a ``ValueError`` naming the backend and the feature.
        """
        wanted = [name for name, value in (("a sliding window", sliding_window), ("logit soft-capping", logit_softcap))
                  if value is not None]
        if wanted:
            cls = type(self)
            raise ValueError(
                f"attention backend {cls.__name__} ({cls.__module__}) does not support {' and '.join(wanted)} "
                f"(sliding_window={sliding_window}, logit_softcap={logit_softcap}), which this model needs; "
                "it has no for_layer(); use `attention: {plugin: torch}` or `cpu` / `triton`"
            )
        return self

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...

