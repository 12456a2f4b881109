"""Mixtures of experts in one native call on AVX512_BF16 CPUs (``plugins/platforms/cpu_experts.py``,
``native/cpu_experts.cpp``; contract 2.8 ``Platform.experts``).

What could go wrong, and is checked here: a token routed to the wrong experts or rows (the
grouping by expert, the split of the experts' panels over threads, more rows than one sweep
takes), ties between experts broken differently from the documented rule, the weighted sum
rounded in another order than the model's, a decode step with experts that cannot replay, and
the platform taking the kernel where it cannot run (or saying nothing when it keeps torch's
products)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from tiny_models import build_model, prompts

from modserve import LLM, SamplingParams
from modserve.plugins.models.moe import SparseMoE
from modserve.plugins.platforms import cpu, cpu_avx512_linear
from modserve.plugins.platforms.cpu_experts import PanelExperts

NATIVE = cpu.avx512_bf16_unavailable() is None
native_only = pytest.mark.skipif(not NATIVE, reason="this CPU has no AVX512_BF16 (or no compiler targets it)")
TAKES_KERNEL = NATIVE and cpu.amx_unavailable(cpu.amx_linear.load) is not None  # AMX CPUs keep oneDNN's tiles


def experts(hidden: int, num: int, top_k: int, width: int, norm: bool = True, seed: int = 0, router_scale: float = 1.0) -> SparseMoE:
    spec = SimpleNamespace(hidden_size=hidden, moe=SimpleNamespace(num_experts=num, top_k=top_k, intermediate_size=width, norm_topk_prob=norm))
    moe = SparseMoE(spec).to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (moe.w13, moe.w2):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape, generator=g) * router_scale)
    return moe


def reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """ExpertMLP's map in torch, one token and expert at a time: the router's logits as the
    module under test takes them (the platform's linear), a float32 softmax, the top k with ties
    to the lower expert, each expert's products by the same panel kernel (so the products are
    bit for bit the kernel's), its output times the bfloat16 weight added to a bfloat16 sum in
    ascending expert order."""
    gate, gate_up, down = cpu_avx512_linear.Avx512Linear(moe.gate), [], []
    for e in range(moe.num_experts):
        pair = cpu_avx512_linear.Avx512Linear(_linear(moe.w13[e]))
        assert pair.enable_silu_mul()
        gate_up.append(pair)
        down.append(cpu_avx512_linear.Avx512Linear(_linear(moe.w2[e])))
    probs = torch.softmax(gate(x).float(), dim=-1)
    picked = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, : moe.top_k]
    weights = probs.gather(-1, picked)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.to(torch.bfloat16)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in sorted(zip(picked[t].tolist(), weights[t])):
            out[t] += down[e](gate_up[e](x[t : t + 1]))[0] * w
    return out


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return lin


def panel_experts(moe: SparseMoE) -> PanelExperts:
    out = PanelExperts(moe)
    out.gate = cpu_avx512_linear.Avx512Linear(moe.gate)  # as the platform's linear swap leaves it
    return out


@native_only
@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize(
    "hidden,num,width,tokens",
    [(64, 8, 32, 5), (100, 16, 48, 37), (96, 6, 64, 300), (512, 64, 256, 9), (40, 3, 16, 1)],
)
def test_one_expert_a_token_equals_its_expert_bit_for_bit(hidden, num, width, tokens, threads):
    """Top 1, renormalized: every weight is exactly 1, so each token's output is its expert's,
    bit for bit, wherever the grouping, the thread split (1, 2 and more threads than some
    experts have panels) and the sweeps (300 rows: more than one) put its row."""
    moe = experts(hidden, num, 1, width, seed=hidden + num)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = panel_experts(moe)(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, reference(moe, x))


@native_only
@pytest.mark.parametrize("top_k,norm", [(2, True), (4, False), (3, True)])
def test_several_experts_a_token_sum_as_the_reference(top_k, norm):
    """Top k > 1: the outputs equal the reference's up to the float32 softmax's last bits (std's
    exp against torch's), which may move a bfloat16 weight by one step: nearly every element is
    bit for bit the same, none is far off."""
    moe = experts(96, 16, top_k, 64, norm=norm, seed=top_k)
    x = torch.randn(50, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got, want = panel_experts(moe)(x), reference(moe, x)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
    assert (got == want).float().mean() > 0.99


@native_only
@pytest.mark.parametrize("num,top_k", [(8, 2), (6, 4), (5, 1)])
def test_equal_logits_go_to_the_lowest_experts_in_their_order(num, top_k):
    """A router of zeros ties every expert: the k lowest are taken, each weighing 1/k (exact),
    and their outputs times 1/k are summed in bfloat16 from the lowest expert up."""
    moe = experts(64, num, top_k, 32, router_scale=0.0)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = reference(moe, x)
    assert torch.equal(panel_experts(moe)(x), want)
    other = experts(64, num, top_k, 32, seed=99, router_scale=0.0)  # other experts past the k lowest
    with torch.no_grad():
        other.w13[:top_k], other.w2[:top_k] = moe.w13[:top_k], moe.w2[:top_k]
    assert torch.equal(panel_experts(other)(x), want)


@native_only
def test_wrong_inputs_are_refused_by_name():
    moe = panel_experts(experts(64, 4, 2, 32))
    with pytest.raises(ValueError, match="bfloat16 rows of 64 features"):
        moe(torch.randn(3, 64))
    with pytest.raises(ValueError, match="bfloat16 rows of 64 features"):
        moe(torch.randn(3, 48).to(torch.bfloat16))
    assert moe(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 64)


# ----------------------------------------------------------------------------- the platform


def engine(path: str, dtype: str = "bfloat16", **device) -> LLM:
    return LLM(
        model={"path": path, "dtype": dtype, "max_model_len": 256},
        device={"plugin": "cpu", **device},
        kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64},
    )


def prompt_logprobs(llm: LLM) -> torch.Tensor:
    p = prompts(llm.engine.c.spec.vocab_size, count=1, seed=5)[0]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    return torch.tensor([entry[p[i + 1]].logprob for i, entry in enumerate(out.prompt_logprobs[1:])])


@pytest.mark.skipif(not TAKES_KERNEL, reason="the platform takes the kernel only where the bfloat16 linears are AVX512_BF16 panels")
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_the_platform_computes_experts_in_one_call_with_the_models_logprobs(tmp_path, arch, monkeypatch):
    """bfloat16 on an AVX512_BF16 CPU: every mixture of experts is a PanelExperts (its router a
    panel linear) and the model declares itself capturable; its prompt logprobs are those of
    the model's own grouped products, to within bfloat16 rounding."""
    build_model(str(tmp_path), arch)
    llm = engine(str(tmp_path))
    model = llm.engine.runner.model
    kinds = {type(m) for m in model.modules() if isinstance(m, (SparseMoE, PanelExperts))}
    assert kinds == {PanelExperts} and model.capturable
    assert all(isinstance(m.gate, cpu_avx512_linear.Avx512Linear) for m in model.modules() if isinstance(m, PanelExperts))
    got = prompt_logprobs(llm)
    monkeypatch.setattr(cpu.CPUPlatform, "experts", lambda self, name, moe: moe)
    torch_llm = engine(str(tmp_path))
    assert not torch_llm.engine.runner.model.capturable
    torch.testing.assert_close(got, prompt_logprobs(torch_llm), rtol=0, atol=0.05)


@pytest.mark.parametrize(
    "dtype,device,why",
    [
        ("float32", {}, "experts in float32 (the kernel multiplies bfloat16)"),
        ("bfloat16", {"pack_weights": False}, "pack_weights is false"),
        ("bfloat16", {"linear_kernel": "onednn"}, "the bfloat16 linears are onednn's, not AVX512_BF16 panels"),
    ],
)
def test_where_the_kernel_cannot_run_the_models_products_stay_and_the_log_says_why(tmp_path, caplog, dtype, device, why):
    build_model(str(tmp_path), "mixtral")
    with caplog.at_level(logging.INFO, logger="modserve.platform"):
        llm = engine(str(tmp_path), dtype, **device)
    model = llm.engine.runner.model
    assert all(not isinstance(m, PanelExperts) for m in model.modules()) and not model.capturable
    if TAKES_KERNEL or device:  # float32 elsewhere: the first reason is the CPU's linears
        assert f"device: mixtures of experts run torch's grouped products ({why})" in caplog.text
    assert caplog.text.count("mixtures of experts run torch's") == 1  # once, not once per layer


def test_an_expert_width_off_the_panels_keeps_the_models_products(tmp_path, caplog):
    build_model(str(tmp_path), "mixtral", intermediate_size=40)
    with caplog.at_level(logging.INFO, logger="modserve.platform"):
        llm = engine(str(tmp_path))
    assert not any(isinstance(m, PanelExperts) for m in llm.engine.runner.model.modules())
    if TAKES_KERNEL:
        assert "expert width 40 is not a multiple of 16" in caplog.text
