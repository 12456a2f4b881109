"""Triton kernels for paged attention, and thin launchers that pick grids and pass strides.

* ``write_kv`` scatters a step's new K/V into the paged cache (int8 + per-token-head
  scales when the cache is quantized, bit-identical to :mod:`modserve.core.kv_quant`).
* ``prefill_attention`` is a varlen causal flash-attention over prompt chunks. It runs
  after ``write_kv``, so a request's whole KV (prefix hits, earlier chunks and this
  chunk) is read through its block table in one loop.
* ``decode_attention`` handles one query token per request, optionally splitting long
  contexts into partitions (split-K) that ``_reduce_splits_kernel`` merges.

Both attention kernels pack the query heads that share a KV head into the rows of one
tile, so each K/V tile is loaded once per KV head rather than once per query head.

Per layer, both take a sliding window (``HAS_WINDOW``: a query at ``p`` sees keys
``> p - window``; the loops start at the window's first tile) and logit soft-capping
(``SOFTCAP``: scaled scores become ``cap * tanh(s / cap)`` before the mask), as constexpr
switches, so plain layers compile to the kernels they were.
See docs/triton_attention.md for the algorithm and the performance model.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from modserve.core.contract import AttentionMetadata, LayerKVCache

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Decided when the kernels below are decorated, exactly as triton.jit decides it.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows on GPUs
_LOG2E = 1.4426950408889634
_WRITE_ROWS = 16  # (token, kv head) rows per write_kv program


# ----------------------------------------------------------------------------- KV write


@triton.jit
def _round_half_even(x):
    """torch.round (ties to even) from floor, so it is exact on GPUs and in the interpreter."""
    f = tl.floor(x)
    frac = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _store_rows(src, dst, scale_dst, keep, QUANT: tl.constexpr):
    """Copy [rows, D] from src to dst; with QUANT, store int8 values and absmax/127 scales."""
    x = tl.load(src, mask=keep[:, None], other=0.0)
    if QUANT:
        x = x.to(tl.float32)
        # div_rn: IEEE division like torch; the default GPU division is approximate.
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-8), 127.0)
        xq = _round_half_even(tl.div_rn(x, scale[:, None]))
        xq = tl.minimum(tl.maximum(xq, -127.0), 127.0)
        tl.store(dst, xq.to(tl.int8), mask=keep[:, None])
        tl.store(scale_dst, scale, mask=keep)
    else:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=keep[:, None])


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, slot_ptr, k_cache, v_cache, k_scale, v_scale,
    num_rows, num_kv_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cr, stride_ch, stride_sb, stride_sr, stride_sh,
    BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    tok = rows // num_kv_heads
    head = rows % num_kv_heads
    slot = tl.load(slot_ptr + tok, mask=rows < num_rows, other=-1)
    keep = slot >= 0
    blk = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    d = tl.arange(0, HEAD_DIM)
    dst = (blk * stride_cb + row * stride_cr + head * stride_ch)[:, None] + d[None, :]
    scale_dst = blk * stride_sb + row * stride_sr + head * stride_sh
    k_src = k_ptr + (tok * stride_kt + head * stride_kh)[:, None] + d[None, :]
    v_src = v_ptr + (tok * stride_vt + head * stride_vh)[:, None] + d[None, :]
    _store_rows(k_src, k_cache + dst, k_scale + scale_dst, keep, QUANT)
    _store_rows(v_src, v_cache + dst, v_scale + scale_dst, keep, QUANT)


def write_kv(k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, slot_mapping: torch.Tensor) -> None:
    """Write ``k``/``v [T, KVH, D]`` into ``cache`` at ``slot_mapping [T]`` (slot -1: skip)."""
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    num_tokens, num_kv_heads, head_dim = k.shape
    num_rows = num_tokens * num_kv_heads
    if num_rows == 0:
        return
    k_scale, v_scale, scale_strides = _scales(cache)
    _write_kv_kernel[(triton.cdiv(num_rows, _WRITE_ROWS),)](
        k, v, slot_mapping, cache.k, cache.v, k_scale, v_scale,
        num_rows, num_kv_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *_cache_strides(cache), *scale_strides,
        BLOCK_R=_WRITE_ROWS, HEAD_DIM=head_dim, BLOCK_SIZE=cache.k.shape[1], QUANT=cache.quantized,
    )


# ----------------------------------------------------------------------------- attention helpers


@triton.jit
def _load_kv_tile(
    k_cache, v_cache, k_scale, v_scale, bt_row, kv_head, pos, valid,
    stride_cb, stride_cr, stride_ch, stride_sb, stride_sr, stride_sh,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """Gather K^T [D, N] and V [N, D] for token positions ``pos`` through the block table."""
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row = pos % BLOCK_SIZE
    off = blk * stride_cb + row * stride_cr + kv_head * stride_ch
    d = tl.arange(0, HEAD_DIM)
    kt = tl.load(k_cache + off[None, :] + d[:, None], mask=valid[None, :], other=0.0)
    v = tl.load(v_cache + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    if QUANT:
        scale_off = blk * stride_sb + row * stride_sr + kv_head * stride_sh
        kt = kt.to(tl.float32) * tl.load(k_scale + scale_off, mask=valid, other=0.0)[None, :]
        v = v.to(tl.float32) * tl.load(v_scale + scale_off, mask=valid, other=0.0)[:, None]
    return kt.to(DOT_DTYPE), v.to(DOT_DTYPE)


@triton.jit
def _attend(q, kt, v, m_i, l_i, acc, mask, qk_scale, APPLY_MASK: tl.constexpr, DOT_DTYPE: tl.constexpr,
            softcap=0.0, SOFTCAP: tl.constexpr = False, GUARD: tl.constexpr = False):
    """One online-softmax step (base-2 exponent): fold a K/V tile into the running max, sum and output.

    SOFTCAP: ``cap * tanh(s / cap)`` on the natural-log scores (tanh from exp: no tanh in the
    interpreter). GUARD: rows that have seen no key yet (all masked so far, as before a
    sliding window's first key) keep a zero state instead of NaN."""
    s = tl.dot(q, kt, input_precision="ieee") * qk_scale
    if SOFTCAP:
        x = s * (1.0 / (1.4426950408889634 * softcap))  # s / log2(e) / cap
        s = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (softcap * 1.4426950408889634)
    if APPLY_MASK:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if GUARD:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - 0) = 0: nothing added, nothing lost
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
    return m_new, l_i, acc


# ----------------------------------------------------------------------------- prefill


@triton.jit
def _prefill_kernel(
    q_ptr, out_ptr, k_cache, v_cache, k_scale, v_scale,
    tiles_ptr, query_start_loc, seq_lens, context_lens, block_tables, qk_scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cr, stride_ch, stride_sb, stride_sr, stride_sh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One program: BLOCK_Q query tokens x the GROUP heads of one KV head, for one request."""
    kv_head = tl.program_id(1)
    req = tl.load(tiles_ptr + 2 * tl.program_id(0))
    q_first = tl.load(tiles_ptr + 2 * tl.program_id(0) + 1)
    q_start = tl.load(query_start_loc + req)
    q_len = tl.load(query_start_loc + req + 1) - q_start
    seq_len = tl.load(seq_lens + req)
    ctx = tl.load(context_lens + req)

    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_idx = q_first + r // GROUP_PAD
    head = kv_head * GROUP + r % GROUP_PAD
    row_ok = (q_idx < q_len) & (r % GROUP_PAD < GROUP)
    q_pos = ctx + q_idx
    d = tl.arange(0, HEAD_DIM)
    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + (tok * stride_qt + head * stride_qh)[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    q = q.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = block_tables + req.to(tl.int64) * stride_bt

    # Keys before the tile's first query are visible to every row: no causal mask there.
    # With a window, every tile from the first row's window start on is masked.
    unmasked_end = ((ctx + q_first) // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        unmasked_end = (tl.maximum(ctx + q_first - window + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        for start in range(0, unmasked_end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            kt, v = _load_kv_tile(k_cache, v_cache, k_scale, v_scale, bt_row, kv_head, pos, pos < seq_len,
                                  stride_cb, stride_cr, stride_ch, stride_sb, stride_sr, stride_sh,
                                  HEAD_DIM, BLOCK_SIZE, QUANT, DOT_DTYPE)
            m_i, l_i, acc = _attend(q, kt, v, m_i, l_i, acc, 0, qk_scale, False, DOT_DTYPE, softcap, SOFTCAP)
    end = tl.minimum(seq_len, ctx + q_first + BLOCK_Q)
    for start in range(unmasked_end, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        kt, v = _load_kv_tile(k_cache, v_cache, k_scale, v_scale, bt_row, kv_head, pos, pos < seq_len,
                              stride_cb, stride_cr, stride_ch, stride_sb, stride_sr, stride_sh,
                              HEAD_DIM, BLOCK_SIZE, QUANT, DOT_DTYPE)
        causal = pos[None, :] <= q_pos[:, None]
        if HAS_WINDOW:
            causal = causal & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _attend(q, kt, v, m_i, l_i, acc, causal, qk_scale, True, DOT_DTYPE, softcap, SOFTCAP, HAS_WINDOW)

    out = acc / l_i[:, None]
    out_ptrs = out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_group_pad(num_heads: int, num_kv_heads: int) -> int:
    """Rows one query token takes in a prefill tile: its KV head's query heads, padded to a power of two."""
    return triton.next_power_of_2(num_heads // num_kv_heads)


def prefill_block_q(num_heads: int, num_kv_heads: int, block_m: int) -> int:
    """Query tokens per prefill tile, so that a tile has about ``block_m`` rows."""
    return max(1, block_m // prefill_group_pad(num_heads, num_kv_heads))


def prefill_attention(
    q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, tiles: torch.Tensor, block_q: int, block_n: int,
    scale: float, out: torch.Tensor, window: int | None = None, softcap: float | None = None,
) -> None:
    """Causal attention for prompt chunks into ``out``; ``tiles [N, 2]`` int32 holds
    (request, first query index) pairs, each covering ``block_q`` query tokens. ``window``,
    ``softcap``: the layer's sliding window and logit soft-cap (None: none)."""
    q = _last_dim_contiguous(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = cache.k.shape[2]
    k_scale, v_scale, scale_strides = _scales(cache)
    group_pad = prefill_group_pad(num_heads, num_kv_heads)
    # Twice the warps for the 128x128 fp32 accumulator, as the Triton flash-attention tutorial does.
    num_warps = 8 if block_q * group_pad * head_dim >= 128 * 128 else 4
    _prefill_kernel[(tiles.shape[0], num_kv_heads)](
        q, out, cache.k, cache.v, k_scale, v_scale,
        tiles, meta.query_start_loc, meta.seq_lens, meta.context_lens, meta.block_tables, scale * _LOG2E,
        window or 0, float(softcap or 0.0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *_cache_strides(cache), *scale_strides, meta.block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_SIZE=cache.k.shape[1],
        QUANT=cache.quantized, DOT_DTYPE=dot_dtype(q.dtype), HAS_WINDOW=window is not None,
        SOFTCAP=softcap is not None, num_warps=num_warps,
    )


# ----------------------------------------------------------------------------- decode


@triton.jit
def _decode_kernel(
    q_ptr, out_ptr, o_part, lse_part, k_cache, v_cache, k_scale, v_scale,
    reqs_ptr, query_start_loc, seq_lens, block_tables, qk_scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    stride_cb, stride_cr, stride_ch, stride_sb, stride_sr, stride_sh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr, DOT_DTYPE: tl.constexpr, SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One program: the GROUP query heads of one KV head, over one context partition of one request.

    With SPLIT, writes the partition's normalised output and log2-sum-exp for the
    reduction kernel; otherwise (a single partition) writes the final output.
    """
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(reqs_ptr + i)
    tok = tl.load(query_start_loc + req).to(tl.int64)
    seq_len = tl.load(seq_lens + req)
    split_len = tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    first_key = 0  # the query (at seq_len - 1) sees keys >= seq_len - window
    if HAS_WINDOW:
        first_key = tl.maximum(seq_len - window, 0)
        lo = tl.maximum(lo, (first_key // BLOCK_N) * BLOCK_N)

    g = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + g
    row_ok = g < GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    q = q.to(DOT_DTYPE)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = block_tables + req.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        if HAS_WINDOW:
            valid = valid & (pos >= first_key)
        kt, v = _load_kv_tile(k_cache, v_cache, k_scale, v_scale, bt_row, kv_head, pos, valid,
                              stride_cb, stride_cr, stride_ch, stride_sb, stride_sr, stride_sh,
                              HEAD_DIM, BLOCK_SIZE, QUANT, DOT_DTYPE)
        m_i, l_i, acc = _attend(q, kt, v, m_i, l_i, acc, valid[None, :], qk_scale, True, DOT_DTYPE, softcap, SOFTCAP,
                                HAS_WINDOW)

    # An empty partition (short request) has l_i == 0: output 0 with weight exp2(-inf) = 0.
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLIT:
        lse = tl.where(nonempty, m_i + tl.log2(l_safe), float("-inf"))
        part = i * stride_pb + head * stride_ph + split * stride_ps
        tl.store(o_part + part[:, None] + d[None, :], out, mask=row_ok[:, None])
        tl.store(lse_part + i * stride_lb + head * stride_lh + split, lse, mask=row_ok)
    else:
        out_ptrs = out_ptr + tok * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _reduce_splits_kernel(
    o_part, lse_part, reqs_ptr, query_start_loc, out_ptr, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ot, stride_oh,
    SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Merge one (request, head)'s partitions, weighting each by exp2(lse - max lse)."""
    i = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    ok = s < num_splits
    lse = tl.load(lse_part + i * stride_lb + head * stride_lh + s, mask=ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(o_part + i * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :],
                    mask=ok[:, None], other=0.0)
    out = tl.sum(w[:, None] * parts, 0) / tl.sum(w, 0)
    tok = tl.load(query_start_loc + tl.load(reqs_ptr + i)).to(tl.int64)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def decode_group_pad(num_heads: int, num_kv_heads: int) -> int:
    """Decode tile rows: the KV head's query heads, padded to a power of two that tl.dot accepts."""
    return max(MIN_DOT_ROWS, triton.next_power_of_2(num_heads // num_kv_heads))


def decode_attention(
    q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, reqs: torch.Tensor, block_n: int, scale: float,
    out: torch.Tensor, partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None, softcap: float | None = None,
) -> None:
    """Attention for one query token per request in ``reqs [Bd]`` int32, into ``out``.

    ``partials`` (fp32 ``o [Bd, H, S, D]``, ``lse [Bd, H, S]``) turns on split-K with S
    partitions per request; without it each (request, KV head) is one program.
    """
    q = _last_dim_contiguous(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = cache.k.shape[2]
    k_scale, v_scale, scale_strides = _scales(cache)
    o_part, lse_part = partials if partials is not None else (out, out)
    num_splits = o_part.shape[2] if partials is not None else 1
    _decode_kernel[(reqs.shape[0], num_kv_heads, num_splits)](
        q, out, o_part, lse_part, cache.k, cache.v, k_scale, v_scale,
        reqs, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale * _LOG2E, window or 0, float(softcap or 0.0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        *_cache_strides(cache), *scale_strides, meta.block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, GROUP_PAD=decode_group_pad(num_heads, num_kv_heads),
        BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_SIZE=cache.k.shape[1], QUANT=cache.quantized,
        DOT_DTYPE=dot_dtype(q.dtype), SPLIT=partials is not None, HAS_WINDOW=window is not None,
        SOFTCAP=softcap is not None,
    )
    if partials is not None:
        _reduce_splits_kernel[(reqs.shape[0], num_heads)](
            o_part, lse_part, reqs, meta.query_start_loc, out, num_splits,
            o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
            out.stride(0), out.stride(1),
            SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        )


# ----------------------------------------------------------------------------- launcher helpers


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """tl.dot operand type: the activation type, but fp32 for bf16 under the interpreter
    (numpy has no bf16 and the interpreter's bf16 dot returns garbage)."""
    if dtype == torch.bfloat16 and INTERPRETED:
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels index the head dimension with unit stride."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _cache_strides(cache: LayerKVCache) -> tuple[int, int, int]:
    """(block, row, head) strides, shared by K and V so kernels take one set."""
    if cache.k.stride() != cache.v.stride() or cache.k.stride(-1) != 1:
        raise ValueError("triton attention: K and V caches must have the same strides and a contiguous head_dim")
    return cache.k.stride()[:3]


def _scales(cache: LayerKVCache) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """Scale tensors and their strides; the K cache stands in (unread) when not quantized."""
    if cache.k_scale is None:
        return cache.k, cache.k, (0, 0, 0)
    return cache.k_scale, cache.v_scale, cache.k_scale.stride()
