"""Sliding windows and logit soft-capping at the kernel level: the ``cpu`` backend's C++ kernel
(its AVX-512 and portable builds; float32, bfloat16 and int8 caches; decode rows, prefill
tiles and chunks after cached context) and the ``torch`` / ``cpu`` backends' per-layer views
(``for_layer``), each against a plain float32 reference, and the reference itself against
the same attention with the window ignored (so the window is exercised)."""

from __future__ import annotations

import pytest
import torch

from modserve.core import kv_quant
from modserve.core.contract import AttentionBackend, AttentionMetadata, AttentionSpec, LayerKVCache
from modserve.core.plugin_manager import standalone_context
from modserve.plugins.attention import cpu_kernel_build
from modserve.plugins.attention.cpu_backend import CpuAttention
from modserve.plugins.attention.torch_backend import TorchAttention

BUILDS = {"native": (), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx512f", "-mno-avx2")}
WINDOW, CAP = 7, 1.5  # a cap this low bends most scores: without it the outputs differ


def reference(q, keys, values, positions, scale, window, cap):
    """fp32 attention of rows ``q [N, H, D]`` at ``positions`` over ``keys``/``values [S, KVH, D]``."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    k_pos, q_pos = torch.arange(keys.shape[0])[None, :], torch.tensor(positions)[:, None]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)


@pytest.mark.parametrize("window,cap", [(WINDOW, None), (None, CAP), (WINDOW, CAP), (40, CAP)])
@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("head_dim,cache_dtype", [(64, torch.float32), (128, torch.bfloat16), (64, torch.int8),
                                                  (32, torch.float32)])
def test_kernel_window_and_softcap_match_the_reference(head_dim, cache_dtype, build, window, cap):
    """One sequence of 70 tokens in scattered 16-token blocks; rows: a 33-row chunk after 30
    cached tokens (tiles that start before, inside and after the window) and lone decode rows."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, bs, n = 4, 2, 16, 70
    k = torch.randn(n, kv_heads, head_dim, generator=g)
    v = torch.randn(n, kv_heads, head_dim, generator=g)
    table = torch.randperm(12, generator=g)[: -(-n // bs)].to(torch.int32)[None]
    slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(n)])
    shape = (12, bs, kv_heads, head_dim)
    if cache_dtype == torch.int8:
        (kq, ks), (vq, vs) = kv_quant.quantize_per_token_head(k), kv_quant.quantize_per_token_head(v)
        kc, vc = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
        k_scale, v_scale = torch.zeros(shape[:3]), torch.zeros(shape[:3])
        kc.view(-1, kv_heads, head_dim)[slots], vc.view(-1, kv_heads, head_dim)[slots] = kq, vq
        k_scale.view(-1, kv_heads)[slots], v_scale.view(-1, kv_heads)[slots] = ks, vs
        k, v = kq.float() * ks[..., None], vq.float() * vs[..., None]
    else:
        kc, vc = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
        kc.view(-1, kv_heads, head_dim)[slots], vc.view(-1, kv_heads, head_dim)[slots] = k.to(cache_dtype), v.to(cache_dtype)
        k_scale = v_scale = None
        k, v = k.to(cache_dtype).float(), v.to(cache_dtype).float()
    positions = list(range(30, 63)) + [0, 5, 6, 7, 69]
    q = torch.randn(len(positions), heads, head_dim, generator=g)
    out = torch.full_like(q, float("nan"))
    lib = cpu_kernel_build.load(BUILDS[build])
    cpu_kernel_build.paged_attention(
        q, out, kc, vc, k_scale, v_scale, table, torch.arange(len(positions)), torch.zeros(len(positions), dtype=torch.int32),
        torch.tensor(positions, dtype=torch.int32), head_dim**-0.5, lib, window=window, softcap=cap,
    )
    want = reference(q, k, v, positions, head_dim**-0.5, window, cap)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    plain = reference(q, k, v, positions, head_dim**-0.5, None, None)
    assert (plain - want).abs().max() > 1e-2  # the window / cap changes these outputs


def _step(q_lens, ctx_lens, kv_heads, head_dim, bs, seed=0):
    """A ragged step: metadata, a cache holding each request's context, the new q/k/v and the full K/V."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    width = max(-(-s // bs) for s in seq_lens)
    num_blocks = width * len(seq_lens) + 1
    tables = torch.randperm(num_blocks, generator=g)[: width * len(seq_lens)].view(len(seq_lens), width).to(torch.int32)
    cache = LayerKVCache(torch.zeros(num_blocks, bs, kv_heads, head_dim), torch.zeros(num_blocks, bs, kv_heads, head_dim))
    full, new_k, new_v, slots = [], [], [], []
    for i, (c, s) in enumerate(zip(ctx_lens, seq_lens)):
        k, v = torch.randn(s, kv_heads, head_dim, generator=g), torch.randn(s, kv_heads, head_dim, generator=g)
        req_slots = [int(tables[i, p // bs]) * bs + p % bs for p in range(s)]
        cache.k.view(-1, kv_heads, head_dim)[req_slots[:c]] = k[:c]
        cache.v.view(-1, kv_heads, head_dim)[req_slots[:c]] = v[:c]
        new_k.append(k[c:]), new_v.append(v[c:]), full.append((k, v))
        slots += req_slots[c:]
    meta = AttentionMetadata(
        num_tokens=sum(q_lens), query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots), block_tables=tables, query_lens_cpu=list(q_lens), seq_lens_cpu=seq_lens,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
    )
    return meta, cache, torch.cat(new_k), torch.cat(new_v), full


@pytest.mark.parametrize("window,cap", [(WINDOW, None), (None, CAP), (WINDOW, CAP)])
@pytest.mark.parametrize("backend", ["torch", "cpu", "cpu+sdpa"])
def test_backend_layer_views_match_the_reference(backend, window, cap):
    """Decode rows, a prompt with no context and chunks after cached context, through
    ``for_layer``; the backend itself (not the view) stays plain causal."""
    heads, kv_heads, head_dim, bs = 4, 2, 64, 16
    spec = AttentionSpec(heads, kv_heads, head_dim, 0.1, torch.float32, torch.device("cpu"), bs)
    ctx = standalone_context(attention=spec)
    base = {"torch": lambda: TorchAttention(TorchAttention.Config(), ctx),
            "cpu": lambda: CpuAttention(CpuAttention.Config(), ctx),
            "cpu+sdpa": lambda: CpuAttention(CpuAttention.Config(max_query_len=1), ctx)}[backend]()
    layer = base.for_layer(window, cap)
    assert base.for_layer() is base and layer is not base
    q_lens, ctx_lens = [1, 1, 20, 9, 30], [0, 40, 0, 25, 3]
    meta, cache, k, v, full = _step(q_lens, ctx_lens, kv_heads, head_dim, bs)
    q = torch.randn(meta.num_tokens, heads, head_dim, generator=torch.Generator().manual_seed(7))
    base.prepare(meta)
    out = layer.forward(q, k, v, cache, meta)
    start = 0
    for (kr, vr), c, n in zip(full, ctx_lens, q_lens):
        want = reference(q[start : start + n], kr, vr, list(range(c, c + n)), 0.1, window, cap)
        torch.testing.assert_close(out[start : start + n], want, rtol=2e-5, atol=2e-5)
        start += n
    plain = base.forward(q, k, v, cache, meta)  # the same step without the layer's settings
    assert (plain - out).abs().max() > 1e-2


def test_the_contract_default_refuses_per_layer_settings_by_name():
    class Legacy(AttentionBackend):
        def forward(self, q, k, v, cache, meta):
            raise NotImplementedError

    spec = AttentionSpec(4, 2, 64, 0.125, torch.float32, torch.device("cpu"), 16)
    legacy = Legacy(Legacy.Config(), standalone_context(attention=spec))
    assert legacy.for_layer(None, None) is legacy
    with pytest.raises(ValueError, match=r"attention backend Legacy \(.*\) does not support a sliding window \(sliding_window=8"):
        legacy.for_layer(8)
    with pytest.raises(ValueError, match="does not support logit soft-capping"):
        legacy.for_layer(None, 30.0)
