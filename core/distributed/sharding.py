"""Which slice of each checkpoint tensor a tensor-parallel rank holds (Megatron-style).

Column-parallel (split the output rows): ``q/k/v_proj`` by attention head (weights and
biases), ``gate/up_proj`` by intermediate column. Row-parallel (split the input columns,
the partial outputs are all-reduced): ``o_proj``, ``down_proj``. Vocab-parallel:
``embed_tokens`` and ``lm_head`` by vocabulary row, each rank ``ceil(V / N)`` rows (the
last rank's tail is zero padding, never looked up and cut from the gathered logits).
Norms are replicated.

A rule works on anything sliceable with ``[a:b]`` / ``[:, a:b]``: a torch tensor, or a
``safetensors`` slice (``safe_open(...).get_slice(name)``), which reads only those bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modserve.core.config import ConfigError
from modserve.core.contract import ModelSpec


@dataclass
class TPShard:
    """This process's place in the tensor-parallel group: what the model's shapes depend on."""

    rank: int
    world_size: int

    def vocab_shard(self, vocab_size: int) -> int:
        return -(-vocab_size // self.world_size)


def check_divisible(spec: ModelSpec, n: int) -> None:
    """Refuse a model whose heads or MLP columns cannot be split evenly over ``n`` ranks."""
    for what, value in (
        ("num_attention_heads", spec.num_heads),
        ("num_key_value_heads", spec.num_kv_heads),
        ("intermediate_size", spec.intermediate_size),
    ):
        if value % n:
            raise ConfigError(
                f"parallel.tensor_parallel_size: the model's {what} {value} is not divisible by "
                f"tensor_parallel_size {n}; choose a size that divides it "
                f"(heads {spec.num_heads}, KV heads {spec.num_kv_heads})"
            )


_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW = {"o_proj": "q", "down_proj": "mlp"}


def plan(name: str, spec: ModelSpec, shard: TPShard) -> tuple[int, int, int, int] | None:
    """``(dim, start, stop, padded_len)`` of HF tensor ``name`` on this rank; None: replicated."""
    parts = name.removeprefix("model.").split(".")
    module, kind = parts[-2] if len(parts) > 1 else "", parts[-1]
    n, r = shard.world_size, shard.rank
    if module in ("embed_tokens", "lm_head"):
        size = shard.vocab_shard(spec.vocab_size)
        return 0, min(spec.vocab_size, r * size), min(spec.vocab_size, (r + 1) * size), size
    group = _COLUMN.get(module) or _ROW.get(module)
    if group is None:
        return None
    width = {
        "q": spec.num_heads * spec.head_dim,
        "kv": spec.num_kv_heads * spec.head_dim,
        "mlp": spec.intermediate_size,
    }[group] // n
    dim = 0 if module in _COLUMN else 1
    if dim == 1 and kind == "bias":
        return None  # a row-parallel bias is added once, after the all-reduce (none in these models)
    return dim, r * width, (r + 1) * width, width


def take(name: str, source, spec: ModelSpec, shard: TPShard) -> torch.Tensor:
    """This rank's part of tensor ``name`` read from ``source`` (a tensor or a safetensors slice)."""
    p = plan(name, spec, shard)
    if p is None:
        return source[:] if not isinstance(source, torch.Tensor) else source
    dim, start, stop, padded = p
    part = source[start:stop] if dim == 0 else source[:, start:stop]
    if part.shape[dim] != stop - start:
        raise ValueError(f"weight {name!r}: cannot take [{start}:{stop}] of dim {dim}: the tensor is {tuple(part.shape)}")
    if stop - start < padded:  # vocab tail of the last rank
        pad = list(part.shape)
        pad[dim] = padded - (stop - start)
        part = torch.cat([part, part.new_zeros(pad)], dim=dim)
    return part.contiguous()
