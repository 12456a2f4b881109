"""Triton attention kernels under the interpreter, checked against a plain fp32 torch reference.

Every case is a random ragged step whose earlier context already sits in a paged cache
with shuffled block tables; unwritten cache slots and the output start as NaN so any
element a kernel skips (or reads when it should not) fails the comparison.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

import importlib.util
import sys
from dataclasses import dataclass

import msgspec
import pytest
import torch

pytest.importorskip("triton")

from modserve.core import kv_quant  # noqa: E402
from modserve.core.contract import AttentionMetadata, AttentionSpec, LayerKVCache  # noqa: E402
from modserve.core.plugin_manager import standalone_context  # noqa: E402
from modserve.plugins.attention import triton_backend, triton_kernels  # noqa: E402
from modserve.plugins.attention.triton_backend import TritonAttention  # noqa: E402

CPU = torch.device("cpu")
# Bound on max|out - ref| / max|ref|. fp16: P and the output are rounded to fp16. bf16: its
# dots run in fp32 under the interpreter, but the interpreter truncates fp32 -> bf16 (GPUs
# round to nearest), so the output is up to one bf16 ulp off.
REL_TOL = {torch.float32: 5e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SMALL_TILES = TritonAttention.Config(prefill_block_m=16, block_n=16)


@dataclass
class Case:
    """One step: new tokens ``q``/``k``/``v`` for a ragged batch whose context is already cached."""

    spec: AttentionSpec
    meta: AttentionMetadata
    cache: LayerKVCache
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ref_k: list[torch.Tensor]  # per request [seq_len, KVH, D] fp32, as the kernels must see it
    ref_v: list[torch.Tensor]
    context_lens: list[int]


def make_case(
    context_lens, query_lens, *, heads=4, kv_heads=2, head_dim=64, block_size=16,
    dtype=torch.float32, int8=False, seed=0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 2  # two spare blocks stay poisoned
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    cache = _poisoned_cache(num_blocks, block_size, kv_heads, head_dim, dtype, int8)

    new_k, new_v, slots, ref_k, ref_v = [], [], [], [], []
    for i, (ctx, seq) in enumerate(zip(context_lens, seq_lens)):
        block_tables[i, : blocks_per_req[i]] = torch.tensor([order.pop() for _ in range(blocks_per_req[i])])
        req_slots = [int(block_tables[i, p // block_size]) * block_size + p % block_size for p in range(seq)]
        src_k, src_v = (torch.randn(seq, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
        _store(cache, req_slots[:ctx], src_k[:ctx], src_v[:ctx])
        new_k.append(src_k[ctx:])
        new_v.append(src_v[ctx:])
        slots += req_slots[ctx:]
        ref_k.append(_as_cached(src_k, int8))
        ref_v.append(_as_cached(src_v, int8))

    num_tokens = sum(query_lens)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    spec = AttentionSpec(heads, kv_heads, head_dim, head_dim**-0.5, dtype, CPU, block_size)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    return Case(spec, meta, cache, q, torch.cat(new_k), torch.cat(new_v), ref_k, ref_v, list(context_lens))


def _poisoned_cache(num_blocks, block_size, kv_heads, head_dim, dtype, int8) -> LayerKVCache:
    shape = (num_blocks, block_size, kv_heads, head_dim)
    if not int8:
        return LayerKVCache(torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype))
    values = [torch.full(shape, 127, dtype=torch.int8) for _ in range(2)]
    scales = [torch.full(shape[:3], float("nan")) for _ in range(2)]
    return LayerKVCache(*values, *scales)


def _store(cache: LayerKVCache, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Write context K/V the way the torch backend does (the state a prefix hit leaves)."""
    block_size = cache.k.shape[1]
    idx = torch.tensor(slots, dtype=torch.long)
    blk, row = idx // block_size, idx % block_size
    if cache.quantized:
        (qk, sk), (qv, sv) = kv_quant.quantize_per_token_head(k), kv_quant.quantize_per_token_head(v)
        cache.k[blk, row], cache.v[blk, row], cache.k_scale[blk, row], cache.v_scale[blk, row] = qk, qv, sk, sv
    else:
        cache.k[blk, row], cache.v[blk, row] = k, v


def _as_cached(x: torch.Tensor, int8: bool) -> torch.Tensor:
    return kv_quant.dequantize(*kv_quant.quantize_per_token_head(x), torch.float32) if int8 else x.float()


def reference(case: Case) -> torch.Tensor:
    """Causal attention per request in fp32: queries sit at positions context_len .. seq_len-1."""
    outs, start = [], 0
    for keys, values, ctx, n in zip(case.ref_k, case.ref_v, case.context_lens, case.meta.query_lens_cpu):
        q = case.q[start : start + n].float()
        start += n
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * case.spec.scale
        visible = torch.arange(keys.shape[0])[None, :] <= (ctx + torch.arange(n))[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, values))
    return torch.cat(outs)


def run_attention(case: Case, config=SMALL_TILES) -> tuple[torch.Tensor, TritonAttention]:
    """write_kv, then the attention kernels into a NaN-poisoned output."""
    backend = TritonAttention(config, standalone_context(attention=case.spec))
    backend.prepare(case.meta)
    triton_kernels.write_kv(case.k, case.v, case.cache, case.meta.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    backend.attend(case.q, case.cache, case.meta, out)
    return out, backend


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max abs error / max |ref|)."""
    abs_err = (out.float() - ref).abs().max().item()
    return abs_err, abs_err / ref.abs().max().item()


def assert_close(out: torch.Tensor, case: Case) -> None:
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert torch.isfinite(out).all(), "kernel left output rows unwritten or read poisoned cache slots"
    _, rel = errors(out, reference(case))
    assert rel < REL_TOL[case.q.dtype], f"relative error {rel:.2e} above {REL_TOL[case.q.dtype]:.0e}"


# ----------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize(("dtype", "block_size"), [(torch.float32, 16), (torch.float16, 32), (torch.bfloat16, 16)])
def test_write_kv_copies_rows_and_skips_negative_slots(dtype, block_size):
    cache = _poisoned_cache(4, block_size, 3, 64, dtype, int8=False)
    k, v = torch.randn(6, 3, 64).to(dtype), torch.randn(6, 3, 64).to(dtype)
    slots = torch.tensor([5, -1, 2 * block_size + 1, 0, -1, 4 * block_size - 1])
    triton_kernels.write_kv(k, v, cache, slots)
    keep = slots >= 0
    flat_k, flat_v = cache.k.view(-1, 3, 64), cache.v.view(-1, 3, 64)
    assert torch.equal(flat_k[slots[keep]], k[keep]) and torch.equal(flat_v[slots[keep]], v[keep])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


@pytest.mark.parametrize(("dtype", "block_size"), [(torch.float32, 16), (torch.float16, 32)])
def test_write_kv_int8_stores_the_bytes_kv_quant_does(dtype, block_size):
    k = torch.randn(5, 2, 64) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0])[:, None, None]
    k[3] = 0.0  # all-zero rows take the 1e-8 scale floor
    k[4, 0] = 0.0
    k[4, 0, :6] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5])  # scale 1: exact ties round to even
    k, v = k.to(dtype), (torch.randn(5, 2, 64) * 4).to(dtype)
    cache = _poisoned_cache(3, block_size, 2, 64, dtype, int8=True)
    slots = torch.tensor([1, block_size, 2 * block_size + 3, -1, 7])
    triton_kernels.write_kv(k, v, cache, slots)
    keep = slots >= 0
    for x, values, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        want_q, want_s = kv_quant.quantize_per_token_head(x[keep])
        assert torch.equal(values.view(-1, 2, 64)[slots[keep]], want_q)
        assert torch.equal(scales.view(-1, 2)[slots[keep]], want_s)
    assert cache.k.view(-1, 2, 64)[7, 0, :6].tolist() == [127, 2, -4, 0, 0, 2]


# ----------------------------------------------------------------------------- prefill

PREFILL_CASES = {
    # ctx 0 (fresh prompt), 16 (block-aligned prefix hit), 37 (earlier chunk), tiny tail,
    # 9 (a query tile whose last token starts a new key tile)
    "fp32-gqa-bs16": dict(context_lens=[0, 16, 37, 5, 9], query_lens=[33, 20, 7, 2, 12]),
    "fp16-group3-bs32": dict(context_lens=[32, 0, 45], query_lens=[9, 26, 3], heads=6, dtype=torch.float16,
                             block_size=32),
    "bf16-mha": dict(context_lens=[16, 3], query_lens=[19, 4], heads=2, kv_heads=2, dtype=torch.bfloat16),
    "fp32-mqa-d128-bs32": dict(context_lens=[40, 0], query_lens=[5, 18], heads=2, kv_heads=1, head_dim=128,
                               block_size=32),
    "int8-fp32": dict(context_lens=[32, 0, 21], query_lens=[12, 17, 2], int8=True),
    "int8-fp16-bs32": dict(context_lens=[64, 7], query_lens=[5, 16], dtype=torch.float16, int8=True,
                           block_size=32),
}


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_matches_reference(name):
    case = make_case(**PREFILL_CASES[name], seed=len(name))
    out, _ = run_attention(case)
    assert case.meta.backend_state.decode_reqs is None
    assert_close(out, case)


# ----------------------------------------------------------------------------- decode

DECODE_CASES = {
    # seq 1 (a one-token prompt), block boundaries at 16/17, a longer context
    "fp32-gqa": dict(context_lens=[0, 15, 16, 70]),
    "fp16-group3-bs32": dict(context_lens=[31, 64, 2], heads=6, dtype=torch.float16, block_size=32),
    "bf16": dict(context_lens=[20, 47], dtype=torch.bfloat16),
    "fp16-d128": dict(context_lens=[33, 9], heads=4, kv_heads=1, head_dim=128, dtype=torch.float16),
    "int8-fp32": dict(context_lens=[50, 0, 17], int8=True),
}


@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_matches_reference(name):
    params = DECODE_CASES[name]
    case = make_case(query_lens=[1] * len(params["context_lens"]), **params, seed=len(name))
    out, _ = run_attention(case)
    assert case.meta.backend_state.prefill_tiles is None
    assert case.meta.backend_state.partials is None
    assert_close(out, case)


@pytest.mark.parametrize(("dtype", "int8"), [(torch.float32, False), (torch.float16, True)])
def test_decode_split_k_matches_reference(dtype, int8):
    # The 301-token context is split 10 ways; the 8-token one leaves most partitions empty.
    case = make_case([300, 7, 129], [1, 1, 1], dtype=dtype, int8=int8, seed=11)
    config = TritonAttention.Config(block_n=16, decode_split_tokens=32, decode_max_splits=16)
    out, _ = run_attention(case, config)
    o_part, _ = case.meta.backend_state.partials
    assert o_part.shape[2] == 10
    assert_close(out, case)


def test_decode_splits_stop_once_the_requests_fill_the_device():
    config = TritonAttention.Config(decode_split_tokens=256, decode_max_splits=16)
    assert triton_backend.decode_splits(config, 8, 2048, None) == 8  # by length alone
    assert triton_backend.decode_splits(config, 8, 8192, None) == 16  # at most decode_max_splits
    assert triton_backend.decode_splits(config, 8, 2048, 132) == 8  # one request of 8 KV heads: far from full
    assert triton_backend.decode_splits(config, 64, 2048, 132) == 2  # 8 requests: two partitions fit
    assert triton_backend.decode_splits(config, 128, 2048, 132) == 1  # 16 requests fill it alone
    assert triton_backend.decode_splits(config, 2048, 2048, 132) == 1


def test_fill_limit_plans_fewer_partitions_and_stays_exact():
    case = make_case([300, 7, 129], [1, 1, 1], seed=13)  # 3 requests x 2 KV heads: 6 programs a partition
    out, _ = run_attention(case, TritonAttention.Config(block_n=16, decode_split_tokens=32, decode_fill_programs=12))
    o_part, _ = case.meta.backend_state.partials
    assert o_part.shape[2] == 2  # 10 by length; 6 programs fit twice in 12
    assert_close(out, case)


# ----------------------------------------------------------------------------- whole forward


def test_forward_mixed_batch_writes_cache_and_attends():
    case = make_case([0, 40, 16, 0, 90], [21, 1, 6, 1, 1], heads=6, seed=5)
    backend = TritonAttention(TritonAttention.Config(block_n=16, decode_split_tokens=32), standalone_context(attention=case.spec))
    backend.prepare(case.meta)
    out = backend.forward(case.q, case.k, case.v, case.cache, case.meta)
    plan = case.meta.backend_state
    assert plan.decode_reqs.tolist() == [1, 3, 4] and plan.partials is not None
    slots = case.meta.slot_mapping
    assert torch.equal(case.cache.k.view(-1, 2, 64)[slots], case.k)
    assert torch.equal(case.cache.v.view(-1, 2, 64)[slots], case.v)
    assert_close(out, case)


def test_mixed_batch_with_default_tiles():
    """The default 128-row prefill tiles and 64-key tiles (the small-tile tests cross more tile edges)."""
    case = make_case([0, 70, 40], [100, 30, 1], dtype=torch.float16, seed=3)
    out, _ = run_attention(case, TritonAttention.Config())
    assert_close(out, case)


# ----------------------------------------------------------------------------- construction


def _spec(head_dim=64) -> AttentionSpec:
    return AttentionSpec(4, 2, head_dim, head_dim**-0.5, torch.float32, CPU, 16)


def test_cpu_without_interpreter_explains_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"set TRITON_INTERPRET=1 .*attention: \{plugin: torch\}"):
        TritonAttention(TritonAttention.Config(), standalone_context(attention=_spec()))


def test_unsupported_head_size_is_named():
    with pytest.raises(ValueError, match="head size 96; supported head sizes: 64, 128"):
        TritonAttention(TritonAttention.Config(), standalone_context(attention=_spec(head_dim=96)))


def test_config_rejects_bad_options():
    with pytest.raises(msgspec.ValidationError, match="decode_max_splits"):
        msgspec.convert({"decode_max_splits": 0}, TritonAttention.Config)
    with pytest.raises(msgspec.ValidationError, match="block_n"):
        msgspec.convert({"block_n": 48}, TritonAttention.Config)
    with pytest.raises(msgspec.ValidationError, match="num_splits"):
        msgspec.convert({"num_splits": 4}, TritonAttention.Config)


def test_registers_without_triton_and_explains_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    spec = importlib.util.spec_from_file_location("triton_backend_without_triton", triton_backend.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    cls = module.register_attention_backends()["triton"]
    with pytest.raises(RuntimeError, match="pip install triton"):
        cls(cls.Config(), standalone_context(attention=_spec()))
