"""int8 weight-only linear layers on the panel kernels (``plugins/platforms/cpu_int8_panel_linear.py``;
the ``_int8`` entries of ``native/cpu_avx512_linear.cpp`` and ``native/cpu_avx2_linear.cpp``).

What could go wrong, and is checked here: codes widened wrongly (sign, the even and odd inputs
of a pair, an odd K's last input), a channel's scale applied to another channel (a padded last
panel, the gated pairs' order), the bias added before the scale, an int8 model that still runs
torch's products (and so cannot replay its decode steps), and the platform taking the panels
where its float linears are not ours."""

from __future__ import annotations

import logging

import pytest
import torch
from test_cpu_experts import BUILDS, KERNEL_BUILDS, TAKES_KERNEL, engine, panel_linear, torch_threads
from tiny_models import build_model, prompts
from torch import nn

from modserve import SamplingParams
from modserve.plugins.platforms import cpu_avx2_linear, cpu_avx512_linear
from modserve.plugins.platforms.cpu_int8_panel_linear import Int8PanelLinear
from modserve.plugins.platforms.cpu_quant import Int8WeightOnlyLinear, quantize_per_channel_int8


def power_of_two_layer(k: int, n: int, bias: bool, dtype: torch.dtype, seed: int) -> nn.Linear:
    """A layer whose every output channel is int8 codes (absmax 127) times a power of two that
    differs between channels: quantizing gives back exactly those codes and scales, so the int8
    product (x . q) * s equals the bfloat16-weight product x . w bit for bit."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g).float()
    q[:, seed % k] = 127
    layer = nn.Linear(k, n, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(q * torch.exp2(-(torch.arange(n) % 5 + 7).float())[:, None])
        if bias:
            layer.bias.copy_(torch.randn(n, generator=g).to(torch.bfloat16))
    return layer


def int8_panels(layer: nn.Linear, build: str, **kw) -> Int8PanelLinear:
    dtype, flags = BUILDS[build]
    kernel = cpu_avx512_linear.load_codes() if dtype == torch.bfloat16 else cpu_avx2_linear.load_codes(flags)
    return Int8PanelLinear(layer, kernel, dtype, **kw)


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(
    "k,n,rows,bias,gated",
    [(101, 40, 5, True, False), (64, 64, 300, False, True), (576, 96, 1, False, True), (33, 17, 37, True, False), (256, 32, 2, False, False)],
)
def test_int8_codes_give_the_bfloat16_weights_products_bit_for_bit(build, k, n, rows, bias, gated, threads):
    """Odd K (its last input paired with a zero), N off the 16-column panels (a padded last
    panel's scales), rows past one sweep (300), gated pairs (their scales reordered with their
    panels) and a bias after the scale: every case must equal the float panel kernel bit for
    bit, with 1 and 3 threads."""
    dtype = BUILDS[build][0]
    layer = power_of_two_layer(k, n, bias, dtype, seed=k + n)
    int8, floats = int8_panels(layer, build), panel_linear(layer, build)
    assert int8.packed.dtype == torch.int8 and int8.packed.nbytes * 2 == floats.packed.nbytes
    if gated:
        assert int8.enable_silu_mul() and floats.enable_silu_mul()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    with torch_threads(threads):
        got = int8(x)
    assert torch.equal(got, floats(x))


@pytest.mark.parametrize("build", KERNEL_BUILDS[:2])
def test_random_weights_give_the_exact_int8_product_to_rounding(build):
    """Random weights: the output is (x @ q.T) * scale + b of the codes quantize_per_channel_int8
    gives, to float32 summation order (bfloat16: one output rounding), and ``codes=`` holds
    already quantized codes (a pre-quantized checkpoint's) to the same output."""
    dtype = BUILDS[build][0]
    layer = nn.Linear(200, 72).to(dtype)
    module = int8_panels(layer, build)
    q, scale = quantize_per_channel_int8(layer.weight)
    x = torch.randn(9, 200).to(dtype)
    want = (x.float() @ q.float().T) * scale + layer.bias.float()
    tolerance = {"rtol": 8e-3, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(module(x).float(), want, **tolerance)
    assert torch.equal(int8_panels(layer, build, codes=(q, scale))(x), module(x))


@pytest.mark.parametrize("build", KERNEL_BUILDS[:2])
def test_wrong_inputs_are_refused_by_name(build):
    dtype = BUILDS[build][0]
    module = int8_panels(nn.Linear(64, 32).to(dtype), build)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(TypeError, match=f"Int8PanelLinear takes {str(dtype).removeprefix('torch.')} inputs"):
        module(torch.randn(2, 64).to(other))
    with pytest.raises(ValueError, match="inputs of 64 features"):
        module(torch.randn(2, 48).to(dtype))


# ----------------------------------------------------------------------------- the platform


@pytest.mark.skipif(not TAKES_KERNEL, reason="bfloat16 linears are AVX512_BF16 panels only on AVX512_BF16 CPUs without AMX")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_int8_model_runs_on_the_panels_and_replays_its_decode_steps(tmp_path, dtype):
    """``quantization: int8`` on a bfloat16 Llama checkpoint: every projection an Int8PanelLinear
    (the head stays float), the decode steps of 1-4 requests replay as call lists (torch's int8
    products turned them off), with the eager engine's greedy tokens; the Chose: entry says so."""
    hf = build_model(str(tmp_path), "llama")
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path))
    ps = prompts(hf.config.vocab_size, count=5, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 9, 12, 20)]
    llm = engine(str(tmp_path), dtype, quantization="int8")
    model = llm.engine.runner.model
    assert sum(isinstance(m, Int8PanelLinear) for m in model.modules()) == 4 * len(model.layers)  # qkv, o, gate_up, down
    assert not isinstance(model.lm_head, Int8PanelLinear)
    assert all(layer.mlp.gate_up_proj.gated for layer in model.layers)  # silu(gate) * up from the kernel's sums
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]
    graphs = llm.engine.runner.graphs
    assert graphs is not None and all(graphs.replays[s] > 0 for s in graphs.sizes), graphs and graphs.replays
    eager = engine(str(tmp_path), dtype, graphs=False, quantization="int8")
    assert [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in ps], params)] == got
    chose = next(k for k in llm.engine.c.platform.info().kernels if k.startswith("quantized linears"))
    assert "panel kernels over int8 codes in bfloat16 and float32" in chose


def test_where_the_float_linears_are_onednn_int8_stays_on_torch(tmp_path, caplog):
    """``linear_kernel: onednn``: the int8 layers keep torch's products (Int8WeightOnlyLinear),
    and decode call lists are off, the log naming the first such layer."""
    build_model(str(tmp_path), "llama")
    with caplog.at_level(logging.INFO, logger="modserve.platform"):
        llm = engine(str(tmp_path), "bfloat16", quantization="int8", linear_kernel="onednn")
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int8WeightOnlyLinear)
    assert not any(isinstance(m, Int8PanelLinear) for m in model.modules())
    assert llm.engine.runner.graphs is None and "multiplies through torch" in caplog.text
