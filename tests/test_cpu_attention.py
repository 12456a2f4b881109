"""The ``cpu`` attention backend: its compiled kernel against SDPA, end to end against HF,
and its start-up refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modserve import LLM, SamplingParams
from modserve.core.config import ConfigError
from modserve.core.engine_factory import resolve
from modserve.core.kv_quant import quantize_per_token_head
from modserve.plugins.attention import cpu_kernel_build
from modserve.plugins.attention.cpu_backend import CpuAttention
from modserve.plugins.attention.torch_backend import TorchAttention

from tiny_models import hf_greedy, prompts
from tiny_models import build_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def reference(q, k_rows, v_rows, pos, scale):
    """Plain SDPA of one query token [H, D] over its sequence's rows 0..pos."""
    h, kvh = q.shape[0], k_rows.shape[1]
    k = k_rows[: pos + 1].transpose(0, 1).repeat_interleave(h // kvh, 0)
    v = v_rows[: pos + 1].transpose(0, 1).repeat_interleave(h // kvh, 0)
    return F.scaled_dot_product_attention(q[:, None], k, v, scale=scale)[:, 0]


# The standard build takes the AVX-512 path for head_dim 64 and 128 where the CPU has it; the
# "-mno-avx512f" build the AVX2 path (where the CPU has AVX2), and "-mno-avx2" too the portable
# loops, on the same CPU, so all three are checked here.
BUILDS = {"native": (), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx512f", "-mno-avx2")}


# Query rows per sequence (lengths 1, 17, 40, 100, 600): "verify" takes each one's last 3
# positions (tiles of 3 rows); "prefill" takes all of the first three and positions 37..99
# of the fourth, a chunk after cached context (tiles of 16 rows crossing 16-key chunks and
# blocks); "decode" the last position of each (single rows, each item all KV heads; the
# 600-token one crosses the bf16 and float32 paths' 256-key segments); "decode_one" only the 600-token
# one's (a lone row: its positions cut in one part per thread, merged afterwards, on every
# path); "decode_two" the 100- and 600-token ones', run on four threads (the long row in two
# parts, the short one, too short for two parts, by KV head).
QUERIES = {
    "verify": lambda n, i: range(max(0, n - 3), n) if n < 600 else [],
    "prefill": lambda n, i: range(37 if i == 3 else 0, n) if n < 600 else [],
    "decode": lambda n, i: [n - 1],
    "decode_one": lambda n, i: [n - 1] if n == 600 else [],
    "decode_two": lambda n, i: [n - 1] if n >= 100 else [],
}
THREADS = {"decode_two": 4}  # the kernel's OpenMP threads where not torch's default


@pytest.mark.parametrize("queries", list(QUERIES))
@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,dtype,q_bf16",
    [
        (9, 3, 64, 16, torch.float32, False),  # SmolLM2's shape
        (4, 4, 32, 16, torch.float32, False),  # MHA, a head size without a specialised path
        (4, 4, 64, 16, torch.float32, False),  # MHA with tiles: 48 rows each (prefill: a 63-row chunk, 48 + 15)
        (8, 1, 128, 32, torch.float32, False),  # MQA; blocks of 32 are two 16-token chunks
        (9, 3, 64, 16, torch.bfloat16, False),
        (8, 2, 128, 8, torch.bfloat16, False),  # blocks smaller than a 16-token chunk
        (6, 2, 64, 4, torch.float32, False),  # ... and than the AVX2 path's 8-token chunk
        (9, 3, 64, 16, torch.bfloat16, True),  # a bf16 model (bf16 q, out): decode rows may use bf16 dots
        (8, 2, 128, 8, torch.bfloat16, True),
        (4, 4, 32, 16, torch.bfloat16, True),  # ... only where the head size has the AVX-512 paths
        (9, 3, 64, 16, torch.int8, False),
        (8, 2, 128, 32, torch.int8, False),
    ],
)
def test_kernel_matches_sdpa_over_scattered_blocks(heads, kv_heads, head_dim, block_size, dtype, q_bf16, build, queries):
    """q is a strided view (as inside the qkv rows). Except for int8, the query positions' K/V
    rows start zeroed in the cache and arrive through ``new_kv``, as the backend passes them:
    the kernel must write them (and the tests' reference reads them) before attending."""
    g = torch.Generator().manual_seed(0)
    seqs = [1, 17, 40, 100, 600]  # lengths inside one block, across blocks, exactly ragged, across segments
    width = -(-max(seqs) // block_size)
    num_blocks = len(seqs) * width + 16
    k_all = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_all = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    if dtype == torch.int8:
        kq, ks = quantize_per_token_head(k_all)
        vq, vs = quantize_per_token_head(v_all)
        k_cache, v_cache, k_scale, v_scale = kq, vq, ks, vs
        k_all, v_all = kq.float() * ks[..., None], vq.float() * vs[..., None]  # what the cache means
    else:
        k_cache, v_cache, k_scale, v_scale = k_all.to(dtype), v_all.to(dtype), None, None
        k_all, v_all = k_cache.float(), v_cache.float()
    tables = torch.randperm(num_blocks, generator=g)[: len(seqs) * width].view(len(seqs), width).to(torch.int32)
    rows_seq, rows_pos = [], []
    for i, n in enumerate(seqs):
        for p in QUERIES[queries](n, i):
            rows_seq.append(i)
            rows_pos.append(p)
    io_dtype = torch.bfloat16 if q_bf16 else torch.float32
    q = torch.randn(len(rows_pos), heads * head_dim + 40, generator=g)[:, 8 : 8 + heads * head_dim]
    q = q.to(io_dtype).view(len(rows_pos), heads, head_dim)
    out = torch.full(q.shape, float("nan"), dtype=io_dtype)
    new_kv = None
    if dtype != torch.int8:
        slots = torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size for i, p in zip(rows_seq, rows_pos)])
        flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
        new_kv = (flat_k[slots].clone(), flat_v[slots].clone(), slots)
        flat_k[slots], flat_v[slots] = 0, 0  # only the kernel's write brings them back
    scale = head_dim**-0.5
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS.get(queries, threads))
    try:
        cpu_kernel_build.paged_attention(
            q, out, k_cache, v_cache, k_scale, v_scale, tables, torch.arange(len(rows_pos)),
            torch.tensor(rows_seq, dtype=torch.int32), torch.tensor(rows_pos, dtype=torch.int32), scale,
            cpu_kernel_build.load(BUILDS[build]), new_kv,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    q, out = q.float(), out.float()
    # in bf16, out is rounded to bf16 and decode rows may weight V by bf16-rounded probabilities
    tol = dict(atol=3e-3, rtol=1e-2) if q_bf16 else dict(atol=2e-5, rtol=1e-4)
    for r, (i, p) in enumerate(zip(rows_seq, rows_pos)):
        blocks = tables[i].long()
        k_rows = k_all[blocks].reshape(-1, kv_heads, head_dim)
        v_rows = v_all[blocks].reshape(-1, kv_heads, head_dim)
        torch.testing.assert_close(out[r], reference(q[r], k_rows, v_rows, p, scale), **tol)


@pytest.mark.parametrize("build", list(BUILDS))
def test_bfloat16_outputs_round_ties_to_even_as_torch_does(build):
    """With q = 0 every key weighs the same, so a row at position 1 outputs the exact mean of
    two V rows; V pairs one bf16 step apart make that mean a tie halfway between two bf16
    values, which torch rounds to the even one. Rows 0-1 of a sequence form a tile (the
    prefill path), a lone row at position 1 is a decode row; both paths and builds must
    round every element as torch's float32 -> bfloat16 cast does."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    lo = (torch.randn(kv_heads, head_dim, generator=g) * 4).bfloat16()
    hi = (lo.view(torch.int16) + 1).view(torch.bfloat16)  # the next bf16 value away from zero
    cache_k = torch.zeros(2, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    cache_v = torch.zeros_like(cache_k)
    cache_v[:, 0], cache_v[:, 1] = lo, hi
    tables = torch.tensor([[0], [1]], dtype=torch.int32)
    mean = (lo.float() + hi.float()) / 2  # exact in float32; every element a tie in bfloat16
    assert ((mean.bfloat16().float() - mean).abs() * 2 == (hi.float() - lo.float()).abs()).all()
    expected = mean.bfloat16().repeat_interleave(heads // kv_heads, 0)
    q = torch.zeros(3, heads, head_dim, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    cpu_kernel_build.paged_attention(
        q, out, cache_k, cache_v, None, None, tables, torch.arange(3), torch.tensor([0, 0, 1], dtype=torch.int32),
        torch.tensor([0, 1, 1], dtype=torch.int32), head_dim**-0.5, cpu_kernel_build.load(BUILDS[build]),
    )  # fmt: skip
    assert torch.equal(out[1], expected), "tile row"
    assert torch.equal(out[2], expected), "decode row"


def test_kernel_leaves_rows_it_was_not_given():
    q = torch.randn(3, 2, 64)
    out = torch.zeros_like(q)
    cache = torch.randn(4, 16, 2, 64)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    cpu_kernel_build.paged_attention(
        q, out, cache, cache, None, None, tables, torch.tensor([1]), torch.tensor([0], dtype=torch.int32),
        torch.tensor([20], dtype=torch.int32), 0.125,
    )  # fmt: skip
    assert out[0].abs().sum() == 0 and out[2].abs().sum() == 0 and out[1].abs().sum() > 0


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("max_query_len", [1, 4096])
def test_greedy_output_matches_hf(tiny_models, arch, max_query_len):
    """max_query_len 1: decode rows only in the kernel; 4096: prefill chunks (with cached
    context, under a small token budget) run in the kernel too."""
    path, hf = tiny_models[arch]
    llm = LLM(
        model=path,
        attention={"plugin": "cpu", "max_query_len": max_query_len},
        kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 256},
        scheduler={"plugin": "fcfs", "max_num_batched_tokens": 40},
    )
    assert isinstance(llm.engine.c.attention, CpuAttention)
    ps = prompts(hf.config.vocab_size, count=8, seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24), f"prompt of {len(p)} tokens diverged"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_rows_into_an_int8_cache_are_write_kvs_bytes(dtype):
    """The kernel quantizes the step's new K/V rows itself (a decode step stays one recordable
    call): codes and scales bit for bit those of torch's write_kv; slot -1 writes nothing."""
    from modserve.core.contract import LayerKVCache
    from modserve.plugins.attention.torch_backend import write_kv

    H, KVH, D, bs = 4, 2, 64, 16
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(5, KVH, D, generator=g).mul_(torch.rand(5, KVH, 1, generator=g) * 8).to(dtype) for _ in "kv")
    k[2, 1] = 0  # an all-zero head: the 1e-8 floor
    slots = torch.tensor([3, 17, 40, -1, 63])

    def cache():
        return LayerKVCache(torch.zeros(4, bs, KVH, D, dtype=torch.int8), torch.zeros(4, bs, KVH, D, dtype=torch.int8),
                            torch.zeros(4, bs, KVH), torch.zeros(4, bs, KVH))  # fmt: skip

    mine, theirs = cache(), cache()
    keep = slots >= 0
    write_kv(k[keep], v[keep], theirs, slots[keep])
    q = torch.randn(5, H, D).to(dtype)
    cpu_kernel_build.paged_attention(
        q, torch.empty_like(q), mine.k, mine.v, mine.k_scale, mine.v_scale, torch.tensor([[0, 1, 2, 3]], dtype=torch.int32),
        torch.tensor([0]), torch.tensor([0], dtype=torch.int32), torch.tensor([63], dtype=torch.int32), 0.125, new_kv=(k, v, slots),
    )  # fmt: skip
    for a, b in ((mine.k, theirs.k), (mine.v, theirs.v), (mine.k_scale, theirs.k_scale), (mine.v_scale, theirs.v_scale)):
        assert torch.equal(a, b)


def test_kernel_refuses_what_it_cannot_read():
    """Each wrong input is a ValueError naming it, before any memory is touched."""
    H, KVH, D = 4, 2, 64
    cache = torch.zeros(4, 16, KVH, D)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    rows, seq, pos = torch.tensor([0]), torch.tensor([0], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    q = torch.randn(1, H, D)
    k, v, slots = torch.randn(1, KVH, D), torch.randn(1, KVH, D), torch.tensor([3])

    v_cache = torch.zeros_like(cache)

    def call(q=q, out=None, cache=cache, new_kv=None):
        out = torch.empty_like(q) if out is None else out
        vc = v_cache if cache.dtype == v_cache.dtype else cache
        cpu_kernel_build.paged_attention(q, out, cache, vc, None, None, tables, rows, seq, pos, 0.125, new_kv=new_kv)

    with pytest.raises(ValueError, match="q and out must both be float32 or bfloat16, got torch.float32, torch.bfloat16"):
        call(out=torch.empty(1, H, D, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="q and out must both be float32 or bfloat16, got torch.float16"):
        call(q=q.half(), out=torch.empty(1, H, D, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"q needs contiguous heads, got strides \(256, 1, 4\)"):
        call(q=torch.randn(1, D, H).transpose(1, 2))  # heads interleaved within a token
    with pytest.raises(ValueError, match="new k rows must be torch.float32 with contiguous heads"):
        call(new_kv=(k.bfloat16(), v, slots))
    with pytest.raises(ValueError, match="new_kv slots must be contiguous int64, one per new row"):
        call(new_kv=(k, v, slots.int()))
    with pytest.raises(ValueError, match="new_kv slots must be contiguous int64, one per new row"):
        call(new_kv=(k, v, torch.tensor([3, 4])))
    with pytest.raises(ValueError, match="new k rows must be torch.float32 with contiguous heads"):  # int8: q's dtype
        call(cache=torch.zeros(4, 16, KVH, D, dtype=torch.int8), new_kv=(k.bfloat16(), v, slots))
    for name, args in (("block_tables", (tables.long(), rows, seq, pos)), ("rows", (tables, rows.int(), seq, pos)),
                       ("row_seq", (tables, rows, seq.long(), pos)), ("row_pos", (tables, rows, seq, torch.tensor([3, 4], dtype=torch.int32)))):  # fmt: skip
        with pytest.raises(ValueError, match=f"{name} must be contiguous torch.int"):
            cpu_kernel_build.step_rows(*args)
    step = cpu_kernel_build.step_rows(tables, rows, seq, pos, slots)
    with pytest.raises(ValueError, match="new_kv slots must be contiguous int64, one per new row"):
        cpu_kernel_build.attend(step, q, torch.empty_like(q), cache, v_cache, None, None, 0.125, new_kv=(k.repeat(2, 1, 1), v.repeat(2, 1, 1)))
    call(new_kv=(k, v, slots))  # and the same call, well formed, goes through
    assert torch.equal(cache.view(-1, KVH, D)[3], k[0]) and torch.equal(v_cache.view(-1, KVH, D)[3], v[0])


@pytest.fixture(scope="module")
def llama_head_dim_64(tmp_path_factory):
    """A tiny Llama with head_dim 64 (hidden 128, 2 heads, 1 KV head): the AVX-512 paths' size."""
    path = str(tmp_path_factory.mktemp("llama-hd64"))
    return path, build_model(path, "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)


def cpu_has_vector_tiles() -> bool:
    """AVX-512F, or AVX2 with FMA: the builds with tiles for head sizes 64 and 128."""
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split())
    return "avx512f" in flags or {"avx2", "fma"} <= flags


def test_default_sends_prefill_to_the_kernel_where_it_has_tiles(llama_head_dim_64, tiny_models):
    """head_dim 64 with AVX-512 or AVX2: every request in the kernel (tiles); otherwise chunks
    over 16 tokens go to SDPA. The AVX2 build has tiles too; the portable one never."""
    assert cpu_kernel_build.tiled(64) == cpu_has_vector_tiles()
    assert not cpu_kernel_build.tiled(32)
    assert cpu_kernel_build.load(BUILDS["avx2"]).modserve_tiled(64) == cpu_has_vector_tiles()
    assert not cpu_kernel_build.load(BUILDS["portable"]).modserve_tiled(64)
    kv = {"plugin": "paged", "num_blocks": 64}
    for path, want in ((llama_head_dim_64[0], 4096 if cpu_has_vector_tiles() else 16), (tiny_models["mistral"][0], 16)):
        llm = LLM(model={"path": path, "max_model_len": 512}, attention={"plugin": "cpu"}, kv_cache=kv)
        assert llm.engine.c.attention.max_query_len == want


def test_head_dim_64_greedy_output_matches_hf(llama_head_dim_64):
    """End to end through the paths a head_dim-64 model takes (tiled prefill, with cached
    context under a small token budget, then decode), token for token against HF."""
    path, hf = llama_head_dim_64
    llm = LLM(
        model=path, attention={"plugin": "cpu"}, kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 256},
        scheduler={"plugin": "fcfs", "max_num_batched_tokens": 40},
    )
    ps = prompts(hf.config.vocab_size, count=8, seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24), f"prompt of {len(p)} tokens diverged"


def test_bfloat16_decode_logprobs_agree_with_sdpa(llama_head_dim_64):
    """A bfloat16 model decoding through the kernel (bf16 dot products where the CPU has them):
    each generated token's logprob equals that token's logprob teacher-forced through the
    torch backend (SDPA), within bfloat16 noise. (Greedy tokens cannot be compared: this
    random model's logits are so flat that HF's own bf16 and fp32 runs part ways.) Measured:
    the kernel with or without bf16 dots, worst 0.06 and mean 0.012-0.015 nats; SDPA decoding
    against itself, 0.03 / 0.006; the same model in float32, 0.27 / 0.032."""
    path, hf = llama_head_dim_64
    kv = {"plugin": "paged", "block_size": 16, "num_blocks": 256}
    ours = LLM(model={"path": path, "dtype": "bfloat16"}, attention={"plugin": "cpu"}, kv_cache=kv)
    sdpa = LLM(model={"path": path, "dtype": "bfloat16"}, attention={"plugin": "torch"}, kv_cache=kv)
    ps = prompts(hf.config.vocab_size, count=6, seed=7)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    diffs = []
    for p, out in zip(ps, ours.generate([{"prompt_token_ids": p} for p in ps], params)):
        toks = out.outputs[0].token_ids
        got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, toks)]
        forced = sdpa.generate({"prompt_token_ids": p + toks}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        want = [forced.prompt_logprobs[len(p) + i][t].logprob for i, t in enumerate(toks)]
        diffs += [abs(a - b) for a, b in zip(got, want)]
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.025, (max(diffs), sum(diffs) / len(diffs))


def test_auto_picks_the_kernel_on_cpu_and_torch_without_a_compiler(tiny_models, monkeypatch, tmp_path, caplog):
    path, _ = tiny_models["llama"]
    base = {"model": {"path": path}, "device": "cpu", "attention": {"plugin": "auto"}}
    assert resolve(base).pipeline.attention["plugin"] == "cpu"
    assert resolve({**base, "model": {"path": path, "dtype": "float16"}}).pipeline.attention["plugin"] == "torch"
    monkeypatch.setenv("MODSERVE_CACHE_DIR", str(tmp_path))  # no cached build to fall back on
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_kernel_build.load.cache_clear()
    try:
        assert resolve(base).pipeline.attention["plugin"] == "torch"
        assert "using the torch backend" in caplog.text
        kv = {"plugin": "paged", "num_blocks": 64}
        llm = LLM({**base, "kv_cache": kv, "model": {"path": path, "max_model_len": 512}})
        assert isinstance(llm.engine.c.attention, TorchAttention)
        with pytest.raises(RuntimeError, match="compiling the cpu attention kernel failed"):
            LLM({**base, "attention": {"plugin": "cpu"}, "kv_cache": kv, "model": {"path": path, "max_model_len": 512}})
    finally:
        cpu_kernel_build.load.cache_clear()


def test_float16_is_refused_with_the_alternative(tiny_models):
    path, _ = tiny_models["llama"]
    with pytest.raises(ValueError, match=r"supports float32 and bfloat16 models.*plugin: torch"):
        LLM(model={"path": path, "dtype": "float16", "max_model_len": 512}, attention={"plugin": "cpu"},
            kv_cache={"plugin": "paged", "num_blocks": 64})


def test_bad_options_name_the_field(tiny_models):
    path, _ = tiny_models["llama"]
    with pytest.raises(Exception, match="attention.max_query_lenn|max_query_lenn"):
        resolve({"model": {"path": path}, "attention": {"plugin": "cpu", "max_query_lenn": 3}})
    with pytest.raises(ConfigError, match=r"attention\.max_query_len: expected int >= 1, got 0"):
        resolve({"model": {"path": path}, "attention": {"plugin": "cpu", "max_query_len": 0}})
    with pytest.raises(ConfigError, match=r"device\.pack_weights: expected bool, got 'yes'"):
        resolve({"model": {"path": path}, "device": {"plugin": "cpu", "pack_weights": "yes"}})
    with pytest.raises(ConfigError, match=r"model\.pack_cpu_weights: unknown key"):  # moved to the cpu platform
        resolve({"model": {"path": path, "pack_cpu_weights": True}})


def test_default_kernel_share_follows_the_machine(monkeypatch):
    """bf16 on AMX-BF16: chunks over 160 tokens go to SDPA (its flash kernel runs on AMX tiles);
    elsewhere the tiled kernel takes every chunk, or only up to 16 tokens without its tiles."""
    from modserve.core.contract import AttentionSpec
    from modserve.plugins.attention import cpu_backend

    def spec(dtype, head_dim=64):
        return AttentionSpec(9, 3, head_dim, 0.125, dtype, torch.device("cpu"), 16)

    monkeypatch.setattr(cpu_backend.kernel, "tiled", lambda head_dim: head_dim in (64, 128))
    for flags, dtype, want in [
        ({"avx512f", "amx_bf16"}, torch.bfloat16, 160),
        ({"avx512f", "amx_bf16"}, torch.float32, 4096),
        ({"avx512f", "avx512_bf16"}, torch.bfloat16, 4096),
    ]:
        monkeypatch.setattr(cpu_backend, "cpu_model_and_flags", lambda flags=flags: ("cpu", frozenset(flags)))
        assert cpu_backend.default_max_query_len(spec(dtype)) == want, (flags, dtype)
    assert cpu_backend.default_max_query_len(spec(torch.bfloat16, head_dim=48)) == 16
    assert cpu_backend.default_max_query_len(spec(torch.bfloat16), amx_prefill=True) == 32  # longer: AMX prefill kernel


def test_the_attention_benchmark_times_int8_decode_against_a_baseline_source(monkeypatch, capsys, tmp_path):
    """benchmarks/cpu_attention.py over an int8 cache, its decode steps and prefill tiles
    alternated against a build of another source (here: every output doubled), each A/B line
    reporting how far the two builds' outputs are apart. A decode output compared with itself
    (the same float32 tensor for both builds) once reported 0 for kernels that differ."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doubled = tmp_path / "cpu_paged_attention.cpp"  # its headers beside it, as `git archive REV native` leaves them
    doubled.write_text((root / "native" / "cpu_paged_attention.cpp").read_text())
    for header in (root / "native").glob("attention_*.h"):
        (tmp_path / header.name).write_text(header.read_text())
    rows = (root / "native" / "attention_rows.h").read_text()
    assert "inv = _mm512_set1_ps(1.f / l);" in rows and "const float inv = 1.f / l;" in rows  # put_head's
    (tmp_path / "attention_rows.h").write_text(rows.replace("inv = _mm512_set1_ps(1.f / l);", "inv = _mm512_set1_ps(2.f / l);")
                                               .replace("const float inv = 1.f / l;", "const float inv = 2.f / l;"))
    spec = importlib.util.spec_from_file_location("benchmark_cpu_attention", root / "benchmarks" / "cpu_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr("sys.argv", ["cpu_attention", "--dtype", "int8", "--batch", "3", "--context", "40", "--layers", "2",
                                     "--repeats", "1", "--baseline-source", str(doubled), "--rounds", "2"])
    module.main()
    out = capsys.readouterr().out
    assert "decode, 3 rows x 40 tokens, 2 layers, torch.int8:" in out
    ab = [line for line in out.splitlines() if "alternated rounds" in line]
    assert len(ab) == 3, out  # decode, then the two prefill shapes
    assert all(float(line.rsplit("max |diff| ", 1)[1]) > 0.01 for line in ab), out
    # the kernel over int8 codes against SDPA over their dequantized values, both in float32
    assert "prefill, 8 chunks x 256 tokens, one layer, torch.int8" in out


def test_the_identity_benchmark_passes_the_same_source_and_names_the_cases_a_changed_one_differs_on(capsys, tmp_path):
    """benchmarks/cpu_attention_identity.py: a copy of this tree's kernel is bit-identical on every
    case (exit 0); with put_head's division changed, every case differs, each named (exit 1)."""
    import importlib.util
    from pathlib import Path

    from modserve.plugins.platforms.cpu import cpu_model_and_flags

    if "avx2" not in cpu_model_and_flags()[1]:
        pytest.skip("the AVX2 build needs a CPU with AVX2")
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("benchmark_identity", root / "benchmarks" / "cpu_attention_identity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, change in (("same", lambda text: text), ("changed", lambda text: text.replace("const float inv = 1.f / l;", "const float inv = 2.f / l;"))):
        folder = tmp_path / name  # the source with its headers beside it, as `git archive REV native` leaves them
        folder.mkdir()
        for path in [root / "native" / "cpu_paged_attention.cpp", *(root / "native").glob("attention_*.h")]:
            (folder / path.name).write_text(change(path.read_text()) if path.name == "attention_rows.h" else path.read_text())
        code = module.main(["--baseline-source", str(folder / "cpu_paged_attention.cpp"), "--builds", "avx2", "--quick"])
        out = capsys.readouterr().out
        if name == "same":
            assert code == 0 and "240 of 240 cases bit-identical" in out and "differs" not in out, out
        else:
            assert code == 1 and "0 of 240 cases bit-identical" in out, out
            assert out.count("differs: avx2 build,") == 240, out
            assert "differs: avx2 build, torch.int8 cache, torch.bfloat16 q, head_dim 64, 4 query heads a KV head, blocks of 16, window 37, softcap 30.0, tiles, 2 threads" in out


@pytest.mark.parametrize("args, message", [
    (["--baseline-source", "/nonexistent/cpu_paged_attention.cpp"], "--baseline-source: no such file: /nonexistent/cpu_paged_attention.cpp"),
    (["--builds", "avx512,sse"], "--builds: expected some of avx512, avx2, got 'avx512,sse'"),
    (["--builds", ","], "--builds: expected some of avx512, avx2, got ','"),
])
def test_the_identity_benchmark_names_the_bad_option(capsys, args, message):
    """A missing source or an unknown build is refused before anything is built, naming the option."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("benchmark_identity", root / "benchmarks" / "cpu_attention_identity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    source = ["--baseline-source", str(root / "native" / "cpu_paged_attention.cpp")]
    with pytest.raises(SystemExit) as exit_:
        module.main((source if "--baseline-source" not in args else []) + args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
