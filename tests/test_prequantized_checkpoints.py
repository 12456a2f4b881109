"""Pre-quantized HF checkpoints (GPTQ, AWQ, compressed-tensors) kept quantized on the cpu
platform (``device: {plugin: cpu, quantization: gptq | awq | compressed-tensors}``), and
dequantized with ``quantization: none``.

The checkpoints are built here from tiny random models:

- compressed-tensors by the ``compressed-tensors`` library itself (its ``ModelCompressor``
  packs them); the oracle is HF ``transformers`` loading that checkpoint with
  ``dequantize=True`` (the library unpacks it), so our unpacking is checked against theirs;
- GPTQ and AWQ by packers written here from AutoGPTQ's and AutoAWQ's ``pack`` (GPTQ's zeros
  stored minus one, AWQ's interleaved column order, act-order ``g_idx``); their oracle is HF
  on the float weights the codes stand for, computed here from the codes, not by modserve.

Stated bounds (float32):
1. ``none`` (each layer dequantized at load) against the oracle: every prompt logprob
   within 5e-5 (the same weights; measured <= 1e-5).
2. The kept model: HF's greedy tokens exactly, and teacher-forced over them the top-1 token
   at every position and logprobs within 1e-4 of ``none`` (only float rounding differs: the
   int4 kernel's ``(q - 8) s + (8 - z) s``); W8A8 quantizes activations per token too: top-1
   agreement >= 90% and logprobs within 0.1 nats on average of ``none``.
3. bfloat16 (act-order GPTQ): top-1 agreement >= 90% with the bfloat16 ``none`` engine.
4. Every setting that cannot be honoured is an error naming the field or the checkpoint's
   setting, and lists what is supported.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from modserve import LLM, SamplingParams
from modserve.core.config import ConfigError
from modserve.core.models.prequantized import read_format
from modserve.plugins.platforms import cpu
from modserve.plugins.platforms.cpu_int8_panel_linear import Int8PanelLinear
from modserve.plugins.platforms.cpu_quant import Int4WeightOnlyLinear, Int8GroupLinear, Int8WeightOnlyLinear, W8A8Linear
from tiny_models import build_model, hf_greedy, prompts, teacher_forced

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SHARES_INPUT = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj", "mlp.up_proj": "mlp.gate_proj"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack: bits 4i of a word hold column 8j + AWQ_ORDER[i]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


# ----------------------------------------------------------------- GPTQ / AWQ packers (AutoGPTQ, AutoAWQ)

def quantize(w: torch.Tensor, group: int, bits: int, sym: bool, order: torch.Tensor | None):
    """GPTQ's quantizer per group of inputs (taken in ``order``): codes ``q [N, K]``, ``zero``
    and ``scale [N, G]`` (scales rounded to float16, as stored), ``g_idx [K]``."""
    n, k = w.shape
    order = torch.arange(k) if order is None else order
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    maxq = (1 << bits) - 1
    wg = w[:, order].view(n, k // group, group)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    if sym:
        hi = torch.maximum(hi, -lo)
        scale, zero = (2 * hi / maxq).half().float(), torch.full_like(hi, (maxq + 1) // 2)
    else:
        scale = ((hi - lo) / maxq).half().float()
        zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(w / scale[:, g_idx]) + zero[:, g_idx], 0, maxq).to(torch.int64)
    return q, zero.to(torch.int64), scale, g_idx


def dequantized(q, zero, scale, g_idx) -> torch.Tensor:
    return (q - zero[:, g_idx]).float() * scale[:, g_idx]


def words(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Pack ``values`` (int64 codes) along ``dim`` into int32 words, value ``i`` of each word at
    bits ``bits * i`` (or ``order``'s position: AWQ)."""
    per = 32 // bits
    v = values.movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per)
    if order is not None:
        v = v[..., list(order)]
    packed = (v << (torch.arange(per) * bits)).sum(-1)
    packed = ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)  # two's complement, as the packers' int32
    return packed.movedim(-1, dim).contiguous()


def write_checkpoint(src: str, dst: str, tensors: dict, quantization_config: dict) -> None:
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f != "config.json":
            shutil.copy(os.path.join(src, f), dst)
    cfg = json.load(open(os.path.join(src, "config.json")))
    json.dump({**cfg, "quantization_config": quantization_config}, open(os.path.join(dst, "config.json"), "w"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"))


def gptq_or_awq(tmp, arch: str, method: str, bits: int = 4, sym: bool = True, act_order: bool = False, group: int = 32):
    """(checkpoint path, the HF oracle on the weights its codes stand for)."""
    src = str(tmp / f"{arch}-float")
    hf = build_model(src, arch)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    tensors = {k: v for k, v in state.items() if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    rng = torch.Generator().manual_seed(1)
    orders: dict[str, torch.Tensor] = {}
    for i in range(hf.config.num_hidden_layers):
        for lin in LINEARS:
            name = f"model.layers.{i}.{lin}"
            w = state[f"{name}.weight"]
            order = None
            if act_order:  # layers sharing an input share GPTQ's order (the same Hessian)
                shared = f"model.layers.{i}.{SHARES_INPUT.get(lin, lin)}"
                order = orders.setdefault(shared, torch.randperm(w.shape[1], generator=rng))
            q, zero, scale, g_idx = quantize(w, group, bits, sym, order)
            hf.get_submodule(name).weight.data.copy_(dequantized(q, zero, scale, g_idx))
            del tensors[f"{name}.weight"]
            if method == "gptq":
                tensors[f"{name}.qweight"] = words(q.t(), bits, 0)
                tensors[f"{name}.qzeros"] = words(zero.t() - 1, bits, 1)  # checkpoint_format gptq: zeros minus one
                tensors[f"{name}.scales"] = scale.t().half()
                tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
            else:
                tensors[f"{name}.qweight"] = words(q.t(), 4, 1, AWQ_ORDER)
                tensors[f"{name}.qzeros"] = words(zero.t(), 4, 1, AWQ_ORDER)
                tensors[f"{name}.scales"] = scale.t().half()
    config = ({"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": sym, "checkpoint_format": "gptq"}
              if method == "gptq" else {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"})
    dst = str(tmp / f"{arch}-{method}")
    write_checkpoint(src, dst, tensors, config)
    return dst, hf


def compressed_tensors(tmp, scheme: str):
    """A checkpoint packed by the compressed-tensors library, and HF's model dequantizing it."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    src = str(tmp / "llama-float")
    hf = build_model(src, "llama")
    weights = {
        "int4-asym-g32": QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
        "int4-sym-channel": QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel"),
        "int8-channel": QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
        "w8a8": QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
    }[scheme]
    acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True) if scheme == "w8a8" else None
    fmt = "pack-quantized" if weights.num_bits == 4 else "int-quantized"
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)},
                                ignore=["lm_head"], format=fmt)
    apply_quantization_config(hf, config)
    for module in hf.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            w = module.weight.detach()
            w = w.view(w.shape[0], -1, weights.group_size) if weights.group_size else w[:, None, :]
            scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), weights)
            module.weight_scale.data.copy_(scale.view_as(module.weight_scale))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.view_as(module.weight_zero_point))
    compressor = ModelCompressor.from_pretrained_model(hf, quantization_format=fmt)
    compressor.compress_model(hf)
    dst = str(tmp / f"llama-ct-{scheme}")
    hf.save_pretrained(dst)
    compressor.update_config(dst)
    for f in os.listdir(src):
        if "token" in f:
            shutil.copy(os.path.join(src, f), dst)
    oracle = AutoModelForCausalLM.from_pretrained(dst, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32)
    return dst, oracle.eval()


CASES = {  # name: (builder, scheme, the module (or modules) its layers become)
    "gptq-int4-sym": (lambda t: gptq_or_awq(t, "llama", "gptq"), "gptq", Int4WeightOnlyLinear),
    "gptq-int4-asym-act-order-bias": (lambda t: gptq_or_awq(t, "qwen2", "gptq", sym=False, act_order=True), "gptq", Int4WeightOnlyLinear),
    "gptq-int8": (lambda t: gptq_or_awq(t, "llama", "gptq", bits=8), "gptq", Int8GroupLinear),
    "awq": (lambda t: gptq_or_awq(t, "llama", "awq", sym=False), "awq", Int4WeightOnlyLinear),
    "ct-int4-asym-g32": (lambda t: compressed_tensors(t, "int4-asym-g32"), "compressed-tensors", Int4WeightOnlyLinear),
    "ct-int4-sym-channel": (lambda t: compressed_tensors(t, "int4-sym-channel"), "compressed-tensors", Int4WeightOnlyLinear),
    "ct-int8-channel": (lambda t: compressed_tensors(t, "int8-channel"), "compressed-tensors", (Int8WeightOnlyLinear, Int8PanelLinear)),
    "ct-w8a8": (lambda t: compressed_tensors(t, "w8a8"), "compressed-tensors", W8A8Linear),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(case: str):
        if case not in cache:
            cache[case] = CASES[case][0](tmp_path_factory.mktemp(case))
        return cache[case]

    return get


def engine(path: str, scheme: str, dtype: str = "float32") -> LLM:
    return LLM(model={"path": path, "dtype": dtype}, device={"plugin": "cpu", "quantization": scheme},
               kv_cache={"plugin": "paged", "num_blocks": 64})


def prompt_logprobs(llm: LLM, p: list[int]) -> list[float]:
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    return [entry[p[i]].logprob for i, entry in enumerate(out.prompt_logprobs) if entry is not None]


@pytest.mark.parametrize("case", list(CASES))
def test_dequantized_checkpoint_equals_the_oracle(built, case):
    path, oracle = built(case)
    p = prompts(oracle.config.vocab_size, count=1, seed=4)[0] + [9, 10, 11]
    with torch.no_grad():
        ref = oracle(torch.tensor([p])).logits[0].log_softmax(-1)
    got = prompt_logprobs(engine(path, "none"), p)
    assert got == pytest.approx([ref[i, p[i + 1]].item() for i in range(len(p) - 1)], abs=5e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_kept_checkpoint_serves_the_oracles_tokens(built, case):
    path, oracle = built(case)
    _, scheme, module = CASES[case]
    kept = engine(path, scheme)
    model = kept.engine.runner.model
    kinds = module if isinstance(module, tuple) else (module,)  # int8: on the panel kernels where they run, else in torch
    if Int8PanelLinear in kinds and cpu.avx2_unavailable() is None:  # float32 engines: the AVX2 panels' int8 entry
        kinds = (Int8PanelLinear,)
    assert type(model.layers[0].self_attn.qkv_proj) in kinds and type(model.layers[1].mlp.down_proj) in kinds
    ps = prompts(oracle.config.vocab_size, count=4, seed=2)
    outs = [o.outputs[0].token_ids for o in kept.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    want = [hf_greedy(oracle, p, 12) for p in ps]
    reference = engine(path, "none")
    sequences = [p + w for p, w in zip(ps, want)]
    ours, theirs = teacher_forced(kept, sequences), teacher_forced(reference, sequences)
    nats = [abs(a[1] - b[1]) for a, b in zip(ours, theirs)]
    agreement = sum(a[0] == b[0] for a, b in zip(ours, theirs)) / len(ours)
    if module is W8A8Linear:  # activations quantized per token: close, not equal
        assert agreement >= 0.9 and sum(nats) / len(nats) <= 0.1
    else:
        assert outs == want
        assert agreement == 1.0 and max(nats) <= 1e-4


def test_act_order_layers_gather_their_inputs(built):
    path, _ = built("gptq-int4-asym-act-order-bias")
    qkv = engine(path, "gptq").engine.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.input_order is not None and sorted(qkv.input_order.tolist()) == list(range(qkv.in_features))
    assert qkv.bias is not None


def test_bfloat16_act_order_gptq_agrees_with_its_dequantized_engine(built):
    path, oracle = built("gptq-int4-asym-act-order-bias")
    ps = prompts(oracle.config.vocab_size, count=4, seed=6)
    sequences = [p + hf_greedy(oracle, p, 12) for p in ps]
    ours, theirs = (teacher_forced(engine(path, s, "bfloat16"), sequences) for s in ("gptq", "none"))
    assert sum(a[0] == b[0] for a, b in zip(ours, theirs)) / len(ours) >= 0.9


def test_kept_weights_take_a_fraction_of_the_float_bytes(built):
    path, _ = built("gptq-int4-sym")

    def linear_bytes(llm: LLM) -> int:
        layers = llm.engine.runner.model.layers
        return sum(t.numel() * t.element_size() for m in layers.modules() for t in (*m.parameters(False), *m.buffers(False))
                   if type(m).__name__ not in ("RMSNorm", "Embedding"))

    assert linear_bytes(engine(path, "gptq")) < 0.3 * linear_bytes(engine(path, "none"))


# ----------------------------------------------------------------- refusals

@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes"}, "pre-quantized checkpoints (bitsandbytes) are not supported; supported: gptq"),
    ({"quant_method": "gptq", "bits": 3}, "gptq with bits 3 is not supported"),
    ({"quant_method": "gptq", "bits": 8, "sym": False}, "asymmetric 8-bit weights"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*down": {}}}, "per-module `dynamic` overrides"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq with version 'gemv'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}}, "float weights"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32},
                              "input_activations": {"type": "int", "num_bits": 8, "dynamic": True, "strategy": "token"}}}},
     "format 'pack-quantized' and 4-bit weights"),
])
def test_unsupported_formats_are_refused_naming_the_setting(config, message):
    with pytest.raises(ValueError, match="config.json: quantization_config") as e:
        read_format({"quantization_config": config}, "x/config.json")
    assert message in str(e.value) or message in str(e.value).replace("\n", " ")


def test_a_checkpoint_scheme_needs_a_checkpoint_of_that_format(built, tmp_path):
    gptq, _ = built("gptq-int4-sym")
    with pytest.raises(ConfigError, match="device.quantization: awq, but model.path is a gptq checkpoint: use gptq"):
        engine(gptq, "awq")
    plain = str(tmp_path / "plain")
    build_model(plain, "llama")
    with pytest.raises(ConfigError, match="device.quantization: gptq keeps a pre-quantized checkpoint's weights, but model.path has no quantized layer"):
        engine(plain, "gptq")
    with pytest.raises(ValueError, match="device.quantize_lm_head: a gptq checkpoint's head is kept as the checkpoint stores it"):
        LLM(model=gptq, device={"plugin": "cpu", "quantization": "gptq", "quantize_lm_head": True})


def test_a_missing_part_is_named(built, tmp_path):
    path, _ = built("awq")
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    write_checkpoint(path, str(tmp_path / "cut"), tensors, json.load(open(os.path.join(path, "config.json")))["quantization_config"])
    with pytest.raises(ValueError, match=r"weights missing from checkpoint: model.layers.1.mlp.down_proj.qzeros"):
        engine(str(tmp_path / "cut"), "awq")


def test_tensor_parallelism_refuses_a_pre_quantized_checkpoint(built):
    path, _ = built("gptq-int4-sym")
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel_size: .*config.json is a pre-quantized checkpoint \(gptq-int4-g32\), which is not sharded"):
        LLM(model=path, device={"plugin": "cpu", "quantization": "gptq"}, parallel={"tensor_parallel_size": 2})


def test_serving_a_checkpoint_dequantized_says_so(built, caplog):
    """``none`` dequantizes every quantized layer and warns, naming the setting that would keep
    them; the kept engine does not warn (its float head is the checkpoint's own choice)."""
    path, _ = built("gptq-int4-sym")
    with caplog.at_level("WARNING", logger="modserve.loader"):
        engine(path, "gptq")
        assert not [r for r in caplog.records if "dequantized" in r.getMessage()]
        engine(path, "none")
    messages = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert messages == ["8 linear layers of this gptq-int4-g32 checkpoint were dequantized to float32: the platform does not "
                        "keep them (on the cpu platform, device.quantization: gptq keeps them quantized)"]


def test_bfloat16_w8a8_checkpoint_agrees_with_its_dequantized_engine(built):
    """compressed-tensors W8A8 in bfloat16 (on AMX CPUs the AMX-INT8 kernel): teacher-forced
    top-1 agreement >= 90% with the bfloat16 ``none`` engine."""
    path, oracle = built("ct-w8a8")
    ps = prompts(oracle.config.vocab_size, count=4, seed=8)
    sequences = [p + hf_greedy(oracle, p, 12) for p in ps]
    kept = engine(path, "compressed-tensors", "bfloat16")
    w8a8 = [m for m in kept.engine.runner.model.modules() if isinstance(m, W8A8Linear)]
    assert w8a8 and len({m.amx for m in w8a8}) == 1
    ours, theirs = teacher_forced(kept, sequences), teacher_forced(engine(path, "none", "bfloat16"), sequences)
    assert sum(a[0] == b[0] for a, b in zip(ours, theirs)) / len(ours) >= 0.9
