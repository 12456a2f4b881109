"""Platform ``cuda``: NVIDIA GPUs through torch (cuBLAS linears, NCCL collectives, Triton attention)."""

from __future__ import annotations

import torch

from modserve.core.config import ConfigError
from modserve.core.contract import DeviceInfo, NoOptions, Platform, hookimpl

MODSERVE_CONTRACT = "2.0"


class CUDAPlatform(Platform):
    Config = NoOptions

    def __init__(self, config: NoOptions, ctx) -> None:
        super().__init__(config, ctx)
        if not self.is_available():
            raise ConfigError("device: 'cuda' requested but torch sees no CUDA device; use 'cpu' or 'auto'")

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def device(self, rank: int = 0) -> torch.device:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        return device

    def info(self) -> DeviceInfo:
        props = torch.cuda.get_device_properties(0)
        dtypes = ("float32", "bfloat16", "float16") if torch.cuda.is_bf16_supported() else ("float32", "float16")
        return DeviceInfo(props.name, props.total_memory, dtypes)

    def default_dtype(self) -> str:
        return "bfloat16"

    def default_attention(self, dtype: str) -> str:
        return "triton"

    def collective_backend(self) -> str:
        return "nccl"


@hookimpl
def register_platforms():
    return {"cuda": CUDAPlatform}
