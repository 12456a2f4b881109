"""Steps replayed as graph pieces between eager attention calls (``core/piecewise_graphs.py``),
without a GPU.

A test platform records pieces the way a CUDA graph does, minus CUDA: while a piece is being
recorded, every torch operator is run and logged with the very tensors it read and wrote
(a ``TorchDispatchMode``); a replay reruns the log on whatever those tensors then hold and
writes each result into the tensor the capture wrote, so no Python of the model runs again.
Anything the pieces depend on is then exercised: the per-token input buffers, padding rows,
LongRoPE's per-token request lengths, the attention calls between pieces reading this step's
metadata, sizes captured as they are first needed. A host read inside a piece (``.item()``)
fails the recording, as it fails a CUDA capture. The Triton attention backend runs under its
interpreter, between the pieces. On a GPU, ``scripts/gpu_check.py`` compares real CUDA graph
pieces with eager steps the same way.
"""

from __future__ import annotations

import os
import random
import sys

_TRITON_IMPORTED_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (see test_triton_e2e.py)

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

pytest.importorskip("triton")

from reliability_helpers import registry  # noqa: E402
from tiny_models import build_model, interpreted_triton_llama  # noqa: E402

from modserve import LLM, SamplingParams  # noqa: E402
from modserve.core.contract import PieceRecorder  # noqa: E402
from modserve.core.engine import Engine  # noqa: E402
from modserve.core.engine_factory import build_components  # noqa: E402
from modserve.core.piecewise_graphs import AttentionBoundary, piece_refusal  # noqa: E402
from modserve.plugins.platforms.cpu import CPUPlatform  # noqa: E402
from modserve.plugins.platforms.cuda import piece_sizes  # noqa: E402

SIZES = (16, 64)
PLAIN_TORCH = {"decode_graphs": False, "fuse_ops": False, "pack_weights": False}  # every op a torch operator


class _Log(TorchDispatchMode):
    def __init__(self, ops: list) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default):
            raise RuntimeError("a piece read a device value on the host (.item()): a CUDA capture fails here")
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


class LoggingRecorder(PieceRecorder):
    """A piece is the log of its torch operators; ``replay()`` reruns them on the logged tensors."""

    def __init__(self, pieces: list) -> None:
        self.pieces = pieces
        self.mode: _Log | None = None

    def start(self) -> None:
        self.mode = _Log([])
        self.mode.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.mode is not None:  # an error inside a piece: leave no mode behind for later tests
            self.mode.__exit__(None, None, None)
            self.mode = None

    def stop(self):
        self.mode.__exit__(None, None, None)
        ops, self.mode = self.mode.ops, None
        self.pieces.append(len(ops))

        def replay() -> None:
            for func, args, kwargs, out in ops:
                fresh = func(*args, **kwargs)
                for mine, new in zip(tree_leaves(out), tree_leaves(fresh)):
                    if isinstance(mine, torch.Tensor) and mine.data_ptr() != new.data_ptr():
                        mine.copy_(new)  # results land where the capture's did, as in a graph's memory

        return replay


class PiecesCPU(CPUPlatform):
    """The cpu platform, capturing graph pieces with :class:`LoggingRecorder`."""

    pieces: list[int] = []  # operators per piece, every piece recorded

    def piece_token_sizes(self) -> tuple[int, ...]:
        return SIZES

    def piece_recorder(self) -> PieceRecorder:
        return LoggingRecorder(type(self).pieces)


class DecliningCPU(PiecesCPU):
    def piece_recorder(self):
        return None


class RegistryLLM(LLM):
    def __init__(self, engine: Engine) -> None:
        self.engine, self.tokenizer = engine, engine.tokenizer


def engine(path: str, platform: str, step_tokens: int = 40) -> RegistryLLM:
    reg = registry(platforms={"pieces_cpu": PiecesCPU, "declining_cpu": DecliningCPU})
    config = {
        "model": {"path": path, "dtype": "float32", "max_model_len": 256},
        "device": {"plugin": platform, **PLAIN_TORCH},
        "attention": {"plugin": "triton", "prefill_block_m": 32, "block_n": 16},
        # chunks of at most 40 tokens beside the decodes: mixed steps of 17 to 40 tokens, and
        # the first steps' 40-token chunks, replayed at sizes 64; single decodes at 16
        "scheduler": {"plugin": "fcfs", "max_num_seqs": 4, "max_num_batched_tokens": step_tokens},
        "kv_cache": {"plugin": "paged", "block_size": 16, "num_blocks": 64},
    }
    return RegistryLLM(Engine(build_components(config, registry=reg)))


def run(llm: LLM, vocab: int, lengths=(5, 23, 40, 61, 9), outputs=(6, 4, 10, 5, 8)) -> list[list[int]]:
    rng = random.Random(4)
    ps = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]


_EAGER: dict[tuple, tuple[LLM, list[list[int]]]] = {}


def eager_run(path: str, step_tokens: int = 40, **lengths_and_outputs) -> tuple[LLM, list[list[int]]]:
    """An engine on the plain cpu platform and its :func:`run` tokens, the reference the tests
    compare with: made once a model and workload (each run under the Triton interpreter costs
    seconds)."""
    key = (path, step_tokens, tuple(sorted(lengths_and_outputs.items())))
    if key not in _EAGER:
        eager = engine(path, "cpu", step_tokens)
        _EAGER[key] = eager, run(eager, eager.engine.c.spec.vocab_size, **lengths_and_outputs)
    return _EAGER[key]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return interpreted_triton_llama(tmp_path_factory, _TRITON_IMPORTED_COMPILED)


def test_steps_replayed_in_pieces_give_the_eager_tokens(llama):
    eager, want = eager_run(llama)
    vocab = eager.engine.c.spec.vocab_size
    PiecesCPU.pieces = []
    llm = engine(llama, "pieces_cpu")
    pieces = llm.engine.runner.pieces
    assert pieces is not None and pieces.sizes == SIZES
    assert run(llm, vocab) == want
    layers = llm.engine.c.spec.num_layers
    assert len(PiecesCPU.pieces) == 2 * (layers + 1)  # two sizes, each cut at every layer's attention
    assert all(pieces.replays[s] > 0 for s in SIZES), pieces.replays
    assert sorted(pieces.captured) == list(SIZES)
    # padding rows wrote no K/V: the caches hold what the eager engine wrote
    for mine, theirs in zip(llm.engine.kv.layer_caches(), eager.engine.kv.layer_caches()):
        torch.testing.assert_close(mine.k, theirs.k)
        torch.testing.assert_close(mine.v, theirs.v)
    # a second round reuses the pieces, and its prefix hits read the K/V the first wrote
    before = dict(pieces.replays)
    assert run(llm, vocab) == want
    assert len(PiecesCPU.pieces) == 2 * (layers + 1)
    assert sum(pieces.replays.values()) > sum(before.values())


def test_start_up_capture_takes_every_size(llama, caplog):
    eager, want = eager_run(llama)
    vocab = eager.engine.c.spec.vocab_size
    PiecesCPU.pieces = []
    llm = engine(llama, "pieces_cpu")
    with caplog.at_level("INFO", logger="modserve.engine"):
        llm.engine.capture_graphs()
    assert "graphs captured at start-up: 2 piece token sizes" in caplog.text
    captured = len(PiecesCPU.pieces)
    assert captured == 2 * (llm.engine.c.spec.num_layers + 1) and sorted(llm.engine.runner.pieces.captured) == [16, 64]
    assert run(llm, vocab) == want
    assert len(PiecesCPU.pieces) == captured  # serving captured nothing more


def test_a_step_past_the_largest_size_runs_eagerly(llama):
    eager = engine(llama, "cpu", step_tokens=128)
    vocab = eager.engine.c.spec.vocab_size
    lengths, outputs = (100, 3), (4, 12)
    want = run(eager, vocab, lengths, outputs)
    llm = engine(llama, "pieces_cpu", step_tokens=128)  # both prompts in the first step: 103 tokens, past 64
    assert run(llm, vocab, lengths, outputs) == want
    pieces = llm.engine.runner.pieces
    assert pieces.replays[64] == 0 and pieces.replays[16] > 0 and list(pieces.captured) == [16]


def test_longrope_and_per_layer_attention_through_pieces(tmp_path):
    """Phi-3's LongRoPE takes each token's factors by its request's length (per-token buffers in
    the pieces): a request crossing the original 32 positions switches factors mid-decode.
    Gemma 2's per-layer attention (window, soft-cap) goes through the boundary's per-layer views."""
    factors = [1.0 + i / 8 for i in range(24)]  # rotary 48 of head 64: 24 frequencies
    phi3 = str(tmp_path / "phi3")
    build_model(phi3, "phi3", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, original_max_position_embeddings=32,
                rope_scaling={"type": "longrope", "short_factor": factors, "long_factor": [2 * f for f in factors]})
    gemma2 = str(tmp_path / "gemma2")
    build_model(gemma2, "gemma2", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    for path in (phi3, gemma2):
        eager = engine(path, "cpu")
        vocab = eager.engine.c.spec.vocab_size
        lengths, outputs = (28, 14, 7), (8, 6, 4)  # the first request crosses 32 positions at its 5th token
        want = run(eager, vocab, lengths, outputs)
        llm = engine(path, "pieces_cpu")
        assert run(llm, vocab, lengths, outputs) == want, path
        assert sum(llm.engine.runner.pieces.replays.values()) > 0
        if path == gemma2:
            views = [layer.self_attn.backend for layer in llm.engine.runner.model.layers]
            assert all(isinstance(v, AttentionBoundary) for v in views)
            assert views[0].inner.window == 12 and views[0].root is llm.engine.runner.pieces.boundary


def test_a_platform_that_declines_runs_eagerly(llama, caplog):
    eager, want = eager_run(llama)
    vocab = eager.engine.c.spec.vocab_size
    llm = engine(llama, "declining_cpu")
    with caplog.at_level("WARNING", logger="modserve.engine"):
        assert run(llm, vocab) == want
    assert llm.engine.runner.pieces.unavailable == "platform DecliningCPU declined to capture pieces"
    assert "such steps run eagerly" in caplog.text


def test_pieces_need_a_capturable_backend_and_model(llama):
    llm = engine(llama, "pieces_cpu")
    platform, model, attention = llm.engine.c.platform, llm.engine.runner.model, llm.engine.runner.attention
    assert piece_refusal(platform, model, attention, tensor_parallel=False) is None
    assert piece_refusal(platform, model, attention, tensor_parallel=True) == (
        "tensor parallelism (the workers' forward is not captured)"
    )
    cpu_attention = type("CpuLike", (), {"capturable": False})()
    assert piece_refusal(platform, model, cpu_attention, False) == "attention backend CpuLike is not capturable"
    moe = type("MoE", (), {"capturable": False})()
    assert piece_refusal(platform, moe, attention, False) == "model MoE is not capturable"
    plain = engine(llama, "cpu")  # a platform that names no sizes: the model calls the backend itself
    assert plain.engine.runner.pieces is None
    assert plain.engine.runner.model.layers[0].self_attn.backend is plain.engine.runner.attention


def test_a_host_read_inside_a_piece_fails_the_capture(llama):
    llm = engine(llama, "pieces_cpu")
    model = llm.engine.runner.model
    norm = model.norm.forward
    model.norm.forward = lambda x, add=None: norm(x, add) + 0 * float(x.sum().item())
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"\.item\(\)"):
        llm.engine.runner.pieces._capture(16)
    assert not torch._C._len_torch_dispatch_stack()  # the recorder left the mode


def test_cuda_piece_sizes():
    assert piece_sizes(1024) == (16, 32, 64, *range(128, 1025, 128))
    assert piece_sizes(200) == (16, 32, 64, 128, 200)
    assert piece_sizes(16) == (16,)
