"""The GPU check: the engine's parity checks on one device, with a short report.

    scripts/gpu-check.sh                # the first available platform (cuda where there is one)
    scripts/gpu-check.sh --device cpu   # CPU mode: what needs CUDA is reported as skipped

Each check serves a tiny random Llama (``tests/tiny_models.py``: ``transformers`` weights and a
byte-level BPE tokenizer built on the spot, no download) and
compares greedy tokens with HF ``transformers`` on the same weights, or with another engine
configuration where that is the claim: the ``torch`` and ``triton`` attention backends (Triton
compiled on CUDA, interpreted on the CPU), INT8 KV, prefix-cache hits, preemption and
speculative decoding, and on CUDA the decode steps replayed from CUDA graphs (the platform's
default, so every Triton check above runs them too) against eager steps, and the other steps
replayed from CUDA graph pieces (``piecewise_graphs: true``) against HF. Exit status 0 when
every check that ran passed. CI runs the CPU mode
(``tests/test_gpu_check.py``), so the script cannot rot between the sessions that have a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from modserve.core.contract import hookimpl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from tiny_models import build_model, hf_greedy, prompts  # noqa: E402 - the test suite's checkpoints and oracle

GREEDY_TOKENS = 12


@dataclass
class Result:
    name: str
    status: str  # "pass" | "FAIL" | "skip"
    detail: str
    seconds: float = 0.0


class Checks:
    def __init__(self, device: str, model_dir: str, hf) -> None:
        self.device, self.path, self.hf = device, model_dir, hf
        self.ps = prompts(hf.config.vocab_size, count=6, seed=1)
        self._want = None

    @property
    def want(self) -> list[list[int]]:
        if self._want is None:
            self._want = [hf_greedy(self.hf, p, GREEDY_TOKENS) for p in self.ps]
        return self._want

    def llm(self, **sections):
        from modserve import LLM

        config = {
            "model": {"path": self.path, "dtype": "float32", "max_model_len": 256},
            "device": self.device,
            "kv_cache": {"plugin": "paged", "block_size": 16, "num_blocks": 128},
            "scheduler": {"plugin": "fcfs", "max_num_batched_tokens": 64},
            **sections,
        }
        return LLM(config)

    def greedy(self, llm, ps=None, **params) -> list[list[int]]:
        from modserve import SamplingParams

        sp = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True, **params)
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in (ps or self.ps)], sp)]

    def same(self, got, want, what: str) -> tuple[bool, str]:
        agree = sum(g == w for g, w in zip(got, want))
        return agree == len(want), f"{agree}/{len(want)} prompts token-for-token equal to {what}"

    # ----------------------------------------------------------------- the checks

    def parity(self, attention: str) -> tuple[bool, str]:
        return self.same(self.greedy(self.llm(attention={"plugin": attention})), self.want, "HF transformers")

    def int8_kv(self) -> tuple[bool, str]:
        kv = {"plugin": "paged", "block_size": 16, "num_blocks": 128, "kv_dtype": "int8"}
        triton = self.greedy(self.llm(attention={"plugin": "triton"}, kv_cache=kv))
        torch_ = self.greedy(self.llm(attention={"plugin": "torch"}, kv_cache=kv))
        return self.same(triton, torch_, "the torch backend on the same INT8 KV")

    def prefix_caching(self) -> tuple[bool, str]:
        llm = self.llm(attention={"plugin": "triton"})
        shared = list(range(3, 3 + 48))  # three full blocks
        ps = [shared + p[:8] for p in self.ps[:3]]
        first = self.greedy(llm, ps[:1])
        before = llm.engine.scheduler.stats().prefix_hits
        again = self.greedy(llm, ps)
        hits = llm.engine.scheduler.stats().prefix_hits - before
        ok, detail = self.same(again, [hf_greedy(self.hf, p, GREEDY_TOKENS) for p in ps], "HF transformers")
        return ok and hits >= 3 * 48 and again[0] == first[0], f"{detail}; {hits} prompt tokens from the prefix cache"

    def preemption(self) -> tuple[bool, str]:
        kv = {"plugin": "paged", "block_size": 16, "num_blocks": 16, "swap_space_gb": 0.01}  # 256 tokens for ~430
        llm = self.llm(attention={"plugin": "triton"}, kv_cache=kv)
        got = self.greedy(llm)
        n = llm.engine.scheduler.stats().num_preemptions
        ok, detail = self.same(got, self.want, "HF transformers")
        return ok and n > 0, f"{detail}; {n} preemptions"

    def cuda_graphs(self) -> tuple[bool, str]:
        """Five requests of different lengths, so decode batches shrink to 1 (graphs of sizes 4,
        2 and 1 at least, some padded), against the same engine with ``cuda_graphs: false``;
        every size captured before the first request, as ``modserve serve`` does."""
        from modserve import SamplingParams

        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (4, 8, 12, 16, 20)]
        prompts = [{"prompt_token_ids": p} for p in self.ps[:5]]

        def tokens(llm):
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

        graphed = self.llm(attention={"plugin": "triton"})
        graphed.engine.capture_graphs()  # every size up front, largest first, as a server does at start-up
        graphs = graphed.engine.runner.graphs
        captured = len(graphs.captured) if graphs is not None else 0
        got = tokens(graphed)
        eager = tokens(self.llm(attention={"plugin": "triton"}, device={"plugin": "cuda", "cuda_graphs": False}))
        replays = {size: n for size, n in graphs.replays.items() if n} if graphs is not None else {}
        ok, detail = self.same(got, eager, "eager steps (cuda_graphs: false)")
        ok = ok and len(replays) >= 3 and captured == len(graphs.sizes) == len(graphs.captured)
        return ok, f"{detail}; {captured} sizes captured up front; steps replayed per graph size: {replays}"

    def graph_pieces(self) -> tuple[bool, str]:
        """Every step that is not a single decode (prompt chunks beside decodes, up to 64 tokens;
        decodes of 2-6 requests, with ``graph_max_batch: 1``) replayed as CUDA graph pieces
        between eager attention calls, against HF."""
        llm = self.llm(attention={"plugin": "triton"},
                       device={"plugin": "cuda", "graph_max_batch": 1, "piecewise_graphs": True})
        got = self.greedy(llm)
        pieces = llm.engine.runner.pieces
        replays = {size: n for size, n in pieces.replays.items() if n} if pieces is not None else {}
        ok, detail = self.same(got, self.want, "HF transformers")
        return ok and len(replays) >= 2, f"{detail}; steps replayed per piece size (tokens): {replays}"

    def speculative(self) -> tuple[bool, str]:
        llm = self.llm(attention={"plugin": "triton"}, speculative={"plugin": "ngram", "num_speculative_tokens": 3})
        accepted = []
        llm.engine.c.registry.pm.register(_Accepted(accepted))
        repetitive = [p[:6] * 4 for p in self.ps[:3]]
        got = self.greedy(llm, repetitive)
        ok, detail = self.same(got, [hf_greedy(self.hf, p, GREEDY_TOKENS) for p in repetitive], "HF transformers")
        return ok and sum(accepted) > 0, f"{detail}; {sum(accepted)} draft tokens accepted"


class _Accepted:
    """Counts accepted draft tokens (an observer on the engine's plugin manager)."""

    def __init__(self, into: list[int]) -> None:
        self.into = into

    @hookimpl
    def on_step_finished(self, stats) -> None:
        self.into.append(stats.num_accepted_tokens)


def run(device: str) -> list[Result]:
    on_cuda = device == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_model(tmp, "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)  # head size 64: the Triton kernels' smallest
        checks = Checks(device, tmp, hf)
        plan: list[tuple[str, Callable[[], tuple[bool, str]] | None, str]] = [
            ("parity: torch attention", lambda: checks.parity("torch"), ""),
            ("parity: triton attention" + ("" if on_cuda else " (interpreted)"), lambda: checks.parity("triton"), ""),
            ("INT8 KV (triton vs torch)", checks.int8_kv, ""),
            ("prefix caching", checks.prefix_caching, ""),
            ("preemption (by swap)", checks.preemption, ""),
            ("speculative decoding (ngram)", checks.speculative, ""),
            ("CUDA graphs (decode)", checks.cuda_graphs if on_cuda else None,
             "needs CUDA (tests/test_decode_graphs.py checks the engine's side with a replaying CPU platform)"),
            ("CUDA graph pieces (other steps)", checks.graph_pieces if on_cuda else None,
             "needs CUDA (tests/test_piecewise_graphs.py checks the engine's side with a recording CPU platform)"),
        ]
        return run_checks(plan)


def run_checks(plan: list[tuple[str, Callable[[], tuple[bool, str]] | None, str]]) -> list[Result]:
    """Run each check; ``None`` is a skip with its reason. A check that raises is a failure
    with its message, and the rest still run."""
    results = []
    for name, check, why in plan:
        if check is None:
            results.append(Result(name, "skip", why))
            continue
        t = time.perf_counter()
        try:
            ok, detail = check()
            results.append(Result(name, "pass" if ok else "FAIL", detail, time.perf_counter() - t))
        except Exception as e:  # noqa: BLE001 - reported, not raised
            results.append(Result(name, "FAIL", f"{type(e).__name__}: {e}", time.perf_counter() - t))
    return results


def device_line(device: str) -> str:
    import torch

    from modserve.core.plugin_manager import standalone_context

    info = standalone_context(device=device).platform.info()
    versions = f"torch {torch.__version__}"
    try:
        import triton

        versions += f", triton {triton.__version__}"
    except ImportError:
        versions += ", no triton"
    return f"device: {device} ({info.name}, {info.total_memory_bytes / 2**30:.1f} GiB); {versions}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: cuda where torch sees a GPU, else cpu (CPU mode)")
    args = p.parse_args(argv)
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: --device cuda, but torch sees no CUDA device; use --device cpu for the CPU mode", file=sys.stderr)
        return 2
    if device == "cpu":  # the Triton kernels, interpreted: set before anything imports triton
        os.environ["TRITON_INTERPRET"] = "1"
    print(device_line(device))
    results = run(device)
    width = max(len(r.name) for r in results)
    print(f"\n{'check':<{width}}  result  time    detail")
    for r in results:
        print(f"{r.name:<{width}}  {r.status:<6}  {r.seconds:5.1f}s  {r.detail}")
    failed = sum(r.status == "FAIL" for r in results)
    passed = sum(r.status == "pass" for r in results)
    skipped = sum(r.status == "skip" for r in results)
    print(f"\n{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
