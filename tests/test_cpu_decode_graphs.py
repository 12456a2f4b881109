"""CPU decode steps replayed as recorded kernel call lists (``core/native_calls.py``).

What could go wrong, and is checked here: a replay that reads the step's inputs from stale
copies (tokens would differ from the eager engine's), a torch operator or an unrecorded
ctypes call inside the forward (a replay would skip it: capture must refuse), a padding or
warm-up row writing K/V at slot -1, and sizes captured more than once.
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading

import pytest
import torch
from tiny_models import build_model, prompts

from modserve import LLM, SamplingParams
from modserve.core import native_calls
from modserve.core.models import cpu_fused
from modserve.plugins.attention import cpu_kernel_build
from modserve.plugins.platforms import cpu

NATIVE_LINEARS = cpu.avx512_bf16_unavailable() is None or cpu.amx_unavailable(cpu.amx_linear.load) is None


# ----------------------------------------------------------------------------- the recorder


def norm_then_rope(x, weight, cos, sin):
    """Three recordable kernels and views: rms_norm, RoPE in place on two heads, SiLU·mul."""
    normed = cpu_fused.add_rms_norm(x, None, weight, 1e-6)
    cpu_fused.rope_(normed, cos, sin, 2, 16)
    return cpu_fused.silu_mul(normed)


def test_a_replay_computes_on_the_inputs_current_values():
    torch.manual_seed(0)
    x, weight = torch.randn(3, 64), torch.randn(64)
    cos, sin = torch.randn(3, 16), torch.randn(3, 16)
    replay = native_calls.capture(norm_then_rope, (x, weight, cos, sin))
    assert replay.calls.names == ["modserve_add_rms_norm", "modserve_rope", "modserve_silu_mul"]
    for _ in range(2):
        for t in (x, weight, cos, sin):
            t.copy_(torch.randn(t.shape))
        out = replay()
        torch.testing.assert_close(out, norm_then_rope(x, weight, cos, sin), rtol=0, atol=0)
    assert replay() is out  # the same output tensor every replay, as a CUDA graph's


def test_a_torch_operator_in_the_forward_is_refused_by_name():
    def with_add(x, weight):
        return cpu_fused.add_rms_norm(x + 1, None, weight, 1e-6)

    with pytest.raises(native_calls.NotReplayable, match=r"aten\.add\.Tensor"):
        native_calls.capture(with_add, (torch.randn(2, 8), torch.ones(8)))


def test_a_kernel_called_around_the_recorder_is_caught_by_the_poisoned_replay():
    raw = cpu_fused.load().add_rms_norm.fn  # the ctypes function itself: its calls are not recorded

    def unrecorded(x, weight):
        out = torch.empty_like(x)
        raw(0, x.data_ptr(), x.stride(0), None, weight.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], 1e-6, 0, 1)
        return cpu_fused.silu_mul(out)

    with pytest.raises(native_calls.NotReplayable, match="outside NativeFunction"):
        native_calls.capture(unrecorded, (torch.randn(2, 8), torch.ones(8)))


def test_an_aliasing_operator_that_copies_is_refused():
    """Under inference mode ``reshape`` dispatches as itself, an operator that may alias; on a
    strided view it copies (Qwen3's per-head q norm did, and replays went stale)."""
    qkv = torch.randn(2, 96)

    def strided_rows(x, weight):
        return cpu_fused.add_rms_norm(x[:, :64].reshape(8, 16), None, weight, 1e-6)

    with torch.inference_mode(), pytest.raises(native_calls.NotReplayable, match=r"aten\.reshape\.default copies"):
        native_calls.capture(strided_rows, (qkv, torch.ones(16)))


def test_another_threads_kernels_are_not_recorded():
    """Only the capturing thread's calls join the list (a second engine in the process runs its own)."""
    other = torch.randn(2, 32)

    def with_a_thread(x, weight):
        worker = threading.Thread(target=cpu_fused.silu_mul, args=(other,))
        worker.start()
        worker.join()
        return cpu_fused.add_rms_norm(x, None, weight, 1e-6)

    replay = native_calls.capture(with_a_thread, (torch.randn(2, 8), torch.ones(8)))
    assert replay.calls.names == ["modserve_add_rms_norm"]


def test_only_one_capture_at_a_time():
    cos, sin = torch.ones(2, 16), torch.zeros(2, 16)

    def nested(x, weight):
        native_calls.capture(norm_then_rope, (x, weight, cos, sin))
        return cpu_fused.silu_mul(x)

    with pytest.raises(native_calls.NotReplayable, match="already running"):
        native_calls.capture(nested, (torch.randn(2, 64), torch.ones(64)))


@pytest.mark.parametrize(("table_dtype", "out_dtype"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                        (torch.bfloat16, torch.float32), (torch.float32, torch.float32)])  # fmt: skip
def test_gather_rows_is_index_then_cast(table_dtype, out_dtype):
    table = (torch.randn(50, 24) * 3).to(table_dtype)
    index = torch.tensor([7, 0, 49, 7, 3])
    assert torch.equal(cpu_fused.gather_rows(table, index, out_dtype), table[index].to(out_dtype))
    with pytest.raises(IndexError, match="50 rows"):
        cpu_fused.gather_rows(table, torch.tensor([1, 50]), out_dtype)


def test_a_new_row_at_slot_minus_one_writes_nothing():
    """Decode graphs' padding and warm-up rows carry slot -1 (a CUDA graph's convention)."""
    k_cache = torch.zeros(2, 4, 1, 8)  # blocks, block size, KV heads, head_dim
    v_cache = torch.zeros_like(k_cache)
    q, out = torch.randn(1, 1, 8), torch.empty(1, 1, 8)
    new = torch.ones(1, 1, 8)
    cpu_kernel_build.paged_attention(
        q, out, k_cache, v_cache, None, None, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0]),
        torch.tensor([0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), 0.35,
        new_kv=(new, new, torch.tensor([-1])),
    )  # fmt: skip
    assert not k_cache.any() and not v_cache.any()


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama_graphs"))
    build_model(path, "llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    return path


def engine(path: str, dtype: str, graphs: bool, kv_dtype: str = "auto") -> LLM:
    return LLM(
        model={"path": path, "dtype": dtype, "max_model_len": 256},
        device={"plugin": "cpu", "decode_graphs": graphs, **({"graph_max_batch": 4} if graphs else {})},
        kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 64, "kv_dtype": kv_dtype},
        scheduler={"plugin": "fcfs", "max_num_seqs": 5},
    )


def run(llm: LLM) -> list[list[int]]:
    """Five prompts with different output lengths: the batch shrinks 5 -> 1 as they finish
    (5 requests: past graph_max_batch, eager; then 4, 3, 2, 1 from call lists)."""
    ps = prompts(llm.engine.c.spec.vocab_size, count=5, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6, 9, 12, 30)]
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]


@pytest.mark.skipif(not NATIVE_LINEARS, reason="bfloat16 linears are oneDNN's here (no AVX512_BF16 or AMX): nothing to record")
def test_call_lists_give_the_eager_tokens_and_kv(model_dir):
    eager = engine(model_dir, "bfloat16", graphs=False)
    want = run(eager)
    llm = engine(model_dir, "bfloat16", graphs=True)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.sizes == (1, 2, 3, 4)
    assert run(llm) == want
    assert graphs.unavailable is None and all(graphs.replays[s] > 0 for s in graphs.sizes), graphs.replays
    captured = dict(graphs.captured)
    # the same kernels on the same rows: the caches hold what the eager engine wrote, bit for bit
    for mine, theirs in zip(llm.engine.kv.layer_caches(), eager.engine.kv.layer_caches()):
        assert torch.equal(mine.k, theirs.k) and torch.equal(mine.v, theirs.v)
    assert run(llm) == want  # a second round replays the lists it has (prefix hits this time)
    assert graphs.captured == captured


# each one's torch ops as kernels (docs); experts as one kernel where the linears are AVX512_BF16 panels
NATIVE_EXPERTS = cpu.avx512_bf16_unavailable() is None and cpu.amx_unavailable(cpu.amx_linear.load) is not None
REPLAYED = ("mistral", "qwen3", "olmo2", "granite", "phi3", "gemma2", "gemma3_text") + (("mixtral", "qwen3_moe") if NATIVE_EXPERTS else ())


@pytest.mark.skipif(not NATIVE_LINEARS, reason="bfloat16 linears are oneDNN's here: no call lists at all")
@pytest.mark.parametrize("arch", ["qwen3", "olmo2", "phi3", "gemma2", "gemma3_text", "granite", "mistral", "mixtral", "qwen3_moe"])
def test_every_architecture_keeps_its_tokens(tmp_path, arch):
    """Replayed where the forward is all recorded kernels, eager where the capture refused:
    the tokens are the eager engine's either way."""
    build_model(str(tmp_path), arch)
    want = run(engine(str(tmp_path), "bfloat16", graphs=False))
    llm = engine(str(tmp_path), "bfloat16", graphs=True)
    assert run(llm) == want
    graphs = llm.engine.runner.graphs  # None where the model refused before any capture (experts in torch)
    replayed = graphs is not None and graphs.unavailable is None
    assert replayed == (arch in REPLAYED), graphs and graphs.unavailable  # the others compute in torch


def test_linears_that_multiply_through_torch_turn_call_lists_off_and_say_so(model_dir, caplog):
    """float32 linears are oneDNN's (torch operators): no decode step could be a call list."""
    want = run(engine(model_dir, "float32", graphs=False))
    with caplog.at_level(logging.INFO, logger="modserve"):
        llm = engine(model_dir, "float32", graphs=True)
        assert run(llm) == want
    assert llm.engine.runner.graphs is None
    assert re.search(r"device\.decode_graphs: off, linear layers\.0\.self_attn\.qkv_proj multiplies through torch", caplog.text)


@pytest.mark.skipif(not NATIVE_LINEARS, reason="bfloat16 linears are oneDNN's here: no call lists at all")
def test_an_int8_kv_cache_replays_with_the_eager_tokens_and_bytes(model_dir):
    """The attention kernel quantizes the new K/V rows itself, so an int8 cache's decode steps
    record: tokens, codes and scales as the eager engine's."""
    eager = engine(model_dir, "bfloat16", graphs=False, kv_dtype="int8")
    want = run(eager)
    llm = engine(model_dir, "bfloat16", graphs=True, kv_dtype="int8")
    assert run(llm) == want
    graphs = llm.engine.runner.graphs
    assert graphs.unavailable is None and all(graphs.replays[s] > 0 for s in graphs.sizes), graphs.replays
    for mine, theirs in zip(llm.engine.kv.layer_caches(), eager.engine.kv.layer_caches()):
        assert all(torch.equal(a, b) for a, b in ((mine.k, theirs.k), (mine.v, theirs.v), (mine.k_scale, theirs.k_scale)))


def test_the_float_slots_carry_float32_bits():
    fn = cpu_fused.load().add_rms_norm
    calls = native_calls.CallList()
    calls.add(fn, (1, 2, 3, None, 4, 5, 6, 7, 8, 0.5, 0, 2))
    assert calls.words[2:] == [1, 2, 3, 0, 4, 5, 6, 7, 8, int.from_bytes(bytes(ctypes.c_float(0.5)), "little"), 0, 2]
