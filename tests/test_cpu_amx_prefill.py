"""Causal bfloat16 prefill attention on AMX tiles (``attention: {plugin: cpu, prefill_kernel:
auto | amx | sdpa}``): as close to float32 attention as SDPA's bfloat16 flash kernel is, for
chunks with and without cached context, GQA and MHA, head sizes 64 and 128; the engine keeps
HF's tokens through chunked prefill and prefix hits; asking for it where it cannot run is
refused by name. Kernel tests run where the CPU has AMX-BF16; the refusals run everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modserve import LLM, SamplingParams
from modserve.plugins.attention import cpu_amx_prefill
from modserve.plugins.platforms import cpu

HAS_AMX = cpu_amx_prefill.unavailable(torch.bfloat16, 64) is None
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-BF16 (or no compiler targets it)")


def _sdpa(q, k, v, scale, dtype):
    """Causal attention of q's rows at the last positions of k, v, computed in ``dtype``."""
    n_q, heads, _ = q.shape
    n_k, kv_heads, _ = k.shape
    g = heads // kv_heads
    mask = torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]
    qq = q.to(dtype).transpose(0, 1)[None]
    kk = k.to(dtype).repeat_interleave(g, 1).transpose(0, 1)[None]
    vv = v.to(dtype).repeat_interleave(g, 1).transpose(0, 1)[None]
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)[0].transpose(0, 1)


@needs_amx
@pytest.mark.parametrize("n_q,n_k,heads,kv_heads,d", [
    (1, 1, 9, 3, 64), (17, 17, 9, 3, 64), (256, 256, 9, 3, 64), (40, 100, 9, 3, 64),  # 60 cached keys
    (300, 300, 4, 4, 128), (33, 70, 8, 2, 128), (1000, 1000, 2, 1, 64), (5, 530, 4, 2, 64),
])  # fmt: skip
def test_as_close_to_float32_attention_as_sdpa_in_bfloat16(n_q, n_k, heads, kv_heads, d):
    g = torch.Generator().manual_seed(n_q * 7 + n_k)
    q = torch.randn(n_q, heads, d, generator=g).bfloat16()
    k = torch.randn(n_k, kv_heads, d, generator=g).bfloat16()
    v = torch.randn(n_k, kv_heads, d, generator=g).bfloat16()
    scale = d**-0.5
    want = _sdpa(q, k, v, scale, torch.float32)
    sdpa_error = (_sdpa(q, k, v, scale, torch.bfloat16).float() - want).abs().max().item()
    out = torch.full_like(q, float("nan"))
    cpu_amx_prefill.attend(q, k, v, out, scale)
    error = (out.float() - want).abs().max().item()
    assert error <= max(1.5 * sdpa_error, 1e-2), (error, sdpa_error)


@needs_amx
def test_strided_query_rows_and_an_output_view():
    """q, k, v as views into fused qkv rows (the model's layout), out a slice of the step's rows."""
    qkv = torch.randn(50, (9 + 2 * 3) * 64).bfloat16()
    q = qkv[:, : 9 * 64].view(50, 9, 64)
    k = qkv[:, 9 * 64 : 12 * 64].view(50, 3, 64)
    v = qkv[:, 12 * 64 :].view(50, 3, 64)
    out = torch.zeros(60, 9, 64, dtype=torch.bfloat16)
    cpu_amx_prefill.attend(q[10:], k, v, out[5:45], 0.125)
    want = _sdpa(q[10:], k, v, 0.125, torch.float32)
    torch.testing.assert_close(out[5:45].float(), want, atol=2e-2, rtol=2e-2)
    assert out[:5].abs().sum() == 0 and out[45:].abs().sum() == 0  # nothing written outside the view


@pytest.fixture(scope="module")
def llama_d64(tmp_path_factory):
    from tiny_models import build_model

    path = str(tmp_path_factory.mktemp("llama_d64"))
    return path, build_model(path, "llama", num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=128)


@needs_amx
def test_engine_keeps_hf_tokens_through_chunks_and_prefix_hits(llama_d64):
    """A bfloat16 model with head_dim 64 (the kernel takes chunks over 16 tokens here):
    - a 90-token prompt prefilled in 40-token chunks (the later ones over cached context):
      teacher-forced top-1 against HF float32 as the other bfloat16 tests, and its prompt
      logprobs next to the SDPA engine's;
    - a second prompt sharing its first 64 tokens (a prefix hit, then a chunk over the cached
      blocks): the same generated tokens and logprobs as the SDPA engine, and HF's first token."""
    path, hf = llama_d64
    prompt = list(range(5, 95))
    other = prompt[:64] + list(range(200, 226))
    runs = {}
    for kernel in ("amx", "sdpa"):
        llm = LLM(
            model={"path": path, "dtype": "bfloat16"},
            attention={"plugin": "cpu", "prefill_kernel": kernel, "max_query_len": 16},
            kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64, "prefix_caching": True},
            scheduler={"plugin": "fcfs", "max_num_batched_tokens": 40},
        )  # fmt: skip
        assert llm.engine.runner.attention.amx_prefill is (kernel == "amx")
        first = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
        second = llm.generate({"prompt_token_ids": other}, SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True))[0]
        assert second.num_cached_tokens == 64
        runs[kernel] = (first, second)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].argmax(-1)
        ref_other = hf(torch.tensor([other])).logits[0, -1].argmax().item()
    first = runs["amx"][0]
    top = [max(e.values(), key=lambda lp: lp.logprob).token_id for e in first.prompt_logprobs[1:]]
    agree = sum(int(t == r) for t, r in zip(top, ref[:-1].tolist())) / len(top)
    assert agree >= 0.95, agree
    amx_lp = [e[t].logprob for e, t in zip(first.prompt_logprobs[1:], prompt[1:])]
    sdpa_lp = [e[t].logprob for e, t in zip(runs["sdpa"][0].prompt_logprobs[1:], prompt[1:])]
    assert max(abs(a - b) for a, b in zip(amx_lp, sdpa_lp)) < 0.1
    a, b = runs["amx"][1].outputs[0], runs["sdpa"][1].outputs[0]
    assert a.token_ids[0] == ref_other and a.token_ids == b.token_ids
    assert max(abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids)) < 0.1


def test_prefill_kernel_amx_is_refused_where_it_cannot_run(monkeypatch, tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(Exception, match=r"attention\.prefill_kernel: amx cannot run here: it runs bfloat16 models, not torch\.float32"):
        LLM(model={"path": path, "dtype": "float32"}, attention={"plugin": "cpu", "prefill_kernel": "amx"})
    with pytest.raises(Exception, match=r"attention\.prefill_kernel: amx cannot run here: it takes head_dim 64 or 128, not 16"):
        LLM(model={"path": path, "dtype": "bfloat16"}, attention={"plugin": "cpu", "prefill_kernel": "amx"})
    with pytest.raises(Exception, match=r"attention\.prefill_kernel: expected one of auto, amx, sdpa, got 'flash'"):
        LLM(model={"path": path}, attention={"plugin": "cpu", "prefill_kernel": "flash"})


@needs_amx
def test_prefill_kernel_amx_is_refused_for_an_int8_cache_and_windowed_layers(llama_d64, tmp_path):
    """Asked for explicitly, the AMX kernel never hands chunks to SDPA behind the user's back;
    auto does, and says nothing (an int8 cache, Gemma's windowed and soft-capped layers)."""
    path, _ = llama_d64
    int8 = {"plugin": "paged", "num_blocks": 64, "kv_dtype": "int8"}
    with pytest.raises(Exception, match=r"attention\.prefill_kernel: amx cannot run here: it reads bfloat16 KV caches, not int8"):
        LLM(model={"path": path, "dtype": "bfloat16"}, attention={"plugin": "cpu", "prefill_kernel": "amx"}, kv_cache=int8)
    llm = LLM(model={"path": path, "dtype": "bfloat16"}, attention={"plugin": "cpu"}, kv_cache=int8)
    assert llm.engine.runner.attention.amx_prefill is False
    from tiny_models import build_model

    gemma = str(tmp_path / "gemma2")
    build_model(gemma, "gemma2")
    with pytest.raises(Exception, match=r"attention\.prefill_kernel: amx takes no sliding window or logit soft-cap"):
        LLM(model={"path": gemma, "dtype": "bfloat16"}, attention={"plugin": "cpu", "prefill_kernel": "amx"},
            kv_cache={"plugin": "paged", "num_blocks": 64})
        LLM(model={"path": path}, attention={"plugin": "cpu", "prefill_kernel": "flash"})


def test_prefill_kernel_amx_is_refused_on_a_cpu_without_amx(monkeypatch, llama_d64):
    path, _ = llama_d64
    monkeypatch.setattr(cpu, "cpu_model_and_flags", lambda: ("a CPU without AMX", frozenset({"avx2", "avx512f"})))
    with pytest.raises(Exception, match=r"attention\.prefill_kernel: amx cannot run here: this CPU \(a CPU without AMX\) has no AMX-BF16"):
        LLM(model={"path": path, "dtype": "bfloat16"}, attention={"plugin": "cpu", "prefill_kernel": "amx"})
    llm = LLM(model={"path": path, "dtype": "bfloat16"}, attention={"plugin": "cpu"}, kv_cache={"plugin": "paged", "num_blocks": 64})
    assert llm.engine.runner.attention.amx_prefill is False  # auto: SDPA there
