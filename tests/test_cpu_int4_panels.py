"""int4 layers in one native call over torch's CPU int4 packing (``native/int4_panels.h``): in
bfloat16 on AVX512_BF16 CPUs without AMX (``modserve_avx512_linear_int4``: below 8 rows the
nibbles multiplied directly, from 8 rows widened to bfloat16 panels and multiplied with
VDPBF16PS), in float32 on AVX2 (``modserve_avx2_linear_int4``: widened to float32 panels for the
FMA loops; torch's int4 kernel takes a slow path with float32 rows).

What could go wrong, and is checked here: a weight taken from the wrong nibble, 64-output block
or group (either path), the widened value rounded differently from the AMX tiles' (``q s + (z -
8 s)`` in float32, rounded once), the direct path's outputs put back out of order, rows past one
sweep, a bias lost, and an int4 model whose decode steps cannot replay."""

from __future__ import annotations

import pytest
import torch
from test_cpu_experts import NATIVE, TAKES_KERNEL, needs_avx2, torch_threads
from torch import nn

from modserve.plugins.platforms.cpu_quant import Int4WeightOnlyLinear, quantize_groups_int4

needs_bf16 = pytest.mark.skipif(not NATIVE, reason="this CPU has no AVX512_BF16 (or no compiler targets it)")


def widened(module: Int4WeightOnlyLinear, q: torch.Tensor) -> torch.Tensor:
    """The module's weights as the widening computes them: ``q s + (z - 8 s)`` in float32 from its
    bfloat16 scales and zeros, rounded once to bfloat16 (``q s`` is exact in float32)."""
    sz = module.scales_and_zeros.float()  # [K/g, N, 2]
    s, z = (t.t().repeat_interleave(module.group_size, dim=1) for t in (sz[..., 0], sz[..., 1]))
    return (q.float() * s + (z - 8 * s)).to(torch.bfloat16)


@needs_bf16
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("k,n,rows,group", [(576, 192, 8, 32), (256, 64, 37, 64), (1536, 128, 300, 128), (512, 320, 9, 256)])
def test_the_widened_product_equals_the_bfloat16_panels_on_the_widened_weights(k, n, rows, group, threads):
    """From 8 rows, bit for bit: the widening must give the AMX tiles' bfloat16 weights (every
    nibble, 64-output block and group in its place), and the products then run the bfloat16
    panel kernel's blocks."""
    from modserve.plugins.platforms.cpu_avx512_linear import Avx512Linear, int4_product

    torch.manual_seed(k + rows)
    layer = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    module = Int4WeightOnlyLinear(layer, group)
    q, _, _ = quantize_groups_int4(layer.weight, group)
    reference = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        reference.weight.copy_(widened(module, q))
    x = torch.randn(rows, k).to(torch.bfloat16)
    with torch_threads(threads):
        got = int4_product(x, module.packed, module.scales_and_zeros, group)
    assert torch.equal(got, Avx512Linear(reference)(x))
    want = torch._weight_int4pack_mm_for_cpu(x, module.torch_packed(), group, module.scales_and_zeros)  # torch's own kernel
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("k,n,group", [(576, 192, 32), (256, 64, 256), (1536, 128, 128)])
def test_the_direct_product_equals_the_exact_int4_product(k, n, group, rows):
    """Below 8 rows, where nothing is widened to memory: the output is the float32 product with
    the unrounded weights ``(q - 8) s + z`` (and the bias), rounded once to bfloat16, so within
    one bfloat16 step of it; blocks of 4 rows and the remainders of 1 to 3."""
    from modserve.plugins.platforms.cpu_avx512_linear import int4_product

    torch.manual_seed(k + rows)
    layer = nn.Linear(k, n).to(torch.bfloat16)
    module = Int4WeightOnlyLinear(layer, group)
    q, _, _ = quantize_groups_int4(layer.weight, group)
    sz = module.scales_and_zeros.float()
    s, z = (t.t().repeat_interleave(group, dim=1) for t in (sz[..., 0], sz[..., 1]))
    x = torch.randn(rows, k).to(torch.bfloat16)
    exact = x.float() @ ((q.float() - 8) * s + z).T + layer.bias.float()
    got = int4_product(x, module.packed, module.scales_and_zeros, group, layer.bias.float())
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -8, atol=1e-4)


@needs_avx2
@pytest.mark.parametrize("build", [(), ("-mno-avx512f",)], ids=["native", "avx2-width"])
@pytest.mark.parametrize("k,n,rows,group", [(576, 192, 1, 32), (576, 320, 2, 64), (256, 64, 37, 64), (576, 192, 127, 32),
                                              (1536, 128, 300, 128), (512, 320, 5, 256), (256, 128, 13, 32), (576, 192, 24, 32),
                                              (576, 192, 25, 32)])
def test_the_float32_product_equals_torchs_int4_kernel(k, n, rows, group, build):
    """float32 rows (both widths): the nibbles multiplied directly (up to 24 rows 512 bits wide,
    in blocks of 6 rows: 13 = 6 + 6 + 1; 2 rows at the AVX2 width), the weights widened to float32
    panels (beyond, below INT4_LIBRARY_FROM_ROWS rows), or to a plain matrix for torch's product
    (from it: 300 rows),
    give torch's own float32 int4 product (the weights in float32, never rounded to bfloat16) to
    float32 summation order, with the bias, into a new tensor or a column slice of a wider one."""
    from modserve.plugins.platforms.cpu_avx2_linear import INT4_LIBRARY_FROM_ROWS, int4_product

    assert 127 < INT4_LIBRARY_FROM_ROWS <= 300  # both sides of it above
    torch.manual_seed(k + rows)
    layer = nn.Linear(k, n)
    module = Int4WeightOnlyLinear(layer, group)
    x = torch.randn(rows, k)
    want = torch._weight_int4pack_mm_for_cpu(x, module.torch_packed(), group, module.scales_and_zeros) + layer.bias
    got = int4_product(x, module.packed, module.scales_and_zeros, group, layer.bias.detach(), build)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    wide = torch.full((rows, n + 64), float("nan"))
    int4_product(x, module.packed, module.scales_and_zeros, group, layer.bias.detach(), build, out=wide[:, 32 : 32 + n])
    torch.testing.assert_close(wide[:, 32 : 32 + n], want, rtol=1e-5, atol=1e-5)
    assert wide[:, :32].isnan().all() and wide[:, 32 + n :].isnan().all()  # nothing written beside its columns


@pytest.mark.parametrize(
    "dtype",
    [pytest.param("bfloat16", marks=needs_bf16), pytest.param("float32", marks=needs_avx2)],
)
def test_an_int4_model_replays_its_decode_steps_with_the_eager_tokens(tmp_path, dtype):
    """``quantization: int4`` on a bfloat16 checkpoint, served in bfloat16 or in float32: every
    projection one native call, so decode steps of 1-4 requests replay as call lists, with the
    eager engine's greedy tokens (a GGUF file's Q4 layers are the same modules). On an AMX CPU
    bfloat16 int4 layers take torch's int4 kernel and the AMX tiles instead (faster from 8
    rows): no call lists, and the tokens still the eager engine's."""
    from test_cpu_experts import engine
    from tiny_models import build_model, prompts

    from modserve import SamplingParams

    hf = build_model(str(tmp_path), "llama", intermediate_size=128, hidden_size=64)
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path))  # float32: its head on the bfloat16-held panels
    ps = prompts(hf.config.vocab_size, count=5, seed=6)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 9, 12, 20)]
    llm = engine(str(tmp_path), dtype, quantization="int4", int4_group_size=32)
    model = llm.engine.runner.model
    int4 = [m for m in model.modules() if isinstance(m, Int4WeightOnlyLinear)]
    panels = dtype == "float32" or TAKES_KERNEL  # bfloat16 on AMX: the tiles
    assert len(int4) == 4 * len(model.layers) and all(m.records == panels for m in int4)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]
    graphs = llm.engine.runner.graphs
    if panels:
        assert graphs is not None and all(graphs.replays[s] > 0 for s in graphs.sizes), graphs and graphs.replays
    else:
        assert graphs is None  # a linear through torch: the platform captures nothing
    eager = engine(str(tmp_path), dtype, graphs=False, quantization="int4", int4_group_size=32)
    assert [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in ps], params)] == got


@needs_avx2
@pytest.mark.parametrize("options,library_from", [({}, 128), ({"graph_max_batch": 200}, 201), ({"decode_graphs": False}, 128)])
def test_int4_layers_take_onednns_product_only_past_the_recorded_decode_batches(monkeypatch, on_an_intel_cpu, options, library_from):
    """A call list cannot replay oneDNN's product, and one such step would turn every decode list
    off: the platform moves a float32 int4 layer's switch to that product past its largest
    recorded decode batch, and below the switch the layer never widens to a plain matrix. (On an
    Intel CPU: AMD's up to Zen 4 keep the panels at every row count.)"""
    from modserve.plugins.platforms import cpu, cpu_avx2_linear

    platform = cpu.CPUPlatform(cpu.CPUConfig(quantization="int4", **options), None)
    torch.manual_seed(0)
    module = platform.linear("layers.0.mlp.down_proj", nn.Linear(256, 64))
    assert isinstance(module, Int4WeightOnlyLinear) and module.records and module.library_from_rows == library_from
    widened = []
    real = cpu_avx2_linear.int4_widened
    monkeypatch.setattr(cpu_avx2_linear, "int4_widened", lambda *a, **k: widened.append(1) or real(*a, **k))
    for rows in (library_from - 1, library_from):
        x = torch.randn(rows, 256)
        want = torch._weight_int4pack_mm_for_cpu(x, module.torch_packed(), module.group_size, module.scales_and_zeros.float()) + module._bias32
        torch.testing.assert_close(module(x), want, rtol=1e-5, atol=1e-5)
    assert widened == [1]  # only at library_from rows
