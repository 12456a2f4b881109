"""float32 linears over bfloat16-held weights (``device: {linear_kernel: auto | avx2}``): a
bfloat16 checkpoint served in float32 reads half the weight bytes, for the same sums.

The kernel's products equal ``F.linear``'s on the same float32 values up to summation order,
for any row count and shape, gated or not; a served bfloat16 checkpoint gives HF float32's
greedy tokens, and its decode steps replay as call lists (oneDNN's float32 product cannot);
``auto`` takes the kernel wherever it runs, only for layers bfloat16 holds exactly; every misuse
is refused by name. Kernel tests run where the CPU has AVX2 and FMA, in the native build (AVX-512
wide where the CPU has it) and the AVX2-wide one."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modserve import LLM, SamplingParams
from modserve.plugins.platforms import cpu, cpu_avx2_linear, cpu_linear
from modserve.plugins.platforms.cpu_avx2_linear import Avx2Linear, exact_in_bfloat16
from modserve.plugins.platforms.cpu_linear import PackedLinear
from tiny_models import build_model, hf_greedy, prompts

HAS_AVX2 = cpu.avx2_unavailable() is None
needs_avx2 = pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2 and FMA (or no compiler targets them)")
AVX2_ONLY = ("an AVX2 EPYC", frozenset({"avx2", "fma"}))


# Builds of the kernel: "native" (-march=native: AVX-512 wide on an AVX-512 CPU) and "avx2"
# (-mno-avx512f: the 256-bit loops, which an AVX-512 CPU would not run otherwise).
BUILDS = {"native": (), "avx2": ("-mno-avx512f",)}


@pytest.fixture(params=list(BUILDS))
def build(request, monkeypatch):
    """Layers built in the test use the kernel of this build."""
    flags = BUILDS[request.param]
    if flags:
        load, widen_entry = cpu_avx2_linear.load, cpu_avx2_linear.widen_entry
        monkeypatch.setattr(cpu_avx2_linear, "load", lambda extra=(): load(extra or flags))
        monkeypatch.setattr(cpu_avx2_linear, "widen_entry", lambda symbol, argtypes, extra=(): widen_entry(symbol, argtypes, extra or flags))
    return request.param


def bf16_weights(n: int, k: int, bias: bool, seed: int) -> nn.Linear:
    """A float32 layer whose weights are bfloat16 values (as a bfloat16 checkpoint's are)."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g).to(torch.bfloat16).float())
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin


def test_the_kernel_builds_where_the_cpu_has_avx2_and_fma():
    """A compile error must fail here, not quietly skip the kernel tests."""
    if not {"avx2", "fma"} <= cpu.cpu_model_and_flags()[1]:
        pytest.skip("this CPU has no AVX2 and FMA")
    why = cpu.avx2_unavailable()
    assert why is None or "does not target" in why, why


def test_exact_in_bfloat16():
    w = torch.randn(8, 8)
    assert not exact_in_bfloat16(w)
    assert exact_in_bfloat16(w.to(torch.bfloat16).float()) and exact_in_bfloat16(w.to(torch.bfloat16))


@needs_avx2
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 13, 16, 97, 200])
@pytest.mark.parametrize("n,k", [(960, 576), (40, 1536), (100, 50), (16, 32), (33, 96), (70, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_products_equal_float32_products_of_the_same_weights(rows, n, k, bias, build):
    """Row counts off and on the blocks (5 rows AVX2-wide, 12 AVX-512-wide, two panels a block
    from 4 rows there; a 96-row sweep), outputs off the 16-wide panels and an odd count of
    panels, inputs off the 32-wide tiles (an odd count too): float32 sums in another order."""
    lin = bf16_weights(n, k, bias, rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = Avx2Linear(lin)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), atol=1e-4 * k**0.5, rtol=1e-5)


@needs_avx2
@pytest.mark.parametrize("n,k", [(960, 576), (70, 33), (33, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_many_rows_widen_the_panels_for_onednns_float32_product(n, k, bias, build, monkeypatch):
    """From LIBRARY_FROM_ROWS rows (a layer built with the default) the panels are widened back
    to the plain float32 weights (every value exact, the rows in order, padding cut off; both
    widths' tile transposes; the view strided where K is padded) and oneDNN's product multiplies
    them; one row fewer stays on the kernel. Both equal F.linear up to summation order."""
    lin = bf16_weights(n, k, bias, n + k)
    layer = Avx2Linear(lin)
    assert torch.equal(layer._widened(), lin.weight.detach())
    rows = cpu_avx2_linear.LIBRARY_FROM_ROWS
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k))
    for m, takes_library in ((rows, True), (rows - 1, False)):
        widened = []
        monkeypatch.setattr(layer, "_widened", lambda: widened.append(1) or Avx2Linear._widened(layer))
        got = layer(x[:m].view(1, m, k))
        assert bool(widened) == takes_library and got.shape == (1, m, n)
        torch.testing.assert_close(got[0], F.linear(x[:m], lin.weight, lin.bias), atol=1e-4 * k**0.5, rtol=1e-5)


@needs_avx2
def test_layers_sharing_the_widening_scratch_each_get_their_own_product_through_onednn(monkeypatch):
    """Every plain layer widens into the same scratch matrix, so a product that kept a reordered
    weight by its address would hand one layer another's; two layers of one shape, alternated,
    each equal their own F.linear. Their products go to oneDNN (float32_product), not to
    F.linear's sgemm, which ran these shapes 1.3x slower on a Zen 4."""
    lins = [bf16_weights(96, 64, True, seed) for seed in (1, 2)]
    first, second = (Avx2Linear(lin) for lin in lins)
    rows = cpu_avx2_linear.LIBRARY_FROM_ROWS
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(3))
    calls = []
    monkeypatch.setattr(cpu_avx2_linear, "float32_product", lambda *a: calls.append(1) or cpu_linear.float32_product(*a))
    monkeypatch.setattr(F, "linear", lambda *a: pytest.fail("the library path took F.linear"))
    got = [layer(x) for layer in (first, second, first, second)]
    monkeypatch.undo()
    assert len(calls) == 4 and first._widened().data_ptr() == second._widened().data_ptr()
    for y, lin in zip(got, lins * 2):
        torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), atol=1e-4 * 64**0.5, rtol=1e-5)
    assert not torch.equal(got[0], got[1])


CPUINFO = {  # /proc/cpuinfo's fields that choose where prefill chunks multiply, and the choice
    "a Cascade Lake": ({"vendor_id": "GenuineIntel", "cpu family": "6"}, False),
    "a Zen 4": ({"vendor_id": "AuthenticAMD", "cpu family": "25"}, True),
    "a Zen 2": ({"vendor_id": "AuthenticAMD", "cpu family": "23"}, True),
    "a Zen 5 (not measured)": ({"vendor_id": "AuthenticAMD", "cpu family": "26"}, False),
    "no /proc/cpuinfo": ({}, False),
}


@needs_avx2
@pytest.mark.parametrize("cpu_kind", list(CPUINFO))
def test_the_platform_keeps_long_chunks_on_the_panels_where_they_win(monkeypatch, cpu_kind):
    """AMD cores up to Zen 4 (256-bit FMA pipes) multiply every row count on the panels, where
    widening for oneDNN's product lost at 256-2,048 rows; elsewhere a plain layer widens from
    LIBRARY_FROM_ROWS rows and an int4 layer from INT4_LIBRARY_FROM_ROWS (or past the recorded
    decode batches). The platform's description says which; the products are the same either way."""
    fields, panels_only = CPUINFO[cpu_kind]
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: fields)
    platform = cpu.CPUPlatform(cpu.CPUConfig(decode_graphs=False), None)
    lin = bf16_weights(96, 64, True, 5)
    layer = platform.linear("layers.0.self_attn.o_proj", lin)
    assert isinstance(layer, Avx2Linear)
    want = cpu_avx2_linear.PANELS_ONLY if panels_only else cpu_avx2_linear.LIBRARY_FROM_ROWS
    assert layer.library_from_rows == want == cpu.library_from_rows(cpu_avx2_linear.LIBRARY_FROM_ROWS)
    int4 = cpu_avx2_linear.PANELS_ONLY if panels_only else cpu_avx2_linear.INT4_LIBRARY_FROM_ROWS
    assert platform._int4_library_from_rows() == int4
    chunks = "at every row count" if panels_only else "from 512 rows widened for oneDNN"
    assert f"bfloat16-held weights where exact (prefill chunks: {chunks})" in platform.info().kernels[0]
    widened = []
    monkeypatch.setattr(layer, "_widened", lambda: widened.append(1) or Avx2Linear._widened(layer))
    x = torch.randn(cpu_avx2_linear.LIBRARY_FROM_ROWS + 3, 64, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(layer(x), F.linear(x, lin.weight, lin.bias), atol=1e-4 * 64**0.5, rtol=1e-5)
    assert widened == ([] if panels_only else [1])


@needs_avx2
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 12, 100])
@pytest.mark.parametrize("inter", [48, 64])
def test_gated_product_equals_the_fused_silu_mul_of_the_plain_product(rows, inter, build):
    """enable_silu_mul: ``silu(gate) * up`` in the kernel's epilogue, as the fused op computes
    it from the plain product; an odd and an even count of (gate, up) panel pairs."""
    from modserve.core.models import cpu_fused

    layer = Avx2Linear(bf16_weights(2 * inter, 96, False, rows))
    x = torch.randn(rows, 96)
    want = cpu_fused.silu_mul(layer(x))
    assert layer.enable_silu_mul()
    got = layer(x)
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # the gated blocks sum in another order


@needs_avx2
def test_a_gated_layer_stays_on_the_panels_at_many_rows(monkeypatch):
    """The library path's output would be twice as wide with a separate SiLU pass: a gated
    layer keeps the panel kernel's epilogue at LIBRARY_FROM_ROWS rows and beyond."""
    from modserve.core.models import cpu_fused

    layer = Avx2Linear(bf16_weights(2 * 48, 96, False, 3))
    rows = cpu_avx2_linear.LIBRARY_FROM_ROWS + 5
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1))
    want = cpu_fused.silu_mul(F.linear(x, layer._widened()))  # the plain product, before the pairs are reordered
    assert layer.enable_silu_mul()
    monkeypatch.setattr(layer, "_widened", lambda: pytest.fail("a gated layer widened its panels"))
    torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-4)


@needs_avx2
def test_strided_and_batched_inputs_no_rows_and_wrong_inputs():
    lin = bf16_weights(48, 64, True, 0)
    module = Avx2Linear(lin)
    view = torch.randn(7, 200)[:, 10:74]  # stride 200 between rows
    torch.testing.assert_close(module(view), lin(view.contiguous()), atol=1e-4, rtol=1e-5)
    x3 = torch.randn(2, 5, 64)
    torch.testing.assert_close(module(x3), lin(x3), atol=1e-4, rtol=1e-5)
    assert module(torch.empty(0, 64)).shape == (0, 48)
    with pytest.raises(TypeError, match="Avx2Linear takes float32 inputs, got torch.bfloat16"):
        module(torch.randn(2, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"Avx2Linear: inputs of 64 features, got shape \(4, 32\)"):
        module(torch.randn(4, 32))


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny Llama saved in bfloat16 (as SmolLM2 and most checkpoints ship); HF's float32 model
    of the same values."""
    path = str(tmp_path_factory.mktemp("llama_bf16"))
    hf = build_model(path, "llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    with torch.no_grad():
        for p in hf.parameters():  # the parameters only: RoPE's inverse frequencies stay float32
            p.copy_(p.to(torch.bfloat16).float())
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(path)
    return path, hf


def engine(path: str, kernel: str = "avx2", graphs: bool = True, dtype: str = "float32") -> LLM:
    return LLM(
        model={"path": path, "dtype": dtype, "max_model_len": 256},
        device={"plugin": "cpu", "linear_kernel": kernel, "decode_graphs": graphs, **({"graph_max_batch": 4} if graphs else {})},
        kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64}, scheduler={"plugin": "fcfs", "max_num_seqs": 5},
    )  # fmt: skip


def linear_types(llm: LLM) -> set[type]:
    return {type(m) for m in llm.engine.c.runner.model.modules()}


@needs_avx2
def test_a_bfloat16_checkpoint_in_float32_gives_hf_tokens_with_call_lists(bf16_checkpoint):
    """Every linear (the tied head too) on the kernel, the MLP gated in it; greedy tokens are
    HF float32's token for token; decode steps of 1-4 requests replay as call lists and give
    the eager engine's tokens."""
    path, hf = bf16_checkpoint
    ps = prompts(hf.config.vocab_size, count=5, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 9, 12, 24)]
    llm = engine(path)
    assert Avx2Linear in linear_types(llm) and PackedLinear not in linear_types(llm)
    assert all(layer.mlp.gated_product for layer in llm.engine.c.runner.model.layers)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]
    assert got == [hf_greedy(hf, p, n.max_tokens) for p, n in zip(ps, params)]
    graphs = llm.engine.runner.graphs
    assert graphs.unavailable is None and all(graphs.replays[s] > 0 for s in graphs.sizes), graphs.replays
    eager = engine(path, graphs=False)
    assert [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in ps], params)] == got


@needs_avx2
def test_auto_takes_the_kernel_for_weights_bfloat16_holds(monkeypatch, bf16_checkpoint, tiny_llama, caplog):
    """``auto`` holds a bfloat16 checkpoint's float32 layers in bfloat16, with AVX-512 or
    without; a float32 checkpoint's layers keep oneDNN (and its decode steps run eagerly,
    saying why)."""
    monkeypatch.setattr(cpu, "cpu_model_and_flags", lambda: AVX2_ONLY)
    assert Avx2Linear in linear_types(engine(bf16_checkpoint[0], "auto"))
    with caplog.at_level(logging.INFO, logger="modserve"):
        types = linear_types(engine(tiny_llama[0], "auto"))  # random float32 weights
    assert PackedLinear in types and Avx2Linear not in types
    assert re.search(r"device\.decode_graphs: off, linear layers\.0\.self_attn\.qkv_proj multiplies through torch", caplog.text)
    info = cpu.CPUPlatform(cpu.CPUConfig(), None).info()
    panels_only = cpu.library_from_rows(cpu_avx2_linear.LIBRARY_FROM_ROWS) == cpu_avx2_linear.PANELS_ONLY  # this CPU's choice
    chunks = "at every row count" if panels_only else "from 512 rows widened for oneDNN"
    assert info.kernels[0] == ("linears: oneDNN packed in bfloat16, float32 FMAs over bfloat16-held weights where exact "
                               f"(prefill chunks: {chunks}), else oneDNN packed in float32")
    assert info.kernels[1] == ("mixtures of experts: one call a layer (float32 FMAs over bfloat16-held experts where exact), "
                               "else torch's grouped products")
    monkeypatch.setattr(cpu, "cpu_model_and_flags", lambda: ("an AVX-512 Xeon", frozenset({"avx2", "fma", "avx512f"})))
    assert Avx2Linear in linear_types(engine(bf16_checkpoint[0], "auto"))
    assert cpu.CPUPlatform(cpu.CPUConfig(), None).float32_kernel == "avx2"
    assert cpu.CPUPlatform(cpu.CPUConfig(pack_weights=False), None).float32_kernel == "onednn"


@needs_avx2
def test_named_avx2_is_refused_where_it_cannot_hold_or_run(monkeypatch, bf16_checkpoint, tiny_llama):
    with pytest.raises(Exception, match=r"device\.linear_kernel: avx2 holds float32 weights in bfloat16, but lm_head "
                                        r"has weights bfloat16 cannot hold \(a float32 checkpoint; rounding them would change the model\); use auto or onednn"):  # fmt: skip
        engine(tiny_llama[0])
    with pytest.raises(Exception, match=r"device\.linear_kernel: avx2 runs float32 weights, not torch\.bfloat16; use auto or onednn"):
        engine(bf16_checkpoint[0], dtype="bfloat16")
    with pytest.raises(Exception, match=r"device\.linear_kernel: avx2 packs the weights; it cannot go with pack_weights: false"):
        LLM(model={"path": bf16_checkpoint[0], "dtype": "float32"}, device={"plugin": "cpu", "linear_kernel": "avx2", "pack_weights": False})
    monkeypatch.setattr(cpu, "cpu_model_and_flags", lambda: ("an old CPU", frozenset({"sse4_2"})))
    with pytest.raises(Exception, match=r"device\.linear_kernel: avx2 cannot run here: this CPU \(an old CPU\) has no FMA; use auto or onednn"):
        engine(bf16_checkpoint[0])


def test_auto_warns_and_keeps_onednn_where_the_kernel_does_not_build(monkeypatch, caplog):
    from modserve.native.build import KernelUnavailable

    def broken():
        raise KernelUnavailable("compiling the AVX2 linear kernel failed (test)")

    monkeypatch.setattr(cpu, "cpu_model_and_flags", lambda: AVX2_ONLY)
    monkeypatch.setattr(cpu_avx2_linear, "load", broken)
    with caplog.at_level("WARNING", logger="modserve.platform"):
        assert cpu.CPUPlatform(cpu.CPUConfig(), None).float32_kernel == "onednn"
    assert "device.linear_kernel auto: compiling the AVX2 linear kernel failed (test); float32 layers use oneDNN" in caplog.text
    with pytest.raises(ValueError, match=r"device\.linear_kernel: avx2 cannot run here: compiling the AVX2 linear kernel failed \(test\)"):
        cpu.CPUPlatform(cpu.CPUConfig(linear_kernel="avx2"), None)
