"""Attention backend ``torch``: paged attention with ``scaled_dot_product_attention``, any device.

Per step, ``prepare`` splits the batch into decode rows (one query token) and prefill
chunks and builds their gather indices and masks once; every layer reuses them. Decode
rows run as one padded SDPA call; each prefill chunk runs its own causal SDPA over its
cached context plus its new tokens. K/V are always read back from the paged cache, so a
request sees the same (possibly int8-quantized) values whether its prefix was computed
in this step, an earlier chunk, or served from the prefix cache (a chunk with no cached
context uses its fresh K/V directly when the cache is not quantized: the same values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from modserve.core.contract import AttentionBackend, AttentionMetadata, LayerKVCache, NoOptions, hookimpl
from modserve.core.kv_quant import dequantize, quantize_per_token_head

MODSERVE_CONTRACT = "2.0"


@dataclass
class _Decode:
    rows: torch.Tensor  # [Bd] token row of each decode request
    block_ids: torch.Tensor  # [Bd, nb]
    mask: torch.Tensor  # [Bd, 1, 1, S] bool, True = attend


@dataclass
class PrefillChunk:
    """One request's rows ``[start, end)`` for one causal SDPA call (also used by ``cpu``)."""

    start: int
    end: int
    block_ids: torch.Tensor  # [nb]
    seq_len: int
    mask: torch.Tensor | None  # None: plain causal (no cached context)


@dataclass
class _StepState:
    decode: _Decode | None
    prefills: list[PrefillChunk]


class TorchAttention(AttentionBackend):
    Config = NoOptions

    def prepare(self, meta: AttentionMetadata) -> None:
        bs = self.spec.block_size
        decode_idx = [i for i, q in enumerate(meta.query_lens_cpu) if q == 1]
        decode = None
        if decode_idx:
            seq_len = max(meta.seq_lens_cpu[i] for i in decode_idx)
            nb = -(-seq_len // bs)
            idx = torch.tensor(decode_idx, device=meta.block_tables.device)
            lens = meta.seq_lens[idx].to(torch.int64)
            positions = torch.arange(nb * bs, device=lens.device)
            decode = _Decode(
                rows=meta.query_start_loc[idx].to(torch.int64),
                block_ids=meta.block_tables[idx, :nb],
                mask=(positions[None, :] < lens[:, None])[:, None, None, :],
            )
        prefills = plan_prefills(meta, bs, skip=lambda q_len: q_len == 1)
        meta.backend_state = _StepState(decode, prefills)

    def forward(self, q, k, v, cache: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(k, v, cache, meta.slot_mapping)
        state: _StepState = meta.backend_state
        out = torch.empty_like(q)
        scale = self.spec.scale
        gqa = self.spec.num_heads != self.spec.num_kv_heads
        if state.decode is not None:
            d = state.decode
            kd, vd = read_blocks(cache, d.block_ids, q.dtype)  # [Bd, S, KVH, D]
            o = F.scaled_dot_product_attention(
                q[d.rows].unsqueeze(2),  # [Bd, H, 1, D]
                kd.transpose(1, 2),
                vd.transpose(1, 2),
                attn_mask=d.mask,
                scale=scale,
                enable_gqa=gqa,
            )
            out[d.rows] = o.squeeze(2)
        run_prefills(q, k, v, cache, state.prefills, out, scale, gqa)
        return out


def plan_prefills(meta: AttentionMetadata, block_size: int, skip) -> list[PrefillChunk]:
    """One causal SDPA call per request whose query length ``skip`` does not claim."""
    starts = meta.query_start_loc.tolist()
    prefills = []
    for i, q_len in enumerate(meta.query_lens_cpu):
        if skip(q_len):
            continue
        seq_len = meta.seq_lens_cpu[i]
        ctx = seq_len - q_len
        mask = None
        if ctx:
            q_pos = torch.arange(ctx, seq_len, device=meta.block_tables.device)
            mask = torch.arange(seq_len, device=q_pos.device)[None, :] <= q_pos[:, None]
        table = meta.block_tables[i, : -(-seq_len // block_size)]
        prefills.append(PrefillChunk(starts[i], starts[i + 1], table, seq_len, mask))
    return prefills


def run_prefills(q, k, v, cache: LayerKVCache, prefills: list[PrefillChunk], out, scale: float, gqa: bool) -> None:
    """Causal SDPA per prefill chunk over its cached context plus its new tokens, into ``out``."""
    for p in prefills:
        if p.mask is None and not cache.quantized:  # no cached context: the cache holds exactly k, v
            kp, vp = k[p.start : p.end], v[p.start : p.end]
        else:
            kp, vp = read_blocks(cache, p.block_ids, q.dtype)
        o = F.scaled_dot_product_attention(  # 4-D: 3-D inputs fall back to SDPA's slow math path
            q[p.start : p.end].transpose(0, 1)[None],  # [1, H, Q, D]
            kp[: p.seq_len].transpose(0, 1)[None],
            vp[: p.seq_len].transpose(0, 1)[None],
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[p.start : p.end] = o[0].transpose(0, 1)


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows into their slots (quantizing for an int8 cache)."""
    kvh, d = k.shape[1], k.shape[2]
    if cache.quantized:
        kq, ks = quantize_per_token_head(k)
        vq, vs = quantize_per_token_head(v)
        cache.k.view(-1, kvh, d).index_copy_(0, slot_mapping, kq)
        cache.v.view(-1, kvh, d).index_copy_(0, slot_mapping, vq)
        cache.k_scale.view(-1, kvh).index_copy_(0, slot_mapping, ks)
        cache.v_scale.view(-1, kvh).index_copy_(0, slot_mapping, vs)
    else:
        cache.k.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(cache.k.dtype))
        cache.v.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(cache.v.dtype))


def read_blocks(cache: LayerKVCache, block_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather blocks ``[..., nb]`` into contiguous ``[..., nb * block_size, KVH, D]`` K and V."""
    flat = block_ids.reshape(-1)  # index_select copies whole blocks: several times faster than k[block_ids]
    k, v = cache.k.index_select(0, flat), cache.v.index_select(0, flat)
    if cache.quantized:
        k = dequantize(k, cache.k_scale.index_select(0, flat), dtype)
        v = dequantize(v, cache.v_scale.index_select(0, flat), dtype)
    shape = (*block_ids.shape[:-1], -1, k.shape[-2], k.shape[-1])
    return k.reshape(shape), v.reshape(shape)


@hookimpl
def register_attention_backends():
    return {"torch": TorchAttention}
