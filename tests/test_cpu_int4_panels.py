"""int4 layers on AVX512_BF16 CPUs without AMX: from ``PANEL_INT4_FROM_ROWS`` rows on, the int4
weights (torch's CPU int4 packing) widened to bfloat16 panels per call and multiplied with
VDPBF16PS (``modserve_avx512_linear_int4``, ``native/int4_panels.h``).

What could go wrong, and is checked here: a weight widened from the wrong nibble, block or
group, the widened value rounded differently from the AMX tiles' (``q s + (z - 8 s)`` in float32,
rounded once), rows past one sweep, and the module taking the wrong product for its row count."""

from __future__ import annotations

import pytest
import torch
from test_cpu_experts import NATIVE
from torch import nn

from modserve.plugins.platforms import cpu_quant
from modserve.plugins.platforms.cpu_quant import Int4WeightOnlyLinear, quantize_groups_int4

pytestmark = pytest.mark.skipif(not NATIVE, reason="this CPU has no AVX512_BF16 (or no compiler targets it)")


def widened(module: Int4WeightOnlyLinear, q: torch.Tensor) -> torch.Tensor:
    """The module's weights as the widening computes them: ``q s + (z - 8 s)`` in float32 from its
    bfloat16 scales and zeros, rounded once to bfloat16 (``q s`` is exact in float32)."""
    sz = module.scales_and_zeros.float()  # [K/g, N, 2]
    s, z = (t.t().repeat_interleave(module.group_size, dim=1) for t in (sz[..., 0], sz[..., 1]))
    return (q.float() * s + (z - 8 * s)).to(torch.bfloat16)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("k,n,rows,group", [(576, 192, 4, 32), (256, 64, 37, 64), (1536, 128, 300, 128), (512, 320, 7, 256)])
def test_the_widened_product_equals_the_bfloat16_panels_on_the_widened_weights(k, n, rows, group, threads):
    """Bit for bit: the widening must give the AMX tiles' bfloat16 weights (every nibble, 64-output
    block and group in its place), and the products then run the bfloat16 panel kernel's blocks."""
    from modserve.plugins.platforms.cpu_avx512_linear import Avx512Linear, int4_product

    torch.manual_seed(k + rows)
    layer = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    module = Int4WeightOnlyLinear(layer, group)
    q, _, _ = quantize_groups_int4(layer.weight, group)
    reference = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        reference.weight.copy_(widened(module, q))
    x = torch.randn(rows, k).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = int4_product(x, module.packed, module.scales_and_zeros, group)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, Avx512Linear(reference)(x))
    want = torch._weight_int4pack_mm_for_cpu(x, module.packed, group, module.scales_and_zeros)  # torch's own kernel
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_the_module_takes_the_panels_from_their_row_count(monkeypatch):
    """``panels`` set: below PANEL_INT4_FROM_ROWS rows torch's int4 kernel (the fastest at one
    row), from there on the widened panels; a bias is added either way."""
    from modserve.plugins.platforms import cpu_avx512_linear

    layer = nn.Linear(256, 128).to(torch.bfloat16)
    module = Int4WeightOnlyLinear(layer, 32)
    module.panels = True
    calls = []
    real = cpu_avx512_linear.int4_product
    monkeypatch.setattr(cpu_avx512_linear, "int4_product", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, cpu_quant.PANEL_INT4_FROM_ROWS - 1, cpu_quant.PANEL_INT4_FROM_ROWS, 40):
        x = torch.randn(rows, 256).to(torch.bfloat16)
        want = torch._weight_int4pack_mm_for_cpu(x, module.packed, 32, module.scales_and_zeros) + layer.bias
        torch.testing.assert_close(module(x), want, rtol=2e-2, atol=2e-2)
    assert calls == [cpu_quant.PANEL_INT4_FROM_ROWS, 40]
