"""int8 codes with a scale, and optionally a zero, per group of inputs (GGUF Q8_0, Q6_K, Q5_x,
mixed K-quant layers, GPTQ 8-bit: ``Int8GroupLinear``) on
the panel kernels (``native/group_int8_panels.h``; ``use_panels``): in bfloat16 up to 8 rows
multiplied directly group by group, beyond widened per call to bfloat16 panels a thread's group
at a time; in float32 widened to float32 panels; instead of the whole weight widened in torch.

What could go wrong, and is checked here: a code or a group's scale put on the wrong output or
input (the panels' pair order, groups of 16, 32 and 128), a zero lost or applied to the wrong
group (each case runs with symmetric codes, with zeros, with unsigned codes below 128 and their
minima, and with such codes around a center), the bfloat16 weight rounded differently from
``weight_as``, a bias lost, rows past one sweep, shapes the panels cannot take accepted."""

from __future__ import annotations

import math

import pytest
import torch
from test_cpu_experts import NATIVE, needs_avx2, torch_threads
from torch import nn

from modserve.core.models.gguf_quantized import TwoLevelScales
from modserve.plugins.platforms.cpu_int8_panel_linear import group_int8_kernel
from modserve.plugins.platforms.cpu_quant import Int8GroupLinear


def group_layer(k: int, n: int, group: int, dtype: torch.dtype, bias: bool, seed: int,
                codes: str = "symmetric") -> tuple[Int8GroupLinear, Int8GroupLinear]:
    """The same random layer twice, as built (torch's widening) and for the panels. ``codes``
    (the scales' bytes on the panels in brackets):

    - "symmetric": int8 codes with float16 scales (Q8_0) [2];
    - "zeros": int8 codes with a float32 scale and zero per group (a mixed layer with a Q8_0 part) [4];
    - "below_128": unsigned 6-bit codes with float32 minima (a layer mixing Q5_0 and a K-quant) [4];
    - "minima_16": the same with float16 scales and minima (Q5_1, Q4_1) [2];
    - "centred": unsigned 6-bit codes around 32, no zeros, float16 scales (Q5_0-like) [2];
    - "q6_k": the same with two-level scales (Q6_K: an int8 a group, float32 per super block) [1];
    - "k_quant": unsigned codes with two-level scales and minima (Q4_K, Q5_K in a codes layer) [1]."""
    g = torch.Generator().manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias).to(dtype)
    below_128 = codes != "symmetric" and codes != "zeros"
    if below_128:
        q = torch.randint(0, 64, (n, k), generator=g, dtype=torch.int8)
    else:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    d = (torch.rand(n, k // group, generator=g) * 0.02).half().float()
    z = (torch.rand(n, k // group, generator=g) - 0.5) * 0.5 if codes in ("zeros", "below_128", "minima_16", "k_quant") else None
    if codes == "minima_16":
        z = z.half().float()
    levels = None
    if codes in ("q6_k", "k_quant"):  # super blocks of up to 16 groups (a power of two dividing their number)
        groups = k // group
        per_block = math.gcd(groups, 16)
        outer = (torch.rand(n, groups // per_block, generator=g) * 1e-3).half().float()
        inner = torch.randint(-128 if codes == "q6_k" else 0, 128 if codes == "q6_k" else 64, (n, groups), generator=g, dtype=torch.int8)
        d = outer.repeat_interleave(per_block, dim=1) * inner.float()
        levels = TwoLevelScales(outer, inner)
        if codes == "k_quant":
            dmin = (torch.rand(n, groups // per_block, generator=g) * -1e-3).half().float()
            m = torch.randint(0, 64, (n, groups), generator=g, dtype=torch.int8)
            z = dmin.repeat_interleave(per_block, dim=1) * m.float()
            levels = TwoLevelScales(outer, inner, dmin, m)
    scale_dtype = torch.float16 if codes == "symmetric" else torch.float32
    center = 32 if codes in ("centred", "q6_k") else 0
    return tuple(Int8GroupLinear(layer, q, d, group, scale_dtype, z, below_128, center, levels) for _ in range(2))


def kernel_for(module: Int8GroupLinear, dtype: torch.dtype, build: tuple[str, ...] = ()):
    return group_int8_kernel(dtype, build, below_128=module.below_128)


ALL_CODES = ["symmetric", "zeros", "below_128", "minima_16", "centred", "q6_k", "k_quant"]
SCALE_BYTES = {"symmetric": 2, "zeros": 4, "below_128": 4, "minima_16": 2, "centred": 2, "q6_k": 1, "k_quant": 1}
CODES = pytest.mark.parametrize("codes", ALL_CODES)


@pytest.mark.skipif(not NATIVE, reason="this CPU has no AVX512_BF16 (or no compiler targets it)")
@CODES
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("k,n,rows,group", [(576, 192, 9, 32), (256, 64, 37, 16), (1536, 128, 300, 128), (512, 320, 33, 64)])
def test_bfloat16_panels_equal_the_bfloat16_kernel_on_the_widened_weights(k, n, rows, group, threads, codes):
    """More than 8 rows (unsigned codes below 128: more than 32), bit for bit: each weight widened
    to bf16(q d + z) (weight_as's value), then the bfloat16 panel kernel's own blocks; and within
    rounding of torch's path (F.linear on weight_as)."""
    if codes not in ("symmetric", "zeros") and rows <= 32:
        rows += 32
    from modserve.plugins.platforms.cpu_avx512_linear import Avx512Linear

    torch_path, module = group_layer(k, n, group, torch.bfloat16, False, seed=k + rows, codes=codes)
    assert module.use_panels(kernel_for(module, torch.bfloat16), torch.bfloat16) and module.records
    assert module._layout.scale_bytes == SCALE_BYTES[codes]
    reference = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        reference.weight.copy_(torch_path.weight_as(torch.bfloat16))
    x = torch.randn(rows, k).to(torch.bfloat16)
    with torch_threads(threads):
        got = module(x)
    assert torch.equal(got, Avx512Linear(reference)(x))
    torch.testing.assert_close(got, torch_path(x), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not NATIVE, reason="this CPU has no AVX512_BF16 (or no compiler targets it)")
@pytest.mark.parametrize("rows,codes", [(rows, codes) for codes in ALL_CODES
                                        for rows in (1, 3, 4, 5, 8, *((9, 14, 32) if codes not in ("symmetric", "zeros") else ()))])
@pytest.mark.parametrize("k,n,group,bias", [(576, 208, 32, True), (1536, 128, 128, False), (256, 64, 64, True), (512, 96, 16, False)])
def test_bfloat16_direct_product_is_the_exact_product_rounded_once(k, n, group, bias, rows, codes):
    """Up to 8 rows (unsigned codes below 128: 32, from 9 on as bfloat16 128 + q) the codes are
    multiplied directly (the weights q d + z never rounded; a zero times its group's inputs'
    sum): within one bfloat16 step of the float64 product, with 13 panels (a group of one
    left) and a bias."""
    torch_path, module = group_layer(k, n, group, torch.bfloat16, bias, seed=k + rows, codes=codes)
    assert module.use_panels(kernel_for(module, torch.bfloat16), torch.bfloat16)
    assert module._layout.scale_bytes == SCALE_BYTES[codes]
    x = torch.randn(rows, k).to(torch.bfloat16)
    exact = x.double() @ torch_path.weight_as(torch.float32).double().T
    if bias:
        exact += torch_path.bias.double()
    got = module(x).double()
    assert ((got - exact).abs() <= exact.abs() * 2**-8 + 2e-6 * exact.abs().max()).all()


@needs_avx2
@CODES
@pytest.mark.parametrize("build", [(), ("-mno-avx512f",)], ids=["native", "avx2-width"])
@pytest.mark.parametrize("k,n,rows,group", [(576, 192, 1, 32), (576, 208, 3, 32), (512, 96, 4, 16), (256, 64, 37, 16), (1536, 128, 300, 128)])
def test_float32_panels_equal_torchs_product_with_the_bias(k, n, rows, group, build, codes):
    """float32, up to 4 rows multiplied directly group by group, beyond widened to float32 panels
    (13 panels: a pair's odd one left): the weights q d + z as torch's path computes them, so torch's path to float32 summation order:
    within 1e-5 of the largest output (at K 1,536 the panels' running sums measured 2.0e-6 from
    the float64 product, oneDNN's 3.4e-7)."""
    torch_path, module = group_layer(k, n, group, torch.float32, True, seed=k + rows, codes=codes)
    assert module.use_panels(kernel_for(module, torch.float32, build), torch.float32)
    assert module._layout.scale_bytes == SCALE_BYTES[codes]
    x = torch.randn(rows, k)
    got, want = module(x), torch_path(x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@needs_avx2
def test_shapes_the_panels_cannot_take_keep_torchs_path_and_wrong_rows_are_refused():
    kernel = group_int8_kernel(torch.float32)
    for k, n, group in ((64, 40, 32), (48, 64, 16), (64, 32, 8)):  # N off 16; K off 32; the group off 16
        torch_path, module = group_layer(k, n, group, torch.float32, False, seed=1)
        assert not module.use_panels(kernel, torch.float32) and not module.records
        x = torch.randn(3, k)
        assert torch.equal(module(x), torch_path(x))
    _, module = group_layer(64, 32, 32, torch.float32, False, seed=2)
    assert module.use_panels(kernel, torch.float32)
    with pytest.raises(TypeError, match="Int8GroupLinear on the panel kernels takes float32 rows"):
        module(torch.randn(2, 64).to(torch.bfloat16))


def test_codes_below_128_need_unsigned_codes_and_either_minima_or_a_center():
    layer = nn.Linear(64, 32, bias=False)
    q = torch.randint(0, 64, (32, 64), dtype=torch.int8)
    d, z = torch.rand(32, 2), torch.rand(32, 2)
    message = "Int8GroupLinear: codes below 128 are unsigned, with their minima as zeros or a center"
    for codes, zero, center in ((q, None, 0), (q, z, 32), (q - 40, z, 0)):  # neither; both; negative codes
        with pytest.raises(ValueError, match=message):
            Int8GroupLinear(layer, codes, d, 32, torch.float32, zero, True, center)
    assert Int8GroupLinear(layer, q, d, 32, torch.float32, None, True, 32).center == 32


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("scale_bytes", [4, 2])
def test_group_panels_hold_each_groups_codes_then_its_scales_then_its_zeros(zeros, scale_bytes):
    """The kernels' layout (``GroupPanels``): panel p's group g at byte (p groups + g) x the group's
    bytes, its codes in the panels' pair order (input pair j of output o at 32 j + 2 o), then the
    16 outputs' scales, then their zeros: float16 where all of them are float16 values, else
    float32. A code, scale or zero misplaced here is read for the wrong output or group."""
    from modserve.plugins.platforms.cpu_group_panels import group_panels

    n, k, group = 32, 64, 16
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    d, z = torch.rand(n, k // group), torch.rand(n, k // group)
    if scale_bytes == 2:
        d, z = d.half().float(), z.half().float()
    held, layout = group_panels(q, d, z if zeros else None, group)
    assert (layout.scale_bytes, layout.zeros, layout.super_groups) == (scale_bytes, zeros, 0)
    width = {4: torch.float32, 2: torch.float16}[scale_bytes]
    group_bytes = group * 16 + 16 * scale_bytes * (2 if zeros else 1)
    assert held.shape == (n // 16, k // group, group_bytes) and held.dtype == torch.int8
    for p, g in [(0, 0), (1, 2), (1, 3)]:
        row = held[p, g]
        outputs = q[16 * p:16 * p + 16, g * group:(g + 1) * group]  # [16 outputs][group inputs]
        assert torch.equal(row[:group * 16].view(group // 2, 16, 2), outputs.view(16, group // 2, 2).transpose(0, 1))
        assert torch.equal(row[group * 16:group * 16 + 16 * scale_bytes].view(width).float(), d[16 * p:16 * p + 16, g])
        if zeros:
            assert torch.equal(row[group * 16 + 16 * scale_bytes:].view(width).float(), z[16 * p:16 * p + 16, g])


@pytest.mark.parametrize("zeros", [False, True])
def test_two_level_scales_head_each_super_block_and_take_a_byte_a_group(zeros):
    """The K-quants' two levels: each panel's super block of S groups starts with its 16 outputs'
    float32 outer scales (and outer zeros), then its groups, each its codes and its 16 int8 inner
    scales (and zeros). Levels whose products are not the scales, or S not a power of two, are
    refused by message."""
    from modserve.core.models.gguf_quantized import TwoLevelScales
    from modserve.plugins.platforms.cpu_group_panels import group_panels

    n, k, group, per_block = 32, 256, 16, 4
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    outer, inner = torch.rand(n, 4).half().float(), torch.randint(-128, 128, (n, 16), dtype=torch.int8)
    outer_z, inner_z = -torch.rand(n, 4).half().float(), torch.randint(0, 64, (n, 16), dtype=torch.int8)
    d = outer.repeat_interleave(per_block, dim=1) * inner.float()
    z = outer_z.repeat_interleave(per_block, dim=1) * inner_z.float()
    levels = TwoLevelScales(outer, inner, outer_z if zeros else None, inner_z if zeros else None)
    held, layout = group_panels(q, d, z if zeros else None, group, levels=levels)
    assert (layout.scale_bytes, layout.super_groups) == (1, per_block)
    head, group_bytes = (128 if zeros else 64), group * 16 + (32 if zeros else 16)
    assert held.shape == (n // 16, k // group // per_block, head + per_block * group_bytes)
    for p, b, j in [(0, 0, 0), (1, 2, 3), (1, 3, 1)]:
        block, g, rows = held[p, b], b * per_block + j, slice(16 * p, 16 * p + 16)
        assert torch.equal(block[:64].view(torch.float32), outer[rows, b])
        if zeros:
            assert torch.equal(block[64:128].view(torch.float32), outer_z[rows, b])
        at = head + j * group_bytes
        outputs = q[rows, g * group:(g + 1) * group]
        assert torch.equal(block[at:at + group * 16].view(group // 2, 16, 2), outputs.view(16, group // 2, 2).transpose(0, 1))
        assert torch.equal(block[at + group * 16:at + group * 16 + 16], inner[rows, g])
        if zeros:
            assert torch.equal(block[at + group * 16 + 16:at + group_bytes], inner_z[rows, g])
    with pytest.raises(ValueError, match="group_panels: the two-level scales differ from the scales they stand for"):
        group_panels(q, d + 1, None, group, levels=TwoLevelScales(outer, inner))
    for groups, blocks in ((16, 5), (12, 4)):  # not a whole number of groups a block; 3 a block
        with pytest.raises(ValueError, match="group_panels: two-level scales need a power of two of groups per super block, "
                                             f"got {groups} groups in {blocks} blocks"):
            group_panels(q[:, :groups * group], d[:, :groups], None, group, levels=TwoLevelScales(torch.rand(n, blocks), inner[:, :groups]))


def test_codes_packed_to_6_bits_come_back_as_they_were():
    """pack_6_bits against a reading of its documented layout, per quad of input pairs: bytes 0-31
    the low nibbles of pairs 0 (low half) and 1, bytes 32-63 of pairs 2 and 3, bytes 64-95 the
    four pairs' high two bits (pair s at bits 2s); a code outside [0, 64) or a group too large
    to pack is refused by message."""
    from modserve.plugins.platforms.cpu_group_panels import group_panels, pack_6_bits

    codes = torch.randint(0, 64, (3, 256), dtype=torch.int8)
    packed = pack_6_bits(codes).view(torch.uint8).long().view(3, 2, 3, 32)
    low = torch.stack([packed[:, :, 0] & 15, packed[:, :, 0] >> 4, packed[:, :, 1] & 15, packed[:, :, 1] >> 4], dim=2)
    high = torch.stack([(packed[:, :, 2] >> (2 * s)) & 3 for s in range(4)], dim=2)
    assert torch.equal((low | high << 4).view(3, 256), codes.long())
    q, d = torch.randint(0, 64, (16, 64), dtype=torch.int8), torch.rand(16, 4)
    held, layout = group_panels(q, d, None, 16, packed=True)
    assert held.shape == (1, 4, 16 * 12 + 64) and layout.packed
    assert torch.equal(held[0, 1, :192], pack_6_bits(group_panels(q, d, None, 16)[0][0, 1, :256]))
    with pytest.raises(ValueError, match=r"group_panels: packs codes in \[0, 64\) in groups of at most 32, got 16 and codes in \[64, 64\]"):
        group_panels(q.clone().fill_(64), d, None, 16, packed=True)
