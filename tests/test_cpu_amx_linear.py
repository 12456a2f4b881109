"""Quantized products on AMX tiles (int4 and int8 weights widened to bfloat16 tiles, W8A8 on
AMX-INT8 tiles): each within its stated bound of the exact product, engines on tiles against
torch's and oneDNN's kernels; every AMX kernel builds where the CPU has AMX. The bfloat16
products on tiles are tested with the AVX512_BF16 kernel's in test_cpu_panel_linear.py. The
kernel tests run where the CPU has AMX-BF16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modserve import LLM, SamplingParams
from modserve.plugins.platforms import cpu, cpu_amx_linear
from tiny_models import teacher_forced

HAS_AMX = cpu.amx_unavailable(cpu_amx_linear.load) is None
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-BF16 (or no compiler targets it)")


def test_the_amx_kernels_build_where_the_cpu_has_amx():
    """On an AMX CPU every AMX kernel compiles and loads, or says the compiler cannot target
    AMX or Linux refused the tile state: a compile error must fail here, not quietly skip the
    kernel tests below (and leave the platform on its fallbacks)."""
    from modserve.plugins.attention import cpu_amx_prefill
    from modserve.plugins.platforms import cpu_amx_int8

    if "amx_bf16" not in cpu.cpu_model_and_flags()[1]:
        pytest.skip("this CPU has no AMX-BF16")
    for load in (cpu_amx_linear.load, cpu_amx_int8.load, cpu_amx_prefill.load):
        why = cpu.amx_unavailable(load)
        assert why is None or "does not target" in why or "refused" in why, why


def small_bf16_layer(n: int, k: int, seed: int) -> tuple[nn.Linear, torch.Generator]:
    """A bfloat16 layer with weights of a trained model's size (std 0.05) and a bias, and the
    generator that made it (for the inputs)."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(n, generator=g))
    return lin, g


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> int:
    """Largest distance in bfloat16 steps between two bfloat16 tensors (same-sign values)."""
    return int((got.view(torch.int16).int() - want.view(torch.int16).int()).abs().max())


@needs_amx
@pytest.mark.parametrize("rows", [8, 16, 37, 64, 300])
@pytest.mark.parametrize("n,k,group", [(960, 576, 64), (64, 128, 32), (128, 256, 128)])
def test_int4_on_tiles_equals_the_product_of_its_widened_weights(monkeypatch, rows, n, k, group):
    """From 8 bfloat16 rows on an int4 layer widens its weights to bfloat16 tiles (each
    ``q * s + (z - 8 s)`` in float32, rounded once) and multiplies on AMX: at most one
    bfloat16 step from the float32 product of those widened weights, rounded once, and within
    the int4 module's stated bound of torch's int4 kernel."""
    from modserve.plugins.platforms.cpu_quant import Int4WeightOnlyLinear

    lin, g = small_bf16_layer(n, k, seed=rows + n + k)
    module = Int4WeightOnlyLinear(lin, group)
    calls = []
    real = cpu_amx_linear.int4_product
    monkeypatch.setattr(cpu_amx_linear, "int4_product", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    on_cpu_kernel = module(x)
    module.amx = True
    got = module(x)
    assert len(calls) == 1 and got.shape == (rows, n) and got.dtype == torch.bfloat16
    q, sz = _int4_codes(module, n, k), module.scales_and_zeros.float()  # [K/g, N, 2]
    s, z = sz[..., 0].t().repeat_interleave(group, 1), sz[..., 1].t().repeat_interleave(group, 1)
    widened = (q * s + (z - 8 * s)).to(torch.bfloat16)
    want = (x.float() @ widened.float().T).to(torch.bfloat16).float().add(lin.bias.float()).to(torch.bfloat16)
    big = want.abs() > 1e-2
    assert bf16_ulps(got[big], want[big]) <= 2  # the product's rounding, then the bias added in bfloat16
    assert ((got.float() - on_cpu_kernel.float()).abs().max() / on_cpu_kernel.float().abs().max()) <= 1.5e-2


def _int4_codes(module, n: int, k: int) -> torch.Tensor:
    """The 4-bit codes torch packed, read back through its own kernel on the identity."""
    eye = torch.eye(k, dtype=torch.float32)
    ones = torch.stack([torch.ones(k // module.group_size, n), torch.zeros(k // module.group_size, n)], -1)
    return torch._weight_int4pack_mm_for_cpu(eye, module.torch_packed(), module.group_size, ones).t() + 8  # (q - 8) * 1 + 0


@needs_amx
@pytest.mark.parametrize("rows", [1, 3, 16, 37, 64, 300])
@pytest.mark.parametrize("n,k", [(1536, 576), (576, 1536), (48, 100), (33, 64)])
def test_w8a8_on_int8_tiles_equals_the_exact_int8_product(rows, n, k):
    """W8A8 on AMX-INT8 tiles quantizes each row as ``quantize_rows_int8`` does and sums
    int8 products exactly: within two bfloat16 steps of ``s_x s_w (q_x . q_w) + b`` computed
    in float32 and rounded once (the scales are applied in another order), for row counts
    off the tiles and K off the 64-input tiles; strided and 3-D inputs give the same rows."""
    from modserve.plugins.platforms.cpu_quant import W8A8Linear, quantize_per_channel_int8, quantize_rows_int8

    lin, g = small_bf16_layer(n, k, seed=rows * 7 + n)
    module = W8A8Linear(lin, amx=True)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    got = module(x)
    q, s = quantize_per_channel_int8(lin.weight)
    qx, sx = quantize_rows_int8(x)
    exact = qx.double() @ q.double().t()  # int32 sums exceed float32's 24 bits
    want = (exact * sx.double() * s.double() + lin.bias.double()).to(torch.bfloat16)
    big = want.abs() > 1e-2
    assert got.dtype == torch.bfloat16 and bf16_ulps(got[big], want[big]) <= 2
    wide = torch.randn(rows, 2 * k, generator=g).to(torch.bfloat16)
    wide[:, ::2] = x
    assert torch.equal(module(wide[:, ::2]), got)
    assert torch.equal(module(x.view(1, rows, k))[0], got)


@needs_amx
@pytest.mark.parametrize("rows", [1, 2, 16, 37, 300])
@pytest.mark.parametrize("n,k", [(1536, 576), (576, 1536), (33, 64)])
def test_int8_weights_on_tiles_equal_the_exact_product(rows, n, k):
    """int8 weight-only on AMX (the codes widened exactly to bfloat16; one row by the float32
    FMA loop, more on tiles): within two bfloat16 steps of ``s (x . q) + b`` computed exactly and
    rounded once, with the scales kept in float32."""
    from modserve.plugins.platforms.cpu_quant import Int8WeightOnlyLinear, quantize_per_channel_int8

    lin, g = small_bf16_layer(n, k, seed=rows * 5 + n)
    module = Int8WeightOnlyLinear(lin, amx=True)
    assert module.amx and not hasattr(module, "qweight")  # one copy of the codes, in the tiles' order
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    got = module(x)
    q, s = quantize_per_channel_int8(lin.weight)
    want = ((x.double() @ q.double().t()) * s.double() + lin.bias.double()).to(torch.bfloat16)
    big = want.abs() > 1e-2
    assert got.shape == (rows, n) and bf16_ulps(got[big], want[big]) <= 2


@needs_amx
@pytest.mark.parametrize("scheme", ["w8a8", "int8", "int4"])
def test_quantized_engines_on_tiles_stay_with_the_oneDNN_and_torch_kernels(tiny_llama, scheme):
    """``quantization: w8a8 / int8 / int4`` in bfloat16: on AMX tiles (auto) against oneDNN's
    int8 product and torch's int8 and int4 kernels (onednn), teacher-forced over the same
    sequences (prefill chunks of up to 40 rows, int4 on tiles from 8): top-1 agreement >= 95%,
    logprobs within 0.3 nats, 0.05 on average (the two apply scales or round widened weights
    differently; measured for int4: 98.9%, 0.09, 0.014). One decode row (int8: the FMA loop)
    gives the same first tokens."""
    from modserve.plugins.platforms.cpu_quant import Int4WeightOnlyLinear, Int8WeightOnlyLinear, W8A8Linear

    kind = {"w8a8": W8A8Linear, "int8": Int8WeightOnlyLinear, "int4": Int4WeightOnlyLinear}[scheme]
    path, _ = tiny_llama
    seqs = [[3, 4, 5, 6] * 5, [9] * 37, list(range(20, 73)), list(range(100, 180))]
    preds, decoded = {}, {}
    for kernel in ("auto", "onednn"):
        llm = LLM(
            model={"path": path, "dtype": "bfloat16"}, kv_cache={"plugin": "paged", "num_blocks": 64},
            device={"plugin": "cpu", "linear_kernel": kernel, "quantization": scheme, **({"int4_group_size": 32} if scheme == "int4" else {})},
            scheduler={"plugin": "fcfs", "max_num_batched_tokens": 40},
        )  # fmt: skip
        layers = [m for m in llm.engine.c.runner.model.modules() if isinstance(m, kind)]
        assert layers and all(m.amx is (kernel == "auto") for m in layers)
        preds[kernel] = teacher_forced(llm, seqs)
        outs = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        decoded[kernel] = outs[0].outputs[0].token_ids
    pairs = list(zip(preds["auto"], preds["onednn"]))
    nats = [abs(a[1] - b[1]) for a, b in pairs]
    assert sum(a[0] == b[0] for a, b in pairs) / len(pairs) >= 0.95
    assert max(nats) <= 0.3 and sum(nats) / len(nats) <= 0.05
    assert decoded["auto"][:3] == decoded["onednn"][:3]


@needs_amx
def test_the_platform_names_the_quantized_kernels_it_chose():
    """``bench roofline``'s Chose: line (``DeviceInfo.kernels``) says where W8A8 and int4 run."""
    def kernels(**options):
        return cpu.CPUPlatform(cpu.CPUConfig(**options), None).info().kernels

    assert kernels()[1:] == (  # bfloat16 experts: oneDNN's tiles (faster at prefill)
        "mixtures of experts: one call a layer (float32 FMAs over bfloat16-held experts where exact), else torch's grouped products",
    )
    assert kernels(quantization="w8a8")[1] == "quantized linears (w8a8): AMX-INT8 tiles in bfloat16, oneDNN int8 in float32"
    assert kernels(quantization="w8a8", linear_kernel="onednn")[1] == "quantized linears (w8a8): oneDNN int8"
    assert kernels(quantization="int4")[1] == (  # float32 models: the panels over bfloat16-held weights
        "quantized linears (int4): int4 and group-scaled int8 (Q8_0, Q6_K, Q5_x) layers: one native call on the panel "
        "kernels in float32 where their shapes fit; torch's int4 kernel, AMX tiles from 8 bfloat16 rows")
    assert kernels(quantization="int4", linear_kernel="amx")[1] == (  # float32 models on oneDNN
        "quantized linears (int4): torch's int4 kernel, AMX tiles from 8 bfloat16 rows")


@needs_amx
def test_w8a8_keeps_onednn_where_the_int8_tile_kernel_does_not_build(monkeypatch, tiny_llama, caplog):
    """The AMX-INT8 kernel is a build of its own: where it fails, W8A8 layers take oneDNN's
    int8 product and a warning says why; the bfloat16 layers stay on tiles."""
    from modserve.native.build import KernelUnavailable
    from modserve.plugins.platforms import cpu_amx_int8
    from modserve.plugins.platforms.cpu_quant import W8A8Linear

    def broken():
        raise KernelUnavailable("compiling the AMX int8 linear kernel failed (test)")

    monkeypatch.setattr(cpu_amx_int8, "load", broken)
    path, _ = tiny_llama
    with caplog.at_level("WARNING", logger="modserve.platform"):
        llm = LLM(model={"path": path, "dtype": "bfloat16"}, device={"plugin": "cpu", "quantization": "w8a8"},
                  kv_cache={"plugin": "paged", "num_blocks": 64})
    layers = [m for m in llm.engine.c.runner.model.modules() if isinstance(m, W8A8Linear)]
    assert layers and not any(m.amx for m in layers)
    assert "W8A8 layers use oneDNN's int8 product" in caplog.text and "failed (test)" in caplog.text
    assert isinstance(llm.engine.c.runner.model.lm_head, cpu_amx_linear.AmxLinear)
