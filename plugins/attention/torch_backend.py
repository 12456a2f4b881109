"""Attention backend ``torch``: paged attention with ``scaled_dot_product_attention``, any device.

Per step, ``prepare`` splits the batch into decode rows (one query token) and prefill
chunks and builds their gather indices and masks once; every layer reuses them. Decode
rows run as one padded SDPA call; each prefill chunk runs its own causal SDPA over its
cached context plus its new tokens. K/V are always read back from the paged cache, so a
request sees the same (possibly int8-quantized) values whether its prefix was computed
in this step, an earlier chunk, or served from the prefix cache (a chunk with no cached
context uses its fresh K/V directly when the cache is not quantized: the same values).

Per layer (:meth:`for_layer`): a sliding window is one more mask term (built once per step
and window, on first use), and soft-capped scores, which SDPA cannot compute, take a masked
matmul -> tanh -> softmax path in float32.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

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
    lens: torch.Tensor  # [Bd] int64 sequence lengths
    windowed: dict = field(default_factory=dict)  # window -> mask with the window applied


@dataclass
class PrefillChunk:
    """One request's rows ``[start, end)`` for one causal SDPA call (also used by ``cpu``)."""

    start: int
    end: int
    block_ids: torch.Tensor  # [nb]
    seq_len: int
    mask: torch.Tensor | None  # None: plain causal (no cached context)
    windowed: dict = field(default_factory=dict)  # window -> [Q, S] mask with the window applied

    def window_mask(self, window: int | None) -> torch.Tensor | None:
        """The chunk's mask for a layer with ``window`` (None: the causal one)."""
        if window is None:
            return self.mask
        if window not in self.windowed:
            device = self.block_ids.device
            q_pos = torch.arange(self.seq_len - (self.end - self.start), self.seq_len, device=device)[:, None]
            k_pos = torch.arange(self.seq_len, device=device)[None, :]
            self.windowed[window] = (k_pos <= q_pos) & (k_pos > q_pos - window)
        return self.windowed[window]


@dataclass
class _StepState:
    decode: _Decode | None
    prefills: list[PrefillChunk]


class TorchAttention(AttentionBackend):
    Config = NoOptions
    window: int | None = None  # this layer's sliding window (set by for_layer)
    softcap: float | None = None  # this layer's logit soft-cap

    def for_layer(self, sliding_window: int | None = None, logit_softcap: float | None = None) -> TorchAttention:
        return layer_view(self, sliding_window, logit_softcap)

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
                lens=lens,
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
            mask = d.mask
            if self.window is not None:
                if self.window not in d.windowed:
                    positions = torch.arange(kd.shape[1], device=d.lens.device)
                    d.windowed[self.window] = mask & (positions >= d.lens[:, None] - self.window)[:, None, None, :]
                mask = d.windowed[self.window]
            o = attention(
                q[d.rows].unsqueeze(2),  # [Bd, H, 1, D]
                kd.transpose(1, 2),
                vd.transpose(1, 2),
                mask, scale, gqa, self.softcap,
            )
            out[d.rows] = o.squeeze(2)
        run_prefills(q, k, v, cache, state.prefills, out, scale, gqa, self.window, self.softcap)
        return out


def layer_view(backend, window: int | None, softcap: float | None):
    """``backend`` itself, or a shallow copy for one layer's window and soft-cap: it shares the
    backend's config, spec and per-step state (``meta.backend_state``)."""
    if window is None and softcap is None:
        return backend
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"logit soft-cap must be > 0, got {softcap}")
    view = copy.copy(backend)
    view.window, view.softcap = window, softcap
    return view


def attention(q, k, v, mask, scale: float, gqa: bool, softcap: float | None = None, is_causal: bool = False):
    """SDPA over ``[B, H, Q, D]`` / ``[B, KVH, S, D]``; with ``softcap``, scores ``cap * tanh(s / cap)``
    by a masked matmul in float32 (SDPA cannot cap)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    if gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if is_causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(s.shape[-1] - s.shape[-2])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(s.softmax(-1), v.float()).to(q.dtype)


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


def run_prefills(
    q, k, v, cache: LayerKVCache, prefills: list[PrefillChunk], out, scale: float, gqa: bool,
    window: int | None = None, softcap: float | None = None,
) -> None:
    """Causal SDPA per prefill chunk over its cached context plus its new tokens, into ``out``
    (``window``, ``softcap``: the layer's, see :meth:`TorchAttention.for_layer`)."""
    for p in prefills:
        if p.mask is None and not cache.quantized:  # no cached context: the cache holds exactly k, v
            kp, vp = k[p.start : p.end], v[p.start : p.end]
        else:
            kp, vp = read_blocks(cache, p.block_ids, q.dtype)
        mask = p.window_mask(window) if window is not None and window < p.seq_len else p.mask
        o = attention(  # 4-D: 3-D inputs fall back to SDPA's slow math path
            q[p.start : p.end].transpose(0, 1)[None],  # [1, H, Q, D]
            kp[: p.seq_len].transpose(0, 1)[None],
            vp[: p.seq_len].transpose(0, 1)[None],
            mask, scale, gqa, softcap, is_causal=mask is None,
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
