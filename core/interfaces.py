"""The interfaces a plugin implements, one per plugin kind. Their docstrings are the spec.

Every implementation class also carries a nested ``Config`` (a ``msgspec.Struct``);
the pipeline YAML's options for that plugin are validated against it and the instance
is passed to ``__init__``. The engine builds one object per kind and calls it directly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import msgspec

if TYPE_CHECKING:
    import torch

    from modserve.core.request import Request


class NoOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Config for an implementation that takes no options."""


# ----------------------------------------------------------------------------- KV cache


@dataclass
class KVSpec:
    """What a KV backend must hold: shapes come from the model, capacity from the config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    max_model_len: int


@dataclass
class LayerKVCache:
    """One layer's paged KV storage, shared by the KV backend (owner) and attention (reader/writer).

    ``k`` and ``v`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``. Slot ``s`` is
    row ``s % block_size`` of block ``s // block_size``. When ``k_scale``/``v_scale`` are set
    the cache is quantized (int8) with one float32 scale per token and head
    (``[num_blocks, block_size, num_kv_heads]``): value = int8 * scale.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


@dataclass
class PrefixHit:
    """Blocks already holding a request's leading tokens, found by :meth:`KVBackend.lookup_prefix`."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


class KVBackend(ABC):
    """Owns the KV cache tensors and the block pool; maps requests to blocks.

    Invariant the tests check: when no request is in the engine, ``num_free_blocks ==
    num_blocks`` (every block back in the pool after a request ends, aborts or fails).
    """

    Config: ClassVar[type[msgspec.Struct]]
    block_size: int
    num_blocks: int

    @abstractmethod
    def lookup_prefix(self, request: Request) -> PrefixHit:
        """Return the cached blocks covering the request's leading full blocks.

        Never covers the request's last token (it must be recomputed to get logits).
        Has no side effects: the hit only takes effect when passed to :meth:`allocate`.
        """

    @abstractmethod
    def allocate(self, request: Request, num_new_tokens: int, prefix_hit: PrefixHit | None = None) -> bool:
        """Make room for ``request.num_computed_tokens + num_new_tokens`` tokens.

        ``prefix_hit`` is given on a request's first allocation; its blocks are taken
        (ref count +1) and the caller advances ``num_computed_tokens`` past them.
        Returns False and changes nothing when there are not enough free blocks.
        """

    @abstractmethod
    def free(self, request: Request) -> None:
        """Return all of the request's blocks to the pool (cached contents stay reusable)."""

    @abstractmethod
    def block_table(self, request: Request) -> list[int]:
        """The request's block ids in order."""

    @abstractmethod
    def cache_blocks(self, request: Request, num_verified_tokens: int) -> None:
        """Publish the request's full blocks among its first ``num_verified_tokens`` tokens
        to the prefix cache. Called after each step with verified tokens only."""

    @abstractmethod
    def layer_caches(self) -> list[LayerKVCache]:
        """Per-layer storage handed to the attention backend."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (including evictable cached blocks)."""

    def usage(self) -> float:
        """Fraction of blocks in use by requests, 0.0 to 1.0."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def reset_prefix_cache(self) -> None:
        """Forget cached block contents (optional)."""

    def swap_out(self, request: Request) -> bool:
        """Copy the request's KV to host memory and free its device blocks (preemption by
        swap). Returns False, changing nothing, when unsupported or the host pool is full."""
        return False

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Bring a swapped-out request back into fresh device blocks with room for
        ``num_new_tokens`` more. Returns False, changing nothing, without enough free blocks."""
        raise NotImplementedError

    def is_swapped(self, request: Request) -> bool:
        return False

    def fork(self, parent: Request, child: Request) -> bool:
        """Give ``child`` the parent's KV (``n > 1`` siblings after the prompt). Paged backends
        share the blocks by ref count and copy a shared block on its first write. Returns
        False (the default) when the child got nothing and must recompute its prompt."""
        return False

    def trim(self, request: Request, num_tokens: int) -> None:  # noqa: B027 - optional
        """Release blocks beyond the first ``num_tokens`` tokens (rejected draft slots)."""


class EvictionPolicy(ABC):
    """Orders a KV backend's idle blocks: which one is handed out (and its cached
    contents evicted) next. Idle blocks with no cached contents are always taken first.

    The pool calls ``add`` when a block becomes idle (``cached``: its contents are in the
    prefix cache), ``remove`` when a prefix hit takes an idle block back, ``hit`` when a
    cached block is reused by a prefix hit (idle or not), and ``pop`` to pick a block.
    """

    Config: ClassVar[type[msgspec.Struct]]

    @abstractmethod
    def add(self, block: int, cached: bool) -> None: ...

    @abstractmethod
    def remove(self, block: int) -> None: ...

    @abstractmethod
    def pop(self) -> int: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block: int) -> bool: ...

    def hit(self, block: int) -> None:  # noqa: B027 - optional: frequency-aware policies count hits
        """A prefix hit reused this block."""


# ----------------------------------------------------------------------------- attention


@dataclass
class AttentionSpec:
    """The model's attention shape and numeric settings, given to the backend at build time."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: torch.dtype
    device: torch.device
    block_size: int


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


class AttentionBackend(ABC):
    """Writes a layer's new K/V into the paged cache and computes causal attention.

    ``forward`` gets ``q [T, num_heads, head_dim]``, ``k``/``v [T, num_kv_heads, head_dim]``
    (already rotated), the layer's :class:`LayerKVCache` and the step's
    :class:`AttentionMetadata`; it returns ``[T, num_heads, head_dim]``. Each query token
    attends to every earlier position of its own request (cached context included) and
    to itself. ``prepare`` is called once per step before the first layer.
    """

    Config: ClassVar[type[msgspec.Struct]]

    def __init__(self, config: msgspec.Struct, spec: AttentionSpec) -> None:
        self.config = config
        self.spec = spec

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Precompute per-step state (masks, index tensors) into ``meta.backend_state``."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


# ----------------------------------------------------------------------------- scheduler


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens of this request computed in this step (prompt chunk, decode, drafts)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass
class SchedulerLimits:
    """Engine-wide facts the scheduler must respect."""

    max_model_len: int


class Scheduler(ABC):
    """Decides, each step, which requests run and how many tokens each computes.

    The rule (vLLM v1): a request's ``num_computed_tokens`` chases its ``num_tokens``
    (prompt + output + draft tokens). ``schedule`` hands each chosen request a token count
    under the token budget, allocating KV through the backend and preempting when blocks
    run out; it never schedules a request whose blocks it could not allocate.
    """

    Config: ClassVar[type[msgspec.Struct]]

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def schedule(self) -> SchedulerOutput: ...

    def adopt(self, request: Request) -> None:
        """Take in a forked sibling: running if its KV is in place, else waiting to recompute.
        The default queues it like a new request (it resumes from its computed tokens)."""
        self.add_request(request)

    @abstractmethod
    def finish_requests(self, requests: list[Request]) -> None:
        """Remove finished or aborted requests (running or waiting) and free their blocks."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @property
    @abstractmethod
    def num_running(self) -> int: ...

    @property
    @abstractmethod
    def num_waiting(self) -> int: ...


# ----------------------------------------------------------------------------- sampler


@dataclass
class SamplerOutput:
    """``token_ids [R]``; ``logprobs [R]`` of the chosen tokens; optional top-N per row."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None  # [R, N] float
    top_token_ids: torch.Tensor | None = None  # [R, N] long


class Sampler(ABC):
    """Turns one logits row per sampled position into a token (batched tensor math)."""

    Config: ClassVar[type[msgspec.Struct]]

    @abstractmethod
    def sample(self, logits: torch.Tensor, batch: object) -> SamplerOutput:
        """``logits [R, V]`` float32; ``batch`` is a :class:`modserve.core.sampling_batch.SamplingBatch`.

        ``logits`` hold only for this step: the model reuses their storage in the next one,
        so a sampler that keeps logits across steps keeps a copy."""

    @abstractmethod
    def probs(self, logits: torch.Tensor, batch: object) -> torch.Tensor:
        """The distribution ``sample`` draws from (after penalties, temperature, top-k/p, min-p)."""


# ----------------------------------------------------------------------------- speculation


class Proposer(ABC):
    """Proposes draft tokens for running requests; the target model verifies them.

    Drafts are treated as deterministic proposals: verification accepts draft ``d`` with
    probability ``p_target(d)``, which keeps the output distribution exactly the
    target's whatever the proposer does. ``config`` subclasses
    :class:`modserve.core.speculative_base.SpeculativeConfig`.
    """

    Config: ClassVar[type[msgspec.Struct]]

    @abstractmethod
    def propose(self, requests: list[Request], k: int) -> list[list[int]]:
        """Up to ``k`` draft tokens per request (an empty list means none)."""

    def release(self, request: Request) -> None:  # noqa: B027 - optional
        """The request left the engine: drop any state kept for it."""
