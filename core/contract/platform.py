"""Platforms: the hardware an engine runs on, as one small plugin.

A platform picks and describes the device, allocates KV tensors, provides the linear-layer
implementation, names the collective backend for tensor parallelism and its default
attention backend. ``device: auto`` in the pipeline picks the first registered platform
whose :meth:`Platform.is_available` is true (out-of-tree platforms first, then ``cuda``,
then ``cpu``). A vendor ships a whole platform out of tree with ``register_platforms``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modserve.core.contract.plugin import Plugin

if TYPE_CHECKING:
    import torch
    from torch import nn

    from modserve.core.contract.experts import ExpertMLP


@dataclass(frozen=True)
class DeviceInfo:
    """What ``modserve plugins`` and start-up logs say about the device."""

    name: str  # e.g. "Intel(R) Xeon(R) ... (avx512_bf16, amx_bf16)" or "NVIDIA H100 80GB HBM3"
    total_memory_bytes: int
    dtypes: tuple[str, ...]  # model dtypes this device runs: "float32", "bfloat16", "float16"
    kernels: tuple[str, ...] = ()  # what the platform chose for this machine, e.g. "bfloat16 linears: AMX tiles"


class GatedLinear(ABC):
    """A linear module (what :meth:`Platform.linear` returned) of a fused ``[gate; up]``
    projection that can return the SiLU-gated product ``silu(x @ W_gate.T) * (x @ W_up.T)``
    itself, in one pass, so the full ``[gate; up]`` output never goes to memory. A model whose
    MLP is SiLU-gated asks for it when it switches to fused CPU ops; the module rounds where
    the model's own SiLU-mul would (a bfloat16 model: the outputs, ``silu(gate)``, the product).
    """

    @abstractmethod
    def enable_silu_mul(self) -> bool:
        """From now on ``forward`` returns the gated product (``[..., out_features // 2]``);
        returns whether it does (False, and nothing changed, where this layer cannot)."""


class PieceRecorder(ABC):
    """Captures the consecutive pieces of one forward as graphs (contract 2.7); the work
    between :meth:`stop` and the next :meth:`start` runs eagerly, in order with the pieces.
    Used as a context manager around the whole capture (e.g. a side stream on CUDA)."""

    def __enter__(self) -> PieceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:  # noqa: B027 - optional
        pass

    @abstractmethod
    def start(self) -> None:
        """Begin capturing a piece: device work from here on is recorded, not run."""

    @abstractmethod
    def stop(self) -> Callable[[], None]:
        """End the piece; return its ``replay()``, which reruns the recorded work on whatever
        its tensors then hold. Pieces of one recorder share memory: replay them in capture order."""


class Platform(Plugin):
    """The hardware. Built first, with only ``ctx.registry`` and ``ctx.max_model_len`` set.

    Required: :meth:`is_available`, :meth:`device`, :meth:`info`. Everything else has a
    default that works for any device torch knows.
    """

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this platform can run here (``device: auto`` takes the first that can)."""

    @abstractmethod
    def device(self, rank: int = 0) -> torch.device:
        """The torch device of tensor-parallel rank ``rank`` (set it current if the device needs that)."""

    @abstractmethod
    def info(self) -> DeviceInfo: ...

    def default_dtype(self) -> str:
        """The model dtype for ``model.dtype: auto``."""
        return "float32"

    def default_attention(self, dtype: str) -> str:
        """The attention plugin for ``attention: {plugin: auto}``."""
        return "torch"

    def allocate_kv(self, shape: tuple[int, ...], dtype: torch.dtype, host: bool = False) -> torch.Tensor:
        """A zeroed KV tensor on this device (``host``: in host memory, for a swap pool)."""
        import torch

        return torch.zeros(shape, dtype=dtype, device="cpu" if host else self.device())

    def linear(self, name: str, layer: nn.Linear) -> nn.Module:
        """The module that computes ``layer`` (its qualified name in the model, e.g. ``lm_head``,
        ``layers.3.mlp.down_proj``) after its weights are loaded: ``y = x @ W.T + b``, same
        shapes. The default keeps ``nn.Linear``; a platform may repack or quantize."""
        return layer

    def experts(self, name: str, moe: ExpertMLP) -> ExpertMLP:
        """The module that computes the mixture-of-experts MLP ``moe`` (its qualified name, e.g.
        ``layers.3.mlp``) after its weights are loaded and before :meth:`linear` is asked for the
        linear layers, the returned module's included (contract 2.8): the same map, see
        :class:`~modserve.core.contract.experts.ExpertMLP`. The default keeps ``moe``."""
        return moe

    def prepare_model(self, model: nn.Module) -> None:
        """Adapt a loaded model for this device once, after :meth:`linear` (e.g. switch on fused
        kernels through the model's declared :meth:`~modserve.core.contract.model.CausalLM.use_cpu_fused_ops`)."""

    def collective_backend(self) -> str:
        """The ``torch.distributed`` backend for tensor parallelism (``parallel.backend: auto``)."""
        return "gloo"

    def graph_batch_sizes(self) -> tuple[int, ...]:
        """Decode batch sizes to replay from captured graphs (contract 2.5), ascending; () for
        none (the default). A decode-only step of ``b`` requests runs the graph of the smallest
        size ``>= b``, padded; larger steps run eagerly (:mod:`modserve.core.decode_graphs`)."""
        return ()

    def capture_graph(self, fn: Callable[..., Any], example_args: tuple) -> Callable[[], Any] | None:
        """Capture ``fn(*example_args)`` as a graph (CUDA graphs): returns ``replay()``, which
        reruns the captured work on whatever the example tensors then hold (the caller updates
        them in place) and returns ``fn``'s outputs, tensors overwritten by the next replay.
        None where the platform cannot capture. Called only where :meth:`graph_batch_sizes`
        names sizes; graphs of one engine may share a memory pool."""
        return None

    def piece_token_sizes(self) -> tuple[int, ...]:
        """Token counts (ascending) up to which a step that is not replayed whole (a prefill
        chunk, mixed prefill and decode, draft verification) replays its forward from graph
        pieces captured between attention calls, the attention running eagerly between them
        (contract 2.7; :mod:`modserve.core.piecewise_graphs`); () for none (the default)."""
        return ()

    def piece_recorder(self) -> PieceRecorder | None:
        """A recorder for one forward's graph pieces, or None where this platform cannot
        capture pieces. Called only where :meth:`piece_token_sizes` names sizes."""
        return None
