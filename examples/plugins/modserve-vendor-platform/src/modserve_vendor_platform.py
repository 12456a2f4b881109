"""Platform ``vendor_cpu``: what a hardware vendor ships to run modserve on its device.

It runs on the CPU so anyone can try it, but every part a vendor replaces is here:

- **linear layers**: decoder projections held as int8 with one scale per output channel
  (weight-only quantization), computed by torch's ``_weight_int8pack_mm``; the embedding
  and the LM head stay in the model dtype. Weights take about a quarter of float32's memory.
- **KV memory**: the platform's own arena with a capacity (``memory_gb``) it reports in
  ``info()`` and enforces: KV tensors beyond it are refused with a message naming the option.
- **default attention**: ``torch`` (a real vendor names its own kernel's backend).

Tolerance (stated, and tested in modserve's suite): teacher-forced over the float ``cpu``
platform's greedy text, the top next token agrees at >= 85% of positions and the actual
token's logprob moves by at most 0.25 nats (measured on a tiny random Llama: 92%, 0.11).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import torch
from torch import nn

from modserve.core.contract import BuildContext, DeviceInfo, Platform, hookimpl

MODSERVE_CONTRACT = "2.0"


class VendorConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    memory_gb: Annotated[float, msgspec.Meta(gt=0)] = 4.0  # the device memory KV tensors may take
    int8_weights: bool = True  # decoder linears as int8 weight-only (False: the model dtype)


class Int8WeightOnlyLinear(nn.Module):
    """``y = x @ (q * scale).T + b`` with ``q`` int8, one float scale per output row."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        w = layer.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.register_buffer("q", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), False)
        self.register_buffer("scale", scale.to(layer.weight.dtype), False)
        self.bias = layer.bias
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch._weight_int8pack_mm(rows, self.q, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


class VendorPlatform(Platform):
    Config = VendorConfig

    def __init__(self, config: VendorConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        self.capacity = int(config.memory_gb * 2**30)
        self.kv_bytes = 0  # what allocate_kv has handed out on the device

    @classmethod
    def is_available(cls) -> bool:
        return True  # a real vendor asks its driver here

    def device(self, rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def info(self) -> DeviceInfo:
        return DeviceInfo("vendor_cpu (int8 weight-only, on the host CPU)", self.capacity, ("float32", "bfloat16"))

    def allocate_kv(self, shape: tuple[int, ...], dtype: torch.dtype, host: bool = False) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if not host:
            if self.kv_bytes + nbytes > self.capacity:
                raise ValueError(
                    f"device.memory_gb: the KV cache needs more than the vendor device's "
                    f"{self.config.memory_gb:g} GB; lower kv_cache.memory_gb/num_blocks or raise device.memory_gb"
                )
            self.kv_bytes += nbytes
        return torch.zeros(shape, dtype=dtype)

    def linear(self, name: str, layer: nn.Linear) -> nn.Module:
        if not self.config.int8_weights or name == "lm_head":  # the head stays in the model dtype
            return layer
        return Int8WeightOnlyLinear(layer)


@hookimpl
def register_platforms():
    return {"vendor_cpu": VendorPlatform}
