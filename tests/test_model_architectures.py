"""The architectures beyond the Llama family, token for token against HF ``transformers`` on
tiny random checkpoints: Qwen3 (per-head q/k norm), Qwen3-MoE (experts, a dense layer),
Mixtral (experts), OLMo 2 (post-norms, full-width q/k norm) and Phi-3 (fused checkpoint
projections, LongRoPE, partial rotary), Gemma 2 (a sliding window on alternate layers,
attention and final logit soft-capping, sandwich norms, GeGLU, scaled embeddings) and
Gemma 3 text (q/k norms, local and global layers with their own RoPE bases) and Granite
(embedding, residual, attention and logits multipliers). Each serves a
batch, chunked prefills, prefix-cache hits and preemption with HF's greedy tokens, and its
logits within float32 rounding; the Gemmas, with prompts longer than their windows, on the
``torch`` and ``cpu`` backends (the C++ kernel, and SDPA for the prefill chunks)."""

from __future__ import annotations

import re

import pytest
import torch

from modserve import LLM, SamplingParams
from modserve.core.models.rope import RotaryTable
from modserve.plugins.models.moe import SparseMoE
from tiny_models import build_model, hf_greedy, prompts

ARCHS = ["qwen3", "qwen3_moe", "mixtral", "olmo2", "phi3", "gemma2", "gemma3_text", "granite"]
GEMMAS = ["gemma2", "gemma3_text"]
# the C++ kernel for every row; the kernel for decode rows and SDPA (masked matmul when capped) for prefill chunks
BACKENDS = {"torch": {"plugin": "torch"}, "cpu": {"plugin": "cpu"}, "cpu+sdpa": {"plugin": "cpu", "max_query_len": 1}}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {arch: (str(tmp_path_factory.mktemp(arch)), None) for arch in ARCHS}


@pytest.fixture(scope="module")
def models(checkpoints):
    """{arch: (path, hf_model)}, built on first use."""
    built = {}

    def get(arch):
        if arch not in built:
            path = checkpoints[arch][0]
            built[arch] = (path, build_model(path, arch))
        return built[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_matches_hf(models, arch):
    path, hf = models(arch)
    llm = LLM(model=path, kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 256})
    ps = prompts(hf.config.vocab_size, count=10)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [hf_greedy(hf, p, 16) for p in ps]
    assert len({tuple(t) for t in got}) > 5  # the test model is not degenerate


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_prefix_hits_and_preemption_keep_hf_tokens(models, arch):
    """64-token steps split the long prompts; a shared 48-token prefix is served from the cache
    the second time; 12 blocks of 16 for 6 requests force preemption and recomputation."""
    path, hf = models(arch)
    check_chunks_prefix_hits_and_preemption(path, hf, step_tokens=64)


def check_chunks_prefix_hits_and_preemption(path: str, hf, step_tokens: int, **llm_options) -> None:
    """Steps of ``step_tokens`` split the long prompts; a shared 48-token prefix is served from
    the cache the second time; 12 blocks of 16 for 6 requests force preemption: HF's tokens throughout."""
    llm = LLM(model={"path": path, "max_model_len": 160},
              kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 12, "prefix_caching": True},
              scheduler={"plugin": "fcfs", "max_num_batched_tokens": step_tokens, "max_num_seqs": 6}, **llm_options)
    shared = list(range(20, 68))
    ps = [shared + [100 + i, 101 + i] for i in range(3)] + prompts(hf.config.vocab_size, count=3, seed=9)
    want = [hf_greedy(hf, p, 16) for p in ps]
    first = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    hits = llm.engine.scheduler.stats().prefix_hits
    again = llm.generate([{"prompt_token_ids": p} for p in ps[:3]], GREEDY)
    assert [o.outputs[0].token_ids for o in first] == want
    assert [o.outputs[0].token_ids for o in again] == want[:3]
    assert llm.engine.scheduler.stats().prefix_hits - hits >= 48
    assert llm.engine.scheduler.stats().num_preemptions > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_hf_within_fp32_rounding(models, arch):
    path, hf = models(arch)
    llm = LLM(model=path, kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64})
    p = prompts(hf.config.vocab_size, count=1, seed=3)[0] + [7, 8, 9]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0].log_softmax(-1)
    for pos, entry in enumerate(out.prompt_logprobs[1:]):
        assert entry[p[pos + 1]].logprob == pytest.approx(ref[pos, p[pos + 1]].item(), abs=5e-5)


def test_grouped_experts_equal_the_loop_over_experts(models):
    path, _ = models("mixtral")
    llm = LLM(model=path, kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64})
    moe = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE))
    x = torch.randn(37, moe.w13.shape[2])
    grouped = moe.forward(x)
    moe.grouped = False
    try:
        looped = moe.forward(x)
    finally:
        moe.grouped = True
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-5)


def test_longrope_tables_equal_hfs_short_and_long_factor_tables():
    """The table's first 512 rows equal HF's long-factor table, the 128 after them HF's
    short-factor table below ``original_max_position_embeddings``, both scaled by the
    attention factor."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.Phi3Config(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=512, original_max_position_embeddings=128,
        partial_rotary_factor=0.75,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                      "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 12.0]},
    )
    scaling = {**config.rope_parameters, "factor": 512 / 128}
    table = RotaryTable(12, 512, config.rope_parameters["rope_theta"], scaling, "cpu")
    assert table.cos.shape == (512 + 128, 12)
    positions = torch.arange(512).float()[:, None]
    for seq_len, rows, hf_rows in ((300, slice(0, 512), slice(0, 512)), (100, slice(512, 640), slice(0, 128))):
        inv_freq, gain = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
        freqs = positions * inv_freq[None, :]
        cos = torch.cat((freqs, freqs), -1).cos() * gain
        torch.testing.assert_close(table.cos[rows], cos[hf_rows])


def test_longrope_past_the_original_length_keeps_hf_tokens(models):
    """Phi-3's original length is 128 here. HF rotates a 150-token prompt with the long
    factors throughout, and a 120-token one with the short factors until its decode steps
    pass 128. Served in one batch in 64-token steps (the long prompt's first chunks lie below
    128), both get HF's greedy tokens, and so does a short prompt beside them. With the
    model drafting for itself (four tokens accepted per step), accepted drafts past 128 are
    scored on short-rotated K/V and must be dropped: the same tokens again."""
    path, hf = models("phi3")
    rng = __import__("random").Random(5)
    ps = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in (150, 120, 30)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [hf_greedy(hf, p, 24) for p in ps]
    for speculative in (None, {"plugin": "draft_model", "num_speculative_tokens": 4, "path": path}):
        llm = LLM(model={"path": path, "max_model_len": 256}, kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64},
                  scheduler={"plugin": "fcfs", "max_num_batched_tokens": 64}, speculative=speculative)
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]
        assert got == want


def test_longrope_prefix_cache_keeps_short_and_long_rotations_apart(models):
    """A 100-token prompt's blocks hold K rotated with the short factors: a 110-token prompt
    sharing them reuses them, a 150-token one (long factors throughout) must not, and both
    keep HF's tokens."""
    path, hf = models("phi3")
    llm = LLM(model={"path": path, "max_model_len": 256},
              kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64, "prefix_caching": True})
    rng = __import__("random").Random(6)
    base = [rng.randrange(3, hf.config.vocab_size) for _ in range(100)]
    short, long = base + [5] * 10, base + [rng.randrange(3, hf.config.vocab_size) for _ in range(50)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate({"prompt_token_ids": base}, params)
    hits = llm.engine.scheduler.stats().prefix_hits
    assert llm.generate({"prompt_token_ids": long}, params)[0].outputs[0].token_ids == hf_greedy(hf, long, 8)
    assert llm.engine.scheduler.stats().prefix_hits == hits
    assert llm.generate({"prompt_token_ids": short}, params)[0].outputs[0].token_ids == hf_greedy(hf, short, 8)
    assert llm.engine.scheduler.stats().prefix_hits - hits == 96


def test_a_model_that_cannot_be_sharded_is_refused_for_tensor_parallelism(models):
    path, _ = models("mixtral")
    with pytest.raises(Exception, match="parallel.tensor_parallel_size: mixtral models cannot be sharded yet"):
        LLM(model=path, parallel={"tensor_parallel_size": 2}, kv_cache={"plugin": "paged", "num_blocks": 16})


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_with_the_fused_cpu_ops_agrees_with_hf(models, arch):
    """bf16 (fused norms, q/k norms and RoPE where the CPU runs them): teacher-forced, the
    likeliest next token equals HF float32's at >= 85% of positions (a random tiny MoE's
    router flips near-ties in bf16: Qwen3-MoE agreed at 0.90 when this was written, the
    dense models at 0.95 or more)."""
    path, hf = models(arch)
    llm = LLM(model={"path": path, "dtype": "bfloat16"}, kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64})
    p = prompts(hf.config.vocab_size, count=1, seed=11)[0] + list(range(30, 90))
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0].argmax(-1)
    top = [max(entry.values(), key=lambda lp: lp.logprob).token_id for entry in out.prompt_logprobs[1:]]
    agree = sum(int(t == r) for t, r in zip(top, ref[:-1].tolist())) / len(top)
    assert agree >= 0.85, agree


def test_modserve_models_lists_architectures_formats_and_quantization(capsys):
    import json

    from modserve.cli import main

    assert main(["models", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    served = {t for a in listing["architectures"] for t in a["model_types"]}
    assert {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "olmo2", "phi3", "gemma2", "gemma3_text",
            "granite"} <= served
    assert any("GGUF" in f for f in listing["formats"])
    assert listing["quantization"]["cpu"] == "'none' | 'int8' | 'w8a8' | 'int4' | 'gguf' | 'gptq' | 'awq' | 'compressed-tensors'"
    assert any("GPTQ" in f and "AWQ" in f and "compressed-tensors" in f for f in listing["formats"])


def test_unsupported_architectures_and_pre_quantized_checkpoints_are_refused_by_name(models, tmp_path):
    import json
    import shutil

    path, _ = models("qwen3")
    for name, change, message in [
        ("falcon", {"model_type": "falcon"}, "unsupported model_type 'falcon'; supported: llama, mistral, qwen2, qwen3"),
        ("gemma3", {"model_type": "gemma3"}, "multimodal gemma3 checkpoints (a vision tower and a text_config) are not supported"),
        ("bnb", {"quantization_config": {"quant_method": "bitsandbytes"}}, "pre-quantized checkpoints (bitsandbytes) are not supported"),
    ]:
        copy = tmp_path / name
        shutil.copytree(path, copy)
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=re.escape(message)):
            LLM(model=str(copy), kv_cache={"plugin": "paged", "num_blocks": 64})


# ----------------------------------------------------------------------------- sliding windows, soft-capping


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("arch", GEMMAS)
def test_gemma_batch_chunks_prefix_hits_and_preemption_match_hf_on_each_backend(models, arch, backend):
    """Prompts of up to 69 tokens against windows of 12 (Gemma 2) and 10 (Gemma 3): a mixed
    batch, then 16-token steps (chunks that start inside and beyond the window), a 48-token
    prefix served from the cache, and preemption."""
    path, hf = models(arch)
    ps = prompts(hf.config.vocab_size, count=8, seed=4)
    want = [hf_greedy(hf, p, 16) for p in ps]
    assert max(map(len, ps)) > 2 * hf.config.sliding_window
    llm = LLM(model=path, attention=BACKENDS[backend], kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 128})
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)] == want

    check_chunks_prefix_hits_and_preemption(path, hf, step_tokens=16, attention=BACKENDS[backend])


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("arch", GEMMAS)
def test_gemma_logits_match_hf_past_the_window(models, arch, backend):
    path, hf = models(arch)
    llm = LLM(model=path, attention=BACKENDS[backend], kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64})
    p = prompts(hf.config.vocab_size, count=1, seed=3)[0] + list(range(30, 70))
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0].log_softmax(-1)
    for pos, entry in enumerate(out.prompt_logprobs[1:]):
        assert entry[p[pos + 1]].logprob == pytest.approx(ref[pos, p[pos + 1]].item(), abs=5e-5)


@pytest.mark.parametrize("dropped", ["window", "softcap"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_without_the_window_or_the_softcap_gemma2_leaves_hf(models, monkeypatch, backend, dropped):
    """The parity above depends on both: a backend that ignores either gives other tokens."""
    from modserve.plugins.attention import cpu_backend, torch_backend

    cls = {"torch": torch_backend.TorchAttention, "cpu": cpu_backend.CpuAttention}[backend]
    original = cls.for_layer
    monkeypatch.setattr(cls, "for_layer", lambda self, w=None, c=None: original(
        self, None if dropped == "window" else w, None if dropped == "softcap" else c))
    path, hf = models("gemma2")
    ps = [p for p in prompts(hf.config.vocab_size, count=8, seed=4) if len(p) > 24]
    llm = LLM(model=path, attention={"plugin": backend}, kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64})
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    assert got != [hf_greedy(hf, p, 16) for p in ps]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_mistral_with_a_window_shorter_than_max_model_len_matches_hf(tmp_path, backend):
    """Served past its sliding window (refused before per-layer windows existed)."""
    hf = build_model(str(tmp_path), "mistral", sliding_window=16)
    ps = prompts(hf.config.vocab_size, count=6, seed=2)
    llm = LLM(model={"path": str(tmp_path), "max_model_len": 256}, attention={"plugin": backend},
              kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64})
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    assert got == [hf_greedy(hf, p, 16) for p in ps]


def test_a_backend_without_for_layer_is_refused_by_name_for_a_windowed_model(models):
    """A third-party attention backend written before ``for_layer``: a Gemma model names it and
    the features it lacks."""
    import types

    from modserve.core.contract import AttentionBackend, NoOptions, hookimpl
    from modserve.core.engine_factory import build_components
    from modserve.core.plugin_manager import PluginRegistry

    class LegacyAttention(AttentionBackend):
        Config = NoOptions

        def forward(self, q, k, v, cache, meta):
            raise NotImplementedError

    @hookimpl
    def register_attention_backends():
        return {"legacy_test_attention": LegacyAttention}

    module = types.ModuleType("legacy_attention_plugin")
    module.MODSERVE_CONTRACT = "2.0"
    module.register_attention_backends = register_attention_backends
    registry = PluginRegistry()
    registry.register_module(module)
    path, _ = models("gemma2")
    with pytest.raises(ValueError, match=r"attention backend LegacyAttention \(.*\) does not support a sliding "
                                         r"window and logit soft-capping"):
        build_components(None, registry, model={"path": path},
                         attention={"plugin": "legacy_test_attention"}, kv_cache={"plugin": "paged", "num_blocks": 64})


# ----------------------------------------------------------------------------- Granite's multipliers

GRANITE_DEFAULTS = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0, "attention_scale": None}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_granite_matches_hf_on_each_backend(models, backend):
    """The attention multiplier reaches every backend's q.k scale: a batch, chunks, prefix hits,
    preemption and logits, with HF's values."""
    path, hf = models("granite")
    ps = prompts(hf.config.vocab_size, count=8, seed=4)
    llm = LLM(model=path, attention=BACKENDS[backend], kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 128})
    assert [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)] == [
        hf_greedy(hf, p, 16) for p in ps]
    p = ps[0] + [7, 8, 9]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0].log_softmax(-1)
    for pos, entry in enumerate(out.prompt_logprobs[1:]):
        assert entry[p[pos + 1]].logprob == pytest.approx(ref[pos, p[pos + 1]].item(), abs=5e-5)
    check_chunks_prefix_hits_and_preemption(path, hf, step_tokens=16, attention=BACKENDS[backend])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dropped", list(GRANITE_DEFAULTS))
def test_without_any_one_multiplier_granite_leaves_hf(models, monkeypatch, dropped, dtype):
    """The parity above depends on each multiplier, in float32 and with bf16's fused CPU ops
    (the add+RMSNorm kernel adds a residual already scaled): reset to its Llama value, the
    embedding, residual or attention multiplier changes the greedy tokens, the logits scaling
    (which keeps the argmax) the logprobs."""
    from modserve.plugins.models.granite import Granite

    original = Granite.spec
    monkeypatch.setattr(Granite, "spec", lambda self, cfg, source: setattr(
        spec := original(self, cfg, source), dropped, GRANITE_DEFAULTS[dropped]) or spec)
    path, hf = models("granite")
    llm = LLM(model={"path": path, "dtype": dtype}, kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64})
    p = prompts(hf.config.vocab_size, count=1, seed=11)[0] + list(range(30, 90))
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0].log_softmax(-1)
    entries = out.prompt_logprobs[1:]
    if dropped == "logits_scaling":
        gaps = [abs(e[p[i + 1]].logprob - ref[i, p[i + 1]].item()) for i, e in enumerate(entries)]
        assert max(gaps) > 0.1, max(gaps)  # parity: within 5e-5
    else:
        top = [max(e.values(), key=lambda lp: lp.logprob).token_id for e in entries]
        agree = sum(int(t == r) for t, r in zip(top, ref[:-1].argmax(-1).tolist())) / len(top)
        assert agree < 0.7, agree


def test_granite_tp2_matches_hf(models):
    """Sharded over two ranks (the residual multiplier scales the all-reduced sublayer
    outputs, the logits scaling the gathered logits): HF's greedy tokens."""
    path, hf = models("granite")
    ps = prompts(hf.config.vocab_size, count=6, seed=4)
    llm = LLM(model={"path": path, "max_model_len": 160}, parallel={"tensor_parallel_size": 2},
              kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64})
    try:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    finally:
        llm.engine.shutdown()
    assert got == [hf_greedy(hf, p, 16) for p in ps]
