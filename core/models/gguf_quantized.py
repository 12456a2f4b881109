"""GGUF weights kept in their own blocks until the platform builds each linear layer.

Why: dequantizing a whole GGUF model at load (what :func:`read_gguf` does without
``keep_blocks``) holds every weight in float32 at once (SmolLM2: 540 MB for a 75 MB Q4_1
file) before a quantizing platform shrinks it again. Here the loader leaves every linear
layer's weight on the meta device, records which GGUF tensors (and which rows) the model's
``load_weights`` routes into it, and hands the platform one :class:`GGUFLinear` per layer:

- a platform that keeps GGUF blocks (``device: {plugin: cpu, quantization: gguf}``) reads
  :attr:`GGUFLinear.parts` and packs the blocks into its own int4 / int8 modules without a
  float copy;
- any other platform reads ``layer.weight`` as it would on an ``nn.Linear``: the layer is
  dequantized then, alone, in the model dtype (the same values as the dequantize-at-load
  path: float32 dequantization, then the cast), so peak memory is the built model plus one
  float layer whatever the platform does with it.

How the rows are found without knowing the model's fused layouts (q/k/v in one ``qkv_proj``,
gate/up in one ``gate_up_proj``): each 2-D GGUF tensor is passed to ``load_weights`` as a
meta-device stand-in (:class:`_Slot`) of the right shape; the ``copy_`` that the model does
into its parameter is intercepted, and its destination, a view of a meta linear weight, says
which layer (by storage) and which rows (by storage offset). Copies into materialized
parameters (the embedding, a tied head) dequantize the tensor then and there.

Block formats (ggml, 32 weights per block, ``d`` and ``m`` float16):
``Q8_0``: ``d``, 32 int8 ``q``: ``w = d * q``. ``Q4_0``: ``d``, 16 bytes of nibbles:
``w = d * (q - 8)``. ``Q4_1``: ``d``, ``m``, 16 bytes: ``w = d * q + m``. In the nibble
bytes, byte ``j`` holds weight ``j`` in its low half and weight ``j + 16`` in its high half.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

Q8_0, Q4_0, Q4_1 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1
BLOCK = 32  # weights per Q8_0 / Q4_0 / Q4_1 block


@dataclass
class GGUFTensor:
    """One GGUF tensor as stored: ``data`` is the file's array, one row per output channel
    (``uint8`` block bytes for quantized types, the values for F32/F16), rows already in HF order."""

    data: np.ndarray
    type: GGMLQuantizationType
    shape: tuple[int, int]  # (rows, columns) of the dequantized weight

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[rows, columns]``, an owned array (not a view of the file's mmap)."""
        return torch.from_numpy(np.require(dequantize(self.data, self.type), np.float32, ["C", "W"])).view(self.shape)


def q8_0_blocks(data: np.ndarray, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [N, K] int8, d [N, K/32] float32)`` of a Q8_0 tensor: ``w[n, k] = d[n, k // 32] * q[n, k]``."""
    n, k = shape
    blocks = np.ascontiguousarray(data).reshape(n, k // BLOCK, 2 + BLOCK)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return torch.from_numpy(q), torch.from_numpy(d)


def q4_blocks(data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [N, K] int32 in [0, 15], d [N, K/32] float32, m [N, K/32] float32)`` of a Q4_0 or
    Q4_1 tensor: ``w = d * q + m``, with ``m = -8 d`` for Q4_0 (its ``w = d * (q - 8)``)."""
    n, k = shape
    head = 4 if kind == Q4_1 else 2
    blocks = np.ascontiguousarray(data).reshape(n, k // BLOCK, head + BLOCK // 2)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == Q4_1 else -8.0 * d
    nibbles = torch.from_numpy(blocks[..., head:].copy())  # [N, K/32, 16]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # weights 0-15 then 16-31 of each block
    return q.to(torch.int32).reshape(n, k), torch.from_numpy(d), torch.from_numpy(m)


class GGUFLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is still GGUF blocks: ``parts`` are the tensors filling its
    rows in order (one, or q/k/v and gate/up for the model's fused layers). ``weight`` is
    dequantized on first access, into ``dtype`` on ``device``; a platform keeping the blocks
    never touches it. ``dtype`` and ``device`` are the model's."""

    def __init__(self, layer: nn.Linear, parts: list[GGUFTensor], device: torch.device, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.parts, self.device, self.dtype = parts, device, dtype
        self.bias = layer.bias

    @property
    def types(self) -> tuple[str, ...]:
        """The GGUF type of each part, e.g. ``('Q4_1', 'Q4_1', 'Q4_1')``."""
        return tuple(p.type.name for p in self.parts)

    @property
    def weight(self) -> nn.Parameter:  # type: ignore[override]
        w = self._parameters.get("weight")
        if w is None:
            rows = [p.dequantize() for p in self.parts]
            w = nn.Parameter((rows[0] if len(rows) == 1 else torch.cat(rows)).to(self.device, self.dtype), requires_grad=False)
            self._parameters["weight"] = w
        return w

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, gguf={'+'.join(self.types)}"


class _Slot(torch.Tensor):
    """A meta-device stand-in of a :class:`GGUFTensor` for ``load_weights`` (module doc)."""

    part: GGUFTensor
    loader: _KeptLoad

    @staticmethod
    def __new__(cls, part: GGUFTensor, loader: _KeptLoad):
        slot = torch.Tensor._make_subclass(cls, torch.empty(part.shape, device="meta"))
        slot.part, slot.loader = part, loader
        return slot

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and isinstance(args[1], _Slot):
            return args[1].loader.copy(args[0], args[1].part)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class _KeptLoad:
    """One model's load: which meta linear weight each GGUF tensor went to, and at which row."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.layers: dict[int, tuple[str, nn.Linear]] = {}  # meta storage -> (qualified name, layer)
        self.parts: dict[str, list[tuple[int, GGUFTensor]]] = {}
        for name, module in model.named_modules():
            if type(module) is nn.Linear:  # the weight stays meta; the bias is loaded as usual
                if module.bias is not None:
                    module.bias = nn.Parameter(torch.empty_like(module.bias, device="cpu"), requires_grad=False)
                self.layers[module.weight.untyped_storage()._cdata] = (name, module)
            else:
                module.to_empty(device="cpu", recurse=False)

    def copy(self, dest: torch.Tensor, part: GGUFTensor) -> torch.Tensor:
        if not dest.is_meta:  # a materialized parameter (the embedding): dequantize it now
            return dest.copy_(part.dequantize().to(self.dtype))
        name, layer = self.layers[dest.untyped_storage()._cdata]
        self.parts.setdefault(name, []).append((dest.storage_offset() // layer.in_features, part))
        return dest

    def kept(self) -> dict[str, list[GGUFTensor]]:
        """The parts of every linear layer still on the meta device, in row order; each must
        fill its layer's rows exactly."""
        out = {}
        for name, layer in self.layers.values():
            if not layer.weight.is_meta:  # e.g. a head tied to the embedding after loading
                continue
            parts = sorted(self.parts.get(name, []), key=lambda p: p[0])
            row = 0
            for start, part in parts:
                if start != row or part.shape[1] != layer.in_features:
                    break
                row += part.shape[0]
            if row != layer.out_features:
                raise ValueError(f"weights missing from checkpoint: {name}.weight (rows {row} of {layer.out_features} filled)")
            out[name] = [part for _, part in parts]
        return out


def load_keeping_blocks(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor | GGUFTensor]], dtype: torch.dtype) -> dict[str, list[GGUFTensor]]:
    """Materialize ``model`` (built on the meta device) but its linear weights, load ``tensors``
    through its ``load_weights``, and return ``{qualified linear name: its GGUF parts}``."""
    load = _KeptLoad(model, dtype)
    model.load_weights((name, _Slot(t, load) if isinstance(t, GGUFTensor) else t) for name, t in tensors)
    return load.kept()
