"""Linear weights pre-packed for oneDNN: same products as ``F.linear``, on by default on the
CPU, off on request (the engine-wide HF parity tests run with it on)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modserve import LLM, SamplingParams
from modserve.plugins.platforms.cpu_linear import (
    MAX_CHUNK,
    MIN_CHUNK,
    PAD_BELOW,
    ROW_STEP,
    PackedLinear,
    _CHUNK_SIZES,
    can_pack,
    pack_linears,
    row_chunks,
)

pytestmark = pytest.mark.skipif(not can_pack("cpu", torch.float32), reason="torch built without oneDNN")


@pytest.mark.parametrize("shape", [(7,), (0, 7), (1, 7), (5, 3, 7), (300, 7), (1100, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(shape, bias):
    torch.manual_seed(0)
    lin = nn.Linear(7, 13, bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(lin)(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


def test_row_chunks_cover_every_row_with_few_shapes():
    """oneDNN keeps a primitive per input shape: the chunks must come from a small fixed set."""
    shapes = set()
    for m in range(1, 3000):
        chunks = row_chunks(m)
        shapes.update(size for _, size in chunks)
        assert chunks[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(chunks, chunks[1:]))
        end = chunks[-1][0] + chunks[-1][1]
        padding, last = end - m, chunks[-1][1]
        assert 0 <= padding < (ROW_STEP if last > PAD_BELOW else 8 if last > 32 else max(MIN_CHUNK, last // 2 + 1))
        assert all(size == MAX_CHUNK for _, size in chunks[:-1])  # whole chunks, then one padded call
    small = {4, 8, 16, 32, 40, 48, 56}
    assert shapes == small | set(range(ROW_STEP, MAX_CHUNK + 1, ROW_STEP)) == _CHUNK_SIZES and len(shapes) == 39
    assert row_chunks(13) == [(0, 16)] and row_chunks(315) == [(0, 320)] and row_chunks(65) == [(0, 128)]
    assert row_chunks(38) == [(0, 40)] and row_chunks(43) == [(0, 48)]
    assert row_chunks(2048 + 70) == [(0, 2048), (2048, 128)]


def test_varying_batch_sizes_do_not_grow_memory():
    """Before chunking, 600 steps of random sizes grew the process by hundreds of MB."""
    import random

    lin = PackedLinear(nn.Linear(576, 1536, bias=False))

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    rng = random.Random(0)
    with torch.inference_mode():
        for m in sorted(_CHUNK_SIZES):  # every shape seen once
            lin(torch.randn(m, 576))
        before = rss_mb()
        for _ in range(300):
            lin(torch.randn(rng.randrange(1, 1500), 576))
    assert rss_mb() - before < 40


def test_pack_linears_swaps_every_linear_and_nothing_else():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)))
    assert pack_linears(model) == 2
    assert [type(m).__name__ for m in model.modules()].count("Linear") == 0
    assert isinstance(model[2][1], nn.LayerNorm)


def test_can_pack_is_false_off_the_cpu():
    assert not can_pack(torch.device("meta"), torch.float32)


def test_engine_packs_unless_told_not_to_and_outputs_agree(tiny_llama):
    path, _ = tiny_llama
    tokens = {}
    for pack in (True, False):
        llm = LLM(model={"path": path}, device={"plugin": "cpu", "pack_weights": pack}, kv_cache={"plugin": "paged", "num_blocks": 64})
        kinds = {type(m) for m in llm.engine.c.runner.model.modules()}
        assert (PackedLinear in kinds) is pack and (nn.Linear in kinds) is not pack
        outs = llm.generate([[3, 4, 5, 6], [9] * 30], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        tokens[pack] = [o.outputs[0].token_ids for o in outs]
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("flags,packs,want", [
    ({"avx2", "fma"}, True, "float32"),  # bfloat16 emulated: about 3x slower than float32
    ({"avx2", "avx512f", "avx512_bf16"}, True, "bfloat16"),
    ({"avx2", "avx512f", "amx_bf16", "amx_int8"}, True, "bfloat16"),
    ({"avx512_bf16"}, False, "float32"),  # oneDNN cannot pack it here
])
def test_auto_dtype_follows_the_cpus_native_bfloat16(monkeypatch, flags, packs, want):
    from modserve.core.plugin_manager import standalone_context
    from modserve.plugins.platforms import cpu

    monkeypatch.setattr(cpu, "cpu_model_and_flags", lambda: ("a CPU", frozenset(flags)))
    monkeypatch.setattr(cpu, "_packs", lambda dtype: packs)
    assert standalone_context().platform.default_dtype() == want
