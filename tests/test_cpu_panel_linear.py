"""bfloat16 linears on the cpu platform's own kernels over packed panels (``device:
{linear_kernel: auto | amx | avx512bf16 | onednn}``): AMX tiles and AVX512_BF16's VDPBF16PS.
Each kernel's products equal float32 products of the same bfloat16 values to within one
rounding, for any row count and shape, gated or not; the engine serves the same tokens as with
oneDNN's products; ``auto`` takes AMX, else AVX512_BF16, else oneDNN; asking for a kernel where
it cannot run is refused by name. A kernel's tests run where the CPU has its instructions; the
configuration tests run everywhere."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from modserve import LLM, SamplingParams
from modserve.plugins.platforms import cpu, cpu_amx_linear, cpu_avx512_linear
from modserve.plugins.platforms.cpu_linear import PackedLinear, can_pack

HAS_AMX = cpu.amx_unavailable(cpu_amx_linear.load) is None
HAS_AVX512_BF16 = cpu.avx512_bf16_unavailable() is None
KERNELS = [
    pytest.param("amx", marks=pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-BF16 (or no compiler targets it)")),
    pytest.param(
        "avx512bf16", marks=pytest.mark.skipif(not HAS_AVX512_BF16, reason="this CPU has no AVX512_BF16 (or no compiler targets it)")
    ),
]
MODULES = {"amx": cpu_amx_linear.AmxLinear, "avx512bf16": cpu_avx512_linear.Avx512Linear}


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> int:
    """Largest distance in bfloat16 steps between two bfloat16 tensors (same-sign values)."""
    return int((got.view(torch.int16).int() - want.view(torch.int16).int()).abs().max())


def test_the_avx512_bf16_kernel_builds_where_the_cpu_has_avx512_bf16():
    """On a CPU with AVX512_BF16 the kernel compiles and loads: a compile error must fail here,
    not quietly skip the kernel tests (and leave the platform on oneDNN)."""
    if "avx512_bf16" not in cpu.cpu_model_and_flags()[1]:
        pytest.skip("this CPU has no AVX512_BF16")
    why = cpu.avx512_bf16_unavailable()
    assert why is None or "does not target" in why, why


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 15, 16, 17, 31, 32, 33, 64, 100, 257, 300])
@pytest.mark.parametrize("n,k", [(960, 576), (40, 1536), (100, 50), (16, 32), (33, 96), (70, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_products_are_float32_sums_rounded_once(kernel, rows, n, k, bias):
    """Against the float32 product of the same bfloat16 values, rounded to bfloat16: at most
    one step apart (the sums' order differs), for row counts off and on the kernels' blocks
    (AMX: 16 and 32 rows; AVX-512: 6 rows by 4 panels), outputs off the 16-wide panels and
    inputs off the 32-wide tiles (an odd count too)."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    want = (x.float() @ lin.weight.float().T + (lin.bias.float() if bias else 0)).to(torch.bfloat16)
    got = MODULES[kernel](lin)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert bf16_ulps(got[want.abs() > 1e-2], want[want.abs() > 1e-2]) <= 1
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 5, 7, 16, 33, 300])
@pytest.mark.parametrize("inter", [48, 64])
def test_gated_product_equals_the_fused_silu_mul_of_the_plain_product(kernel, rows, inter):
    """enable_silu_mul: the layer returns bf16(bf16(silu(gate)) * up) of its own rounded
    outputs, what the fused op computes from the plain product (at most one bfloat16 step
    apart: exp and division lane-wise instead of in the compiler's loop); an odd and an even
    count of (gate, up) panel pairs."""
    from modserve.core.models import cpu_fused

    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(96, 2 * inter, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(2 * inter, 96, generator=g))
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    layer = MODULES[kernel](lin)
    want = cpu_fused.silu_mul(layer(x))
    assert layer.enable_silu_mul() and layer.enable_silu_mul()  # once enabled, stays so
    got = layer(x)
    assert got.shape == (rows, inter)
    assert bf16_ulps(got, want) <= 1
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("kernel", KERNELS)
def test_gated_product_is_declined_where_the_halves_do_not_split_into_panels(kernel):
    odd = MODULES[kernel](nn.Linear(64, 2 * 40, bias=False).to(torch.bfloat16))  # 40 is not a multiple of 16
    biased = MODULES[kernel](nn.Linear(64, 2 * 32, bias=True).to(torch.bfloat16))
    assert not odd.enable_silu_mul() and not biased.enable_silu_mul()
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert odd(x).shape == (3, 80) and biased(x).shape == (3, 64)  # plain products still


@pytest.mark.parametrize("kernel", KERNELS)
def test_strided_and_batched_inputs_and_no_rows(kernel):
    """q/k/v-style views (rows further apart than K), 3-D inputs and an empty batch."""
    lin = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    module = MODULES[kernel](lin)
    wide = torch.randn(7, 200).to(torch.bfloat16)
    view = wide[:, 10:74]  # stride 200 between rows
    torch.testing.assert_close(module(view), lin(view.contiguous()), atol=2e-2, rtol=1e-2)
    x3 = torch.randn(2, 5, 64).to(torch.bfloat16)
    assert module(x3).shape == (2, 5, 48)
    torch.testing.assert_close(module(x3), lin(x3), atol=2e-2, rtol=1e-2)
    assert module(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 48)
    with pytest.raises(TypeError, match=f"{type(module).__name__} takes bfloat16 inputs, got torch.float32"):
        module(torch.randn(2, 64))
    with pytest.raises(ValueError, match=rf"{type(module).__name__}: inputs of 64 features, got shape \(4, 32\)"):
        module(torch.randn(4, 32).to(torch.bfloat16))


@pytest.mark.parametrize("kernel", KERNELS)
def test_any_row_count_keeps_memory_flat(kernel):
    """Nothing is kept per row count (oneDNN keeps a primitive per shape, hence its padding)."""
    lin = MODULES[kernel](nn.Linear(576, 1536, bias=False).to(torch.bfloat16))

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    rng = random.Random(0)
    for m in range(1, 200):
        lin(torch.randn(m, 576).to(torch.bfloat16))
    before = rss_mb()
    for _ in range(200):
        lin(torch.randn(rng.randrange(1, 1500), 576).to(torch.bfloat16))
    assert rss_mb() - before < 40


@pytest.mark.parametrize("kernel", KERNELS)
def test_engine_serves_the_same_tokens_as_with_onednn(tiny_llama, kernel):
    """A bfloat16 engine on the kernel; its greedy tokens match the oneDNN engine's (mixed
    batch: a lone decode row and prefill chunks of odd lengths), its SwiGLU MLPs gated."""
    path, _ = tiny_llama
    outs = {}
    for name in (kernel, "onednn"):
        llm = LLM(
            model={"path": path, "dtype": "bfloat16"}, device={"plugin": "cpu", "linear_kernel": name},
            kv_cache={"plugin": "paged", "num_blocks": 64}, scheduler={"plugin": "fcfs", "max_num_batched_tokens": 40},
        )  # fmt: skip
        model = llm.engine.c.runner.model
        kinds = {type(m) for m in model.modules()}
        assert (MODULES[kernel] in kinds) is (name == kernel) and (PackedLinear in kinds) is (name == "onednn")
        assert all(layer.mlp.gated_product is (name == kernel) for layer in model.layers)  # silu(gate) * up in the kernel
        outs[name] = llm.generate(
            [[3, 4, 5, 6], [9] * 37, list(range(20, 73))],
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1),
        )
    agree = total = 0
    for a, b in zip(outs[kernel], outs["onednn"]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        total += len(ta)
        agree += sum(x == y for x, y in zip(ta, tb))
        assert ta[:4] == tb[:4]  # bf16 rounding may flip a near-tie later on, never at once
    assert agree / total >= 0.9


def _linear_types(path: str, dtype: str = "bfloat16", **device) -> set[type]:
    llm = LLM(model={"path": path, "dtype": dtype}, device={"plugin": "cpu", **device}, kv_cache={"plugin": "paged", "num_blocks": 64})
    return {type(m) for m in llm.engine.c.runner.model.modules()}


def test_auto_takes_amx_then_avx512_bf16_then_onednn(monkeypatch, tiny_llama):
    """``auto`` by the CPU's flags: AMX where it has AMX-BF16, the VDPBF16PS kernel where it has
    AVX512_BF16 only, oneDNN below; float32 models keep oneDNN everywhere."""
    path, _ = tiny_llama
    flags = cpu.cpu_model_and_flags()[1]
    if HAS_AMX:
        assert cpu_amx_linear.AmxLinear in _linear_types(path)
    if HAS_AVX512_BF16:
        monkeypatch.setattr(cpu, "cpu_model_and_flags", lambda: ("a CPU without AMX", flags - {"amx_bf16"}))
        assert cpu_avx512_linear.Avx512Linear in _linear_types(path)
        assert PackedLinear in _linear_types(path, "float32") and cpu_avx512_linear.Avx512Linear not in _linear_types(path, "float32")
    monkeypatch.setattr(cpu, "cpu_model_and_flags", lambda: ("an AVX2 CPU", frozenset({"avx2", "avx512f"})))
    types = _linear_types(path)
    assert not types & set(MODULES.values())
    platform = cpu.CPUPlatform(cpu.CPUConfig(), None)
    assert platform.float_kernel == "onednn" and platform.info().kernels[0] == "linears: oneDNN packed"


@pytest.mark.skipif(not HAS_AVX512_BF16, reason="this CPU has no AVX512_BF16")
def test_the_platform_names_the_avx512_bf16_kernel(monkeypatch):
    """``bench roofline``'s Chose: line (``DeviceInfo.kernels``)."""
    monkeypatch.setattr(cpu, "cpu_model_and_flags", lambda: ("a CPU without AMX", frozenset({"avx512f", "avx512_bf16"})))
    info = cpu.CPUPlatform(cpu.CPUConfig(), None).info()
    assert info.kernels[0] == "linears: AVX512_BF16 panels in bfloat16, oneDNN packed in float32"
    assert info.kernels[1] == "mixtures of experts: one call a layer (AVX512_BF16 in bfloat16), else torch's grouped products"


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_named_kernel_refuses_a_float32_model(tiny_llama, kernel):
    """Asked for explicitly, a kernel is never swapped for oneDNN behind the user's back."""
    path, _ = tiny_llama
    with pytest.raises(Exception, match=rf"device\.linear_kernel: {kernel} runs bfloat16 weights, not torch\.float32; use auto or onednn"):
        LLM(model={"path": path, "dtype": "float32"}, device={"plugin": "cpu", "linear_kernel": kernel})


def test_a_named_kernel_is_refused_where_it_cannot_run(monkeypatch, tiny_llama):
    path, _ = tiny_llama
    monkeypatch.setattr(cpu, "cpu_model_and_flags", lambda: ("a CPU without AMX", frozenset({"avx2", "avx512f"})))
    with pytest.raises(Exception, match=r"device\.linear_kernel: amx cannot run here: this CPU \(a CPU without AMX\) has no AMX-BF16"):
        LLM(model={"path": path}, device={"plugin": "cpu", "linear_kernel": "amx"})
    with pytest.raises(Exception, match=r"device\.linear_kernel: avx512bf16 cannot run here: this CPU \(a CPU without AMX\) has no AVX512_BF16"):
        LLM(model={"path": path}, device={"plugin": "cpu", "linear_kernel": "avx512bf16"})
    for kernel in ("amx", "avx512bf16"):
        with pytest.raises(Exception, match=rf"device\.linear_kernel: {kernel} packs the weights; it cannot go with pack_weights: false"):
            LLM(model={"path": path}, device={"plugin": "cpu", "linear_kernel": kernel, "pack_weights": False})
    with pytest.raises(Exception, match=r"device\.linear_kernel: expected one of auto, amx, avx512bf16, avx2, onednn, got 'mkl'"):
        LLM(model={"path": path}, device={"plugin": "cpu", "linear_kernel": "mkl"})


def test_auto_warns_and_falls_back_where_the_avx512_bf16_kernel_does_not_build(monkeypatch, tiny_llama, caplog):
    """A CPU with AVX512_BF16 whose compiler fails on the kernel: ``auto`` takes oneDNN and a
    warning says why; named, the kernel is refused with the compiler's reason."""
    from modserve.native.build import KernelUnavailable

    def broken():
        raise KernelUnavailable("compiling the AVX512_BF16 linear kernel failed (test)")

    monkeypatch.setattr(cpu, "cpu_model_and_flags", lambda: ("a Zen 5", frozenset({"avx512f", "avx512_bf16"})))
    monkeypatch.setattr(cpu_avx512_linear, "load", broken)
    path, _ = tiny_llama
    with caplog.at_level("WARNING", logger="modserve.platform"):
        types = _linear_types(path)
    assert (PackedLinear in types) is can_pack(torch.device("cpu"), torch.bfloat16) and not types & set(MODULES.values())
    assert "device.linear_kernel auto: compiling the AVX512_BF16 linear kernel failed (test)" in caplog.text
    with pytest.raises(Exception, match=r"device\.linear_kernel: avx512bf16 cannot run here: compiling the AVX512_BF16 linear kernel failed \(test\)"):
        LLM(model={"path": path}, device={"plugin": "cpu", "linear_kernel": "avx512bf16"})
