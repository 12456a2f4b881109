"""Decode steps replayed from captured graphs (``core/decode_graphs.py``), without a GPU.

A test platform "captures" the way a CUDA graph does, minus CUDA: it keeps the function and
the tensors it was captured with, and a replay reruns it on whatever those tensors then
hold, with the attention plan ``prepare`` made at capture time. So everything a graph
depends on is exercised: the static input buffers, each step copied in, padding rows that
must write no K/V and must not disturb the real rows, a plan made for ``max_model_len`` long
rows serving short ones, buckets growing and shrinking as requests finish. The Triton
attention backend runs under its interpreter (the one capturable backend). On a GPU,
``scripts/gpu_check.py`` compares real CUDA graphs with eager steps the same way.
"""

from __future__ import annotations

import os
import sys

_TRITON_IMPORTED_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (see test_triton_e2e.py)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from reliability_helpers import registry  # noqa: E402
from tiny_models import interpreted_triton_llama, prompts  # noqa: E402

from modserve import LLM, SamplingParams  # noqa: E402
from modserve.core.engine import Engine  # noqa: E402
from modserve.core.engine_factory import build_components  # noqa: E402
from modserve.core.decode_graphs import graph_refusal  # noqa: E402
from modserve.plugins.platforms.cpu import CPUPlatform  # noqa: E402
from modserve.plugins.platforms.cuda import graph_sizes  # noqa: E402

SIZES = (1, 2, 4)
EAGER_CPU = {"plugin": "cpu", "decode_graphs": False}  # the cpu platform's own call lists off (tests/test_cpu_decode_graphs.py)


class ReplayingCPU(CPUPlatform):
    """A CUDA graph's contract on the CPU: ``replay()`` reruns the captured call on the
    captured tensors' current contents."""

    captured: list[int] = []

    def graph_batch_sizes(self) -> tuple[int, ...]:
        return SIZES

    def capture_graph(self, fn, example_args):
        type(self).captured.append(example_args[0].shape[0])
        fn(*example_args)  # the warm-up a real capture runs: must write no K/V (all rows padding)
        return lambda: fn(*example_args)


class DecliningCPU(ReplayingCPU):
    def capture_graph(self, fn, example_args):
        return None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return interpreted_triton_llama(tmp_path_factory, _TRITON_IMPORTED_COMPILED)


def engine(path: str, device, kv_dtype: str = "auto") -> RegistryLLM:
    reg = registry(platforms={"replay_cpu": ReplayingCPU, "declining_cpu": DecliningCPU})
    config = {
        "model": {"path": path, "dtype": "float32", "max_model_len": 256},
        "device": device,
        "attention": {"plugin": "triton", "prefill_block_m": 32, "block_n": 16, "decode_split_tokens": 32,
                      "decode_max_splits": 4},
        "kv_cache": {"plugin": "paged", "block_size": 16, "num_blocks": 64, "kv_dtype": kv_dtype},
        "scheduler": {"plugin": "fcfs", "max_num_seqs": 5},
    }
    return RegistryLLM(Engine(build_components(config, registry=reg)))


class RegistryLLM(LLM):
    """``LLM`` over an engine built with a test registry."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.tokenizer = engine, engine.tokenizer


def run(llm: LLM, vocab: int) -> list[list[int]]:
    """Five prompts with different output lengths: the batch shrinks 5 -> 1 as they finish, so
    steps of 5 (eager: past the largest size), 4, 3 (padded to 4), 2 and 1 requests."""
    ps = prompts(vocab, count=5, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 3, 4, 5, 8)]
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]


_EAGER: dict[str, tuple[LLM, list[list[int]]]] = {}


def eager_run(model_dir: str, kv_dtype: str = "auto") -> tuple[LLM, list[list[int]]]:
    """An engine with no graphs and its :func:`run` tokens, the reference every test compares
    with: made once a KV dtype (each run under the Triton interpreter costs seconds)."""
    if kv_dtype not in _EAGER:
        eager = engine(model_dir, EAGER_CPU, kv_dtype)
        _EAGER[kv_dtype] = eager, run(eager, eager.engine.c.spec.vocab_size)
    return _EAGER[kv_dtype]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_replayed_decode_steps_give_the_eager_tokens(model_dir, kv_dtype):
    eager, want = eager_run(model_dir, kv_dtype)
    vocab = eager.engine.c.spec.vocab_size
    ReplayingCPU.captured = []
    llm = engine(model_dir, {"plugin": "replay_cpu"}, kv_dtype)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.sizes == SIZES
    assert run(llm, vocab) == want
    assert ReplayingCPU.captured == [4, 2, 1]  # each size captured once, when first needed
    assert all(graphs.replays[s] > 0 for s in SIZES), graphs.replays
    # padding rows wrote no K/V: the caches hold what the eager engine wrote, slot for slot
    # (close, not equal: the captured plan splits decode rows into more partitions)
    for mine, theirs in zip(llm.engine.kv.layer_caches(), eager.engine.kv.layer_caches()):
        torch.testing.assert_close(mine.k.float(), theirs.k.float(), atol=0.02, rtol=0.01)
        torch.testing.assert_close(mine.v.float(), theirs.v.float(), atol=0.02, rtol=0.01)
    # a second round reuses the graphs, and the KV they wrote keeps prefix hits right
    assert run(llm, vocab) == want
    assert ReplayingCPU.captured == [4, 2, 1]
    # its last steps had one request: every row past it is padding again (a stale row would
    # write its old slot, by then perhaps another request's)
    assert (graphs.slots[1:] == -1).all() and (graphs.seq_lens[1:] == 1).all() and (graphs.block_tables[1:] == 0).all()


def test_start_up_capture_takes_every_size_largest_first(model_dir, caplog):
    eager, want = eager_run(model_dir)
    vocab = eager.engine.c.spec.vocab_size
    ReplayingCPU.captured = []
    llm = engine(model_dir, {"plugin": "replay_cpu"})
    with caplog.at_level("INFO", logger="modserve.engine"):
        llm.engine.capture_graphs()
    assert ReplayingCPU.captured == [4, 2, 1]
    assert "graphs captured at start-up: 3 decode batch sizes" in caplog.text
    assert run(llm, vocab) == want
    assert ReplayingCPU.captured == [4, 2, 1]  # serving captured nothing more
    llm.engine.capture_graphs()  # nothing left to capture: no second round
    assert ReplayingCPU.captured == [4, 2, 1]


def test_a_platform_that_declines_to_capture_runs_eagerly(model_dir, caplog):
    plain, eager = eager_run(model_dir)
    vocab = plain.engine.c.spec.vocab_size
    llm = engine(model_dir, {"plugin": "declining_cpu"})
    with caplog.at_level("WARNING", logger="modserve.engine"):
        assert run(llm, vocab) == eager
    assert llm.engine.runner.graphs.unavailable == "platform DecliningCPU declined to capture"
    assert "decode steps run eagerly" in caplog.text


def test_graphs_need_a_capturable_backend_and_model(model_dir):
    llm = engine(model_dir, {"plugin": "replay_cpu"})
    platform, model, attention = llm.engine.c.platform, llm.engine.runner.model, llm.engine.runner.attention
    assert graph_refusal(platform, model, attention, tensor_parallel=False) is None
    assert graph_refusal(platform, model, attention, tensor_parallel=True) == (
        "tensor parallelism (the workers' forward is not captured)"
    )
    cpu_attention = type("CpuLike", (), {"capturable": False})()
    assert graph_refusal(platform, model, cpu_attention, False) == "attention backend CpuLike is not capturable"
    moe = type("MoE", (), {"capturable": False})()
    assert graph_refusal(platform, moe, attention, False) == "model MoE is not capturable"
    plain = engine(model_dir, EAGER_CPU)  # a platform that names no sizes: no graphs object at all
    assert plain.engine.runner.graphs is None


def test_cuda_graph_sizes():
    assert graph_sizes(256) == (1, 2, 4, 8, *range(16, 257, 16))
    assert graph_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    assert graph_sizes(3) == (1, 2, 3)
    assert graph_sizes(1) == (1,)
