"""Mixtures of experts in one native call on AVX512_BF16 CPUs (``plugins/platforms/cpu_experts.py``,
``native/cpu_experts.cpp``; contract 2.8 ``Platform.experts``).

What could go wrong, and is checked here: a token routed to the wrong experts or rows (the
grouping by expert, the split of the experts' panels over threads, more rows than one sweep
takes), ties between experts broken differently from the documented rule, the weighted sum
rounded in another order than the model's, a decode step with experts that cannot replay, and
the platform taking the kernel where it cannot run (or saying nothing when it keeps torch's
products)."""

from __future__ import annotations

import contextlib
import copy
import logging
from types import SimpleNamespace

import pytest
import torch
from tiny_models import build_model, hf_greedy, prompts

from modserve import LLM, SamplingParams
from modserve.plugins.models.moe import SparseMoE
from modserve.plugins.platforms import cpu, cpu_avx2_linear, cpu_avx512_linear
from modserve.plugins.platforms.cpu_experts import PanelExperts

NATIVE = cpu.avx512_bf16_unavailable() is None
AVX2_SOURCE, AVX512_SOURCE = (str(cpu_avx2_linear.SOURCE), str(cpu_avx512_linear.SOURCE))  # benchmarks' --baseline-source
HAS_AVX2 = cpu.avx2_unavailable() is None
TAKES_KERNEL = NATIVE and cpu.amx_unavailable(cpu.amx_linear.load) is not None  # AMX CPUs keep oneDNN's tiles
needs_avx2 = pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2 and FMA (or no compiler targets them)")
# Builds of the kernel: a bfloat16 model's, a float32 model's (-march=native: AVX-512 wide on an
# AVX-512 CPU), and the float32 one's AVX2 width (-mno-avx512f), which an AVX-512 CPU would not run.
BUILDS = {
    "bfloat16": (torch.bfloat16, ()),
    "float32": (torch.float32, ()),
    "float32-avx2": (torch.float32, ("-mno-avx512f",)),
}
KERNEL_BUILDS = [
    pytest.param("bfloat16", marks=pytest.mark.skipif(not NATIVE, reason="this CPU has no AVX512_BF16 (or no compiler targets it)")),
    pytest.param("float32", marks=needs_avx2),
    pytest.param("float32-avx2", marks=needs_avx2),
]


def experts(hidden: int, num: int, top_k: int, width: int, dtype: torch.dtype, norm: bool = True, seed: int = 0,
            router_scale: float = 1.0) -> SparseMoE:
    """Random experts whose weights are bfloat16 values (in float32 too, as a bfloat16 checkpoint's)."""
    spec = SimpleNamespace(hidden_size=hidden, moe=SimpleNamespace(num_experts=num, top_k=top_k, intermediate_size=width, norm_topk_prob=norm))
    moe = SparseMoE(spec).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p, scale in ((moe.w13, 0.1), (moe.w2, 0.1), (moe.gate.weight, router_scale)):
            p.copy_((torch.randn(p.shape, generator=g) * scale).to(torch.bfloat16))
    return moe


def panel_linear(lin: torch.nn.Linear, build: str) -> torch.nn.Module:
    """``lin`` on the panel kernel of ``build``'s dtype and width, as the platform's linears are."""
    dtype, flags = BUILDS[build]
    if dtype == torch.bfloat16:
        return cpu_avx512_linear.Avx512Linear(lin)
    module = cpu_avx2_linear.Avx2Linear(lin)
    module._kernel = cpu_avx2_linear.load(flags)
    return module


def reference(moe: SparseMoE, x: torch.Tensor, build: str) -> torch.Tensor:
    """ExpertMLP's map in torch, one token and expert at a time: the router's logits as the
    module under test takes them (the platform's linear), a float32 softmax, the top k with ties
    to the lower expert, each expert's products by the same panel kernel over the same rows (so
    the products are bit for bit the kernel's: the float32 kernel's sums depend on a block's
    row count), its output times the weight (rounded to the model's dtype) added
    to a sum in the model's dtype in ascending expert order."""
    gate, gate_up, down = panel_linear(moe.gate, build), [], []
    for e in range(moe.num_experts):
        pair = panel_linear(_linear(moe.w13[e]), build)
        assert pair.enable_silu_mul()
        gate_up.append(pair)
        down.append(panel_linear(_linear(moe.w2[e]), build))
    probs = torch.softmax(gate(x).float(), dim=-1)
    picked = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, : moe.top_k]
    weights = probs.gather(-1, picked)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.to(x.dtype)
    routed = {e: [t for t in range(x.shape[0]) if e in picked[t].tolist()] for e in range(moe.num_experts)}
    outputs = {e: down[e](gate_up[e](x[rows])) for e, rows in routed.items() if rows}  # one call an expert, as the kernel
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in sorted(zip(picked[t].tolist(), weights[t])):
            out[t] += outputs[e][routed[e].index(t)] * w
    return out


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return lin


def panel_experts(moe: SparseMoE, build: str) -> PanelExperts:
    out = PanelExperts(moe, BUILDS[build][1])
    out.gate = panel_linear(moe.gate, build)  # as the platform's linear swap leaves it
    return out


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's (and so the kernels') thread count set to n for the block, then put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tokens(n: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize(
    "hidden,num,width,count",
    [(64, 8, 32, 5), (100, 16, 48, 37), (96, 6, 64, 300), (512, 64, 256, 9), (40, 3, 16, 1)],
)
def test_one_expert_a_token_equals_its_expert_bit_for_bit(build, hidden, num, width, count, threads):
    """Top 1, renormalized: every weight is exactly 1, so each token's output is its expert's,
    bit for bit, wherever the grouping, the thread split (1, 2 and more threads than some
    experts have panels) and the sweeps (300 rows: more than one) put its row."""
    dtype = BUILDS[build][0]
    moe = experts(hidden, num, 1, width, dtype, seed=hidden + num)
    x = tokens(count, hidden, dtype, seed=count)
    with torch_threads(threads):
        got = panel_experts(moe, build)(x)
    assert torch.equal(got, reference(moe, x, build))


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("top_k,norm", [(2, True), (4, False), (3, True)])
def test_several_experts_a_token_sum_as_the_reference(build, top_k, norm):
    """Top k > 1: the outputs equal the reference's up to the float32 softmax's last bits (std's
    exp against torch's). In bfloat16 that may move a weight by one step: nearly every element
    is bit for bit the same, none is far off; in float32 every element is within a few ulps."""
    dtype = BUILDS[build][0]
    moe = experts(96, 16, top_k, 64, dtype, norm=norm, seed=top_k)
    x = tokens(50, 96, dtype, seed=1)
    got, want = panel_experts(moe, build)(x), reference(moe, x, build)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
        assert (got == want).float().mean() > 0.99
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("num,top_k", [(8, 2), (16, 4), (5, 1), (8, 3)])
def test_equal_logits_go_to_the_lowest_experts_in_their_order(build, num, top_k):
    """A router of zeros ties every expert: the k lowest are taken, each weighing 1/k (the same
    rounding of 1/3 in both: the product must be rounded before the add, not fused into an FMA),
    and their outputs times 1/k are summed from the lowest expert up, in the model's dtype."""
    dtype = BUILDS[build][0]
    moe = experts(64, num, top_k, 32, dtype, router_scale=0.0)
    x = tokens(7, 64, dtype, seed=2)
    want = reference(moe, x, build)
    assert torch.equal(panel_experts(moe, build)(x), want)
    other = experts(64, num, top_k, 32, dtype, seed=99, router_scale=0.0)  # other experts past the k lowest
    with torch.no_grad():
        other.w13[:top_k], other.w2[:top_k] = moe.w13[:top_k], moe.w2[:top_k]
    assert torch.equal(panel_experts(other, build)(x), want)


@pytest.mark.parametrize("build", KERNEL_BUILDS[:2])
def test_wrong_inputs_are_refused_by_name(build):
    dtype = BUILDS[build][0]
    name = str(dtype).removeprefix("torch.")
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    moe = panel_experts(experts(64, 4, 2, 32, dtype), build)
    with pytest.raises(ValueError, match=f"{name} rows of 64 features"):
        moe(torch.randn(3, 64).to(other))
    with pytest.raises(ValueError, match=f"{name} rows of 64 features"):
        moe(torch.randn(3, 48).to(dtype))
    assert moe(torch.empty(0, 64, dtype=dtype)).shape == (0, 64)


# ----------------------------------------------------------------------------- the platform


def engine(path: str, dtype: str = "bfloat16", graphs: bool = True, **device) -> LLM:
    return LLM(
        model={"path": path, "dtype": dtype, "max_model_len": 256},
        device={"plugin": "cpu", "decode_graphs": graphs, **({"graph_max_batch": 4} if graphs else {}), **device},
        kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64}, scheduler={"plugin": "fcfs", "max_num_seqs": 5},
    )  # fmt: skip


def expert_kinds(llm: LLM) -> set[type]:
    return {type(m) for m in llm.engine.runner.model.modules() if isinstance(m, (SparseMoE, PanelExperts))}


def prompt_logprobs(llm: LLM) -> torch.Tensor:
    p = prompts(llm.engine.c.spec.vocab_size, count=1, seed=5)[0]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    return torch.tensor([entry[p[i + 1]].logprob for i, entry in enumerate(out.prompt_logprobs[1:])])


@pytest.mark.skipif(not TAKES_KERNEL, reason="the platform takes the kernel only where the bfloat16 linears are AVX512_BF16 panels")
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_bfloat16_experts_run_in_one_call_with_the_models_logprobs(tmp_path, arch, monkeypatch):
    """bfloat16 on an AVX512_BF16 CPU: every mixture of experts is a PanelExperts (its router a
    panel linear) and the model declares itself capturable; its prompt logprobs are those of
    the model's own grouped products, to within bfloat16 rounding."""
    build_model(str(tmp_path), arch)
    llm = engine(str(tmp_path))
    model = llm.engine.runner.model
    assert expert_kinds(llm) == {PanelExperts} and model.capturable
    assert all(isinstance(m.gate, cpu_avx512_linear.Avx512Linear) for m in model.modules() if isinstance(m, PanelExperts))
    got = prompt_logprobs(llm)
    monkeypatch.setattr(cpu.CPUPlatform, "experts", lambda self, name, moe: moe)
    torch_llm = engine(str(tmp_path))
    assert not torch_llm.engine.runner.model.capturable
    torch.testing.assert_close(got, prompt_logprobs(torch_llm), rtol=0, atol=0.05)


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def bf16_moe_checkpoint(request, tmp_path_factory):
    """A tiny mixture-of-experts model saved in bfloat16 (as such checkpoints ship); HF's float32
    model of the same values."""
    path = str(tmp_path_factory.mktemp(f"{request.param}_bf16"))
    hf = build_model(path, request.param)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(path)
    return path, hf


@needs_avx2
def test_float32_experts_over_a_bfloat16_checkpoint_give_hf_tokens_with_call_lists(bf16_moe_checkpoint):
    """A bfloat16 checkpoint served in float32 on an AVX2 CPU: the experts and every linear on
    our kernels over bfloat16-held weights; greedy tokens are HF float32's token for token, and
    decode steps of 1-4 requests replay as call lists with the eager engine's tokens."""
    path, hf = bf16_moe_checkpoint
    ps = prompts(hf.config.vocab_size, count=5, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 9, 12, 24)]
    llm = engine(path, "float32")
    assert expert_kinds(llm) == {PanelExperts} and llm.engine.runner.model.capturable
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]
    assert got == [hf_greedy(hf, p, n.max_tokens) for p, n in zip(ps, params)]
    graphs = llm.engine.runner.graphs
    assert graphs.unavailable is None and all(graphs.replays[s] > 0 for s in graphs.sizes), graphs.replays
    eager = engine(path, "float32", graphs=False)
    assert [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in ps], params)] == got


@pytest.mark.parametrize(
    "dtype,device,why",
    [
        ("float32", {}, "float32 experts that bfloat16 cannot hold (a float32 checkpoint; rounding them would change the model)"),
        ("bfloat16", {"pack_weights": False}, "pack_weights is false"),
        ("bfloat16", {"linear_kernel": "onednn"}, "the bfloat16 linears are onednn's, not AVX512_BF16 panels"),
        ("float32", {"linear_kernel": "onednn"}, "the float32 linears are oneDNN's"),
    ],
)
def test_where_the_kernel_cannot_run_the_models_products_stay_and_the_log_says_why(tmp_path, caplog, dtype, device, why):
    """The tiny checkpoint holds random float32 weights: float32 experts that bfloat16 cannot
    hold keep torch's products, as do a platform that does not pack and one on oneDNN."""
    build_model(str(tmp_path), "mixtral")
    with caplog.at_level(logging.INFO, logger="modserve.platform"):
        llm = engine(str(tmp_path), dtype, graphs=False, **device)
    assert expert_kinds(llm) == {SparseMoE} and not llm.engine.runner.model.capturable
    if HAS_AVX2 or device:  # without AVX2 a float32 model's first reason is the CPU's linears
        assert f"device: mixtures of experts run torch's grouped products ({why})" in caplog.text
    assert caplog.text.count("mixtures of experts run torch's") == 1  # once, not once per layer


def test_an_expert_width_off_the_panels_keeps_the_models_products(tmp_path, caplog):
    build_model(str(tmp_path), "mixtral", intermediate_size=40)
    with caplog.at_level(logging.INFO, logger="modserve.platform"):
        llm = engine(str(tmp_path), graphs=False)
    assert expert_kinds(llm) == {SparseMoE}
    if TAKES_KERNEL:
        assert "expert width 40 is not a multiple of 16" in caplog.text


@pytest.mark.skipif(not TAKES_KERNEL, reason="the platform tries the kernel only where the bfloat16 linears are AVX512_BF16 panels")
def test_a_kernel_that_does_not_build_keeps_the_models_products_and_says_why(tmp_path, caplog, monkeypatch):
    from modserve.native.build import KernelUnavailable
    from modserve.plugins.platforms import cpu_experts

    def broken(*args):
        raise KernelUnavailable("the mixture-of-experts kernel needs a C++ compiler (g++); none found on PATH or in $CXX")

    monkeypatch.setattr(cpu_experts, "load", broken)
    build_model(str(tmp_path), "mixtral")
    with caplog.at_level(logging.INFO, logger="modserve.platform"):
        llm = engine(str(tmp_path), graphs=False)
    assert expert_kinds(llm) == {SparseMoE}
    assert "mixtures of experts run torch's grouped products (the mixture-of-experts kernel needs a C++ compiler" in caplog.text


@pytest.mark.parametrize("scheme", ["w8a8", "int4"])
def test_a_quantization_scheme_leaves_experts_and_routers_in_floats_and_says_so(tmp_path, caplog, scheme):
    """Schemes other than int8 (tests/test_cpu_int8_experts.py) quantize linear layers only; the
    experts are not linear layers, and the routers stay in floats (as vLLM and llama.cpp keep
    them). The log says so once, rather than let the scheme seem to cover the whole model."""
    from modserve.plugins.platforms.cpu_quant import Int4WeightOnlyLinear, W8A8Linear

    build_model(str(tmp_path), "mixtral")
    with caplog.at_level(logging.WARNING, logger="modserve.platform"):
        llm = engine(str(tmp_path), graphs=False, quantization=scheme)
    model = llm.engine.runner.model
    quantized = (W8A8Linear, Int4WeightOnlyLinear)
    moe = next(m for m in model.modules() if isinstance(m, (SparseMoE, PanelExperts)))
    assert moe.w13.dtype == torch.bfloat16  # stacked or packed, not int8 codes
    assert not isinstance(moe.gate, quantized) and isinstance(model.layers[0].self_attn.qkv_proj, quantized)
    text = (f"device.quantization {scheme}: mixtures of experts keep their experts and routers in bfloat16 (the scheme "
            "quantizes the other linear layers; of the schemes only int8 quantizes experts)")  # fmt: skip
    assert caplog.text.count(text) == 1


@pytest.mark.parametrize(
    "script,argv,message",
    [
        ("cpu_experts", ["--impls", "kernel,bar"], "--impls: unknown bar; expected some of kernel, kernel-int8, grouped, looped"),
        ("moe", ["--impls", "kernel,foo"], "--impls: unknown foo; expected some of kernel, kernel-int8, kernel-eager, grouped, looped"),
        ("moe", ["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        ("cpu_linears", ["--kernels", "avx2,nope"], "--kernels: unknown nope; expected some of onednn, onednn-fp32, avx2,"),
        ("cpu_linears", ["--rows", "1,8x"], "--rows: expected whole numbers separated by commas, got '1,8x'"),
        ("cpu_linears", ["--rounds", "3"], "--rounds goes with --baseline-source or --against-library, neither of which is given"),
        ("cpu_linears", ["--against-library", "--kernels", "onednn-fp32,avx512bf16"],
         "--against-library times avx2 and int4-panels-fp32: add one of them to --kernels"),
        ("cpu_linears", ["--against-library", "--kernels", "avx2", "--rounds", "0"], "--rounds: expected a whole number >= 1, got 0"),
        ("cpu_linears", ["--baseline-source", "/nonexistent/old.cpp"], "--baseline-source: no such file: /nonexistent/old.cpp"),
        ("cpu_linears", ["--baseline-source", __file__],
         "--baseline-source: expected a copy of cpu_avx2_linear.cpp or cpu_avx512_linear.cpp, got test_cpu_experts.py"),
        ("cpu_linears", ["--baseline-source", AVX2_SOURCE, "--kernels", "amx"],
         "--baseline-source times the avx2 kernel: add avx2 to --kernels"),
        ("cpu_linears", ["--baseline-source", AVX512_SOURCE, "--kernels", "avx2"],
         "--baseline-source times the avx512bf16 kernel: add avx512bf16 to --kernels"),
        ("cpu_linears", ["--baseline-source", AVX2_SOURCE, "--kernels", "avx2", "--rows", "1,512,640"],
         "--baseline-source: rows 512, 640 run oneDNN's product on this CPU, not the kernel (from 512 rows)"),
        ("cpu_linears", ["--baseline-source", AVX2_SOURCE, "--kernels", "avx2", "--rows", "1", "--rounds", "0"],
         "--rounds: expected a whole number >= 1, got 0"),
        ("cpu_attention", ["--baseline-source", "/nonexistent/old.cpp"], "--baseline-source: no such file: /nonexistent/old.cpp"),
        ("cpu_attention", ["--baseline-source", __file__, "--rounds", "0"], "--rounds: expected a whole number >= 1, got 0"),
        ("cpu_attention", ["--rounds", "5"], "--extra-flags and --rounds go with --baseline-source, which is not given"),
        ("cpu_attention", ["--block-size", "24"], "--block-size: expected a power of two from 1 to 256, got 24"),
    ],
)
def test_the_benchmarks_refuse_a_bad_argument_by_name(monkeypatch, capsys, on_an_intel_cpu, script, argv, message):
    """Before building anything: exit 2, the flag named (an unknown implementation once ran as
    the loop over experts, or crashed on a missing engine). On an Intel CPU, where the avx2
    layers widen for oneDNN's product from 512 rows."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{script}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr("sys.argv", [script, *argv])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err
