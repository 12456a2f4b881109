"""Platform ``cuda``: NVIDIA GPUs through torch (cuBLAS linears, NCCL collectives, Triton
attention), with decode steps replayed from CUDA graphs (:mod:`modserve.core.decode_graphs`)
and other steps from CUDA graph pieces between eager attention calls
(:mod:`modserve.core.piecewise_graphs`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import torch

from modserve.core.config import ConfigError
from modserve.core.contract import DeviceInfo, PieceRecorder, Platform, hookimpl

MODSERVE_CONTRACT = "2.7"  # graph_batch_sizes, capture_graph; piece_token_sizes, piece_recorder

GRAPH_SMALL_SIZES = (1, 2, 4, 8)  # then every multiple of GRAPH_SIZE_STEP up to graph_max_batch
GRAPH_SIZE_STEP = 16


def graph_sizes(top: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then multiples of 16, up to and including ``top`` (vLLM captures alike)."""
    sizes = [s for s in GRAPH_SMALL_SIZES if s < top] + list(range(GRAPH_SIZE_STEP, top, GRAPH_SIZE_STEP))
    return tuple(sorted({*sizes, top}))


PIECE_SMALL_SIZES = (16, 32, 64)  # then every multiple of PIECE_SIZE_STEP up to piece_max_tokens
PIECE_SIZE_STEP = 128


def piece_sizes(top: int) -> tuple[int, ...]:
    """16, 32, 64, then multiples of 128, up to and including ``top``: a step pads to the next
    size, at most about 1/8 more rows past 128 tokens, where padding is no longer free."""
    sizes = [s for s in PIECE_SMALL_SIZES if s < top] + list(range(PIECE_SIZE_STEP, top, PIECE_SIZE_STEP))
    return tuple(sorted({*sizes, top}))


GRAPH_MAX_BATCH, PIECE_MAX_TOKENS = 256, 1024  # the defaults of graph_max_batch and piece_max_tokens


class CUDAConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    cuda_graphs: bool = True  # replay decode steps from CUDA graphs, and with piecewise_graphs the other steps from graph pieces (false: every step eagerly, like vLLM's enforce_eager)
    graph_max_batch: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None  # cuda_graphs only (default 256): the largest decode batch captured; larger ones run eagerly
    piecewise_graphs: bool = False  # steps that are not decode-only (prompt chunks beside decodes) as graph pieces between eager attention calls; off by default: no online gain measured yet (docs/triton_attention.md)
    piece_max_tokens: Annotated[int, msgspec.Meta(ge=16, le=8192)] | None = None  # piecewise_graphs only (default 1024): the most tokens a step replayed in pieces holds; larger ones run eagerly

    def __post_init__(self) -> None:
        if self.graph_max_batch is not None and not self.cuda_graphs:
            raise ValueError(f"graph_max_batch: applies to CUDA graphs, which cuda_graphs: false turns off, got {self.graph_max_batch}")
        if self.piecewise_graphs and not self.cuda_graphs:
            raise ValueError("piecewise_graphs: graph pieces are CUDA graphs, which cuda_graphs: false turns off")
        if self.piece_max_tokens is not None and not self.piecewise_graphs:
            raise ValueError(f"piece_max_tokens: applies to graph pieces; set piecewise_graphs: true, got {self.piece_max_tokens}")


class CUDAPlatform(Platform):
    Config = CUDAConfig

    def __init__(self, config: CUDAConfig, ctx) -> None:
        super().__init__(config, ctx)
        if not self.is_available():
            raise ConfigError("device: 'cuda' requested but torch sees no CUDA device; use 'cpu' or 'auto'")
        self._pool = None  # the graphs' shared memory pool

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def device(self, rank: int = 0) -> torch.device:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        return device

    def info(self) -> DeviceInfo:
        props = torch.cuda.get_device_properties(0)
        dtypes = ("float32", "bfloat16", "float16") if torch.cuda.is_bf16_supported() else ("float32", "float16")
        return DeviceInfo(props.name, props.total_memory, dtypes)

    def default_dtype(self) -> str:
        return "bfloat16"

    def default_attention(self, dtype: str) -> str:
        return "triton"

    def collective_backend(self) -> str:
        return "nccl"

    def graph_batch_sizes(self) -> tuple[int, ...]:
        return graph_sizes(self.config.graph_max_batch or GRAPH_MAX_BATCH) if self.config.cuda_graphs else ()

    def capture_graph(self, fn: Callable[..., Any], example_args: tuple) -> Callable[[], Any]:
        """Two warm-up calls on a side stream (Triton compiles, cuBLAS picks its kernels), then
        one captured call into the pool every graph of this platform shares."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):
                fn(*example_args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            out = fn(*example_args)
        self._pool = graph.pool()

        def replay(args=example_args):  # args: the captured tensors stay alive with the graph
            graph.replay()
            return out

        return replay

    def piece_token_sizes(self) -> tuple[int, ...]:
        return piece_sizes(self.config.piece_max_tokens or PIECE_MAX_TOKENS) if self.config.piecewise_graphs else ()

    def piece_recorder(self) -> PieceRecorder:
        return CUDAPieceRecorder(self)


class CUDAPieceRecorder(PieceRecorder):
    """Pieces captured one after another on a side stream into the platform's graph pool; the
    eager work between them runs on that stream too, outside any capture."""

    def __init__(self, platform: CUDAPlatform) -> None:
        self.platform = platform
        self.graph: torch.cuda.CUDAGraph | None = None

    def __enter__(self) -> CUDAPieceRecorder:
        self.side = torch.cuda.Stream()
        self.side.wait_stream(torch.cuda.current_stream())
        self.on_side = torch.cuda.stream(self.side)
        self.on_side.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.graph is not None:  # an error inside a piece: end the capture before leaving the stream
            with contextlib.suppress(RuntimeError):  # the error that got here is the one to report
                self.graph.capture_end()
            self.graph = None
        self.on_side.__exit__(*exc)
        torch.cuda.current_stream().wait_stream(self.side)

    def start(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.platform._pool)

    def stop(self) -> Callable[[], None]:
        graph, self.graph = self.graph, None
        graph.capture_end()
        self.platform._pool = graph.pool()
        return graph.replay


@hookimpl
def register_platforms():
    return {"cuda": CUDAPlatform}
