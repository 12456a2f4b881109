"""Quantized linear weights kept as the file stores them until the platform builds each layer.

Why: dequantizing a quantized model at load holds every weight in float32 at once (SmolLM2:
540 MB for a 75 MB Q4_1 GGUF file) before a quantizing platform shrinks it again. Here the
loader leaves every linear layer's weight on the meta device, records which kept tensors
(and which rows) the model's ``load_weights`` routes into it, and hands the platform one
:class:`KeptLinear` per layer:

- a platform that keeps the file's format (``device: {plugin: cpu, quantization: gguf}``,
  ``gptq``, ``awq``, ``compressed-tensors``) reads :attr:`KeptLinear.parts` and packs them
  into its own int4 / int8 modules without a float copy;
- any other platform reads ``layer.weight`` as it would on an ``nn.Linear``: the layer is
  dequantized then, alone, in the model dtype (float32 dequantization, then the cast), so
  peak memory is the built model plus one float layer whatever the platform does with it.

A kept tensor (:class:`KeptTensor`) is a GGUF tensor's blocks
(:class:`~modserve.core.models.gguf_quantized.GGUFTensor`), a pre-quantized HF layer's
codes (:class:`~modserve.core.models.prequantized.QuantizedWeight`), or a 2-D float tensor
of such a checkpoint (:class:`FloatWeight`: its head, say), whose layer the platform keeps
as a float layer.

How the rows are found without knowing the model's fused layouts (q/k/v in one ``qkv_proj``,
gate/up in one ``gate_up_proj``): each kept tensor is passed to ``load_weights`` as a
meta-device stand-in (:class:`_Slot`) of the right shape; the ``copy_`` that the model does
into its parameter is intercepted, and its destination, a view of a meta linear weight, says
which layer (by storage) and which rows (by storage offset). Copies into materialized
parameters (the embedding) dequantize the tensor then and there; a linear layer whose weight
is such a parameter (a head tied to the embedding) still comes out as a :class:`KeptLinear` of
that tensor, its ``weight`` the shared parameter, so that a platform keeping the format can
build the head from the file's blocks (``quantize_lm_head``) and any other sees the tie as before.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn


class KeptTensor(ABC):
    """One weight as a file stores it, one row per output channel."""

    shape: tuple[int, int]  # (rows, columns) of the dequantized weight

    @property
    @abstractmethod
    def kind(self) -> str:
        """What it is, for messages and ``repr``: ``Q4_1``, ``gptq-int4-g128``, ..."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """Float32 ``[rows, columns]``, an owned tensor."""


class FloatWeight(KeptTensor):
    """A linear weight the file stores as floats, beside kept ones (a pre-quantized
    checkpoint's head or ignored layers): kept too, so that the model's loading finds its rows."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.shape = tensor, tuple(tensor.shape)

    @property
    def kind(self) -> str:
        return str(self.tensor.dtype).removeprefix("torch.")

    def dequantize(self) -> torch.Tensor:
        return self.tensor.float()


class KeptLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is still kept tensors: ``parts`` fill its rows in order
    (one, or q/k/v and gate/up for the model's fused layers). ``weight`` is dequantized on
    first access, into ``dtype`` on ``device``; a platform keeping the format never touches
    it. ``dtype`` and ``device`` are the model's."""

    def __init__(self, layer: nn.Linear, parts: list[KeptTensor], device: torch.device, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.parts, self.device, self.dtype = parts, device, dtype
        self.bias = layer.bias
        self.tied = not layer.weight.is_meta  # its weight is another module's parameter, loaded (a tied head)
        if self.tied:
            self._parameters["weight"] = layer.weight

    @property
    def types(self) -> tuple[str, ...]:
        """The kind of each part, e.g. ``('Q4_1', 'Q4_1', 'Q4_1')``."""
        return tuple(p.kind for p in self.parts)

    @property
    def dequantized(self) -> bool:
        """Whether :attr:`weight` was read (the platform did not keep the format); a tied layer's
        weight is the parameter it shares, never a copy."""
        return not self.tied and self._parameters.get("weight") is not None

    @property
    def weight(self) -> nn.Parameter:  # type: ignore[override]
        w = self._parameters.get("weight")
        if w is None:
            rows = [p.dequantize() for p in self.parts]
            w = nn.Parameter((rows[0] if len(rows) == 1 else torch.cat(rows)).to(self.device, self.dtype), requires_grad=False)
            self._parameters["weight"] = w
        return w

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, kept={'+'.join(self.types)}"


class _Slot(torch.Tensor):
    """A meta-device stand-in of a :class:`KeptTensor` for ``load_weights`` (module doc)."""

    part: KeptTensor
    loader: _KeptLoad

    @staticmethod
    def __new__(cls, part: KeptTensor, loader: _KeptLoad):
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
    """One model's load: which meta linear weight each kept tensor went to, and at which row."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.layers: dict[int, tuple[str, nn.Linear]] = {}  # meta storage -> (qualified name, layer)
        self.parts: dict[str, list[tuple[int, KeptTensor]]] = {}
        self.filled: dict[int, KeptTensor] = {}  # a materialized parameter's storage -> the one file tensor that filled it
        for name, module in model.named_modules():
            if type(module) is nn.Linear:  # the weight stays meta; the bias is loaded as usual
                if module.bias is not None:
                    module.bias = nn.Parameter(torch.empty_like(module.bias, device="cpu"), requires_grad=False)
                self.layers[module.weight.untyped_storage()._cdata] = (name, module)
            else:
                module.to_empty(device="cpu", recurse=False)

    def copy(self, dest: torch.Tensor, part: KeptTensor) -> torch.Tensor:
        if not dest.is_meta:  # a materialized parameter (the embedding): dequantize it now
            if tuple(dest.shape) == part.shape and dest.storage_offset() == 0 and not isinstance(part, FloatWeight):
                self.filled[dest.untyped_storage()._cdata] = part
            return dest.copy_(part.dequantize().to(self.dtype))
        name, layer = self.layers[dest.untyped_storage()._cdata]
        self.parts.setdefault(name, []).append((dest.storage_offset() // layer.in_features, part))
        return dest

    def kept(self) -> dict[str, list[KeptTensor]]:
        """The parts of every linear layer still on the meta device, in row order; each must
        fill its layer's rows exactly."""
        out = {}
        for name, layer in self.layers.values():
            if not layer.weight.is_meta:  # a head tied to the embedding after loading: kept as the embedding's tensor, if one filled it
                part = self.filled.get(layer.weight.untyped_storage()._cdata)
                if part is not None and part.shape == tuple(layer.weight.shape):
                    out[name] = [part]
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


def load_keeping_weights(
    model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor | KeptTensor]], dtype: torch.dtype
) -> dict[str, list[KeptTensor]]:
    """Materialize ``model`` (built on the meta device) but its linear weights, load ``tensors``
    through its ``load_weights``, and return ``{qualified linear name: its kept parts}``."""
    load = _KeptLoad(model, dtype)

    def slot(t: torch.Tensor | KeptTensor) -> torch.Tensor:
        if isinstance(t, KeptTensor):
            return _Slot(t, load)
        return _Slot(FloatWeight(t), load) if t.dim() == 2 and t.is_floating_point() else t

    model.load_weights((name, slot(t)) for name, t in tensors)
    return load.kept()
