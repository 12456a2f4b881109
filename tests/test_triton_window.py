"""The Triton kernels' sliding window and logit soft-capping, under the interpreter: a tiny
Gemma 2 (a window of 12 on its first layer, attention scores capped at 5) served with
``attention: {plugin: triton}`` gives HF's greedy tokens through chunked prefill over several
key tiles, and through split-K decode partitions that fall wholly or partly outside the
window; with the window left out of the kernels the tokens differ (the test can fail)."""

import os
import sys

_TRITON_IMPORTED_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from tiny_models import build_model, hf_greedy  # noqa: E402

from modserve import LLM, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
TRITON = {"plugin": "triton", "prefill_block_m": 32, "block_n": 16, "decode_split_tokens": 16, "decode_max_splits": 4}


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    from modserve.plugins.attention import triton_kernels

    if _TRITON_IMPORTED_COMPILED or not triton_kernels.INTERPRETED:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: run this module in its own process")
    path = str(tmp_path_factory.mktemp("gemma2_triton"))
    return path, build_model(path, "gemma2")


def _llm(path: str) -> LLM:
    return LLM({"model": {"path": path, "max_model_len": 128}}, attention=TRITON,
               scheduler={"plugin": "fcfs", "max_num_batched_tokens": 32},
               kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 48})


def test_window_and_softcap_match_hf_under_the_interpreter(gemma2, monkeypatch):
    path, hf = gemma2
    rng = random.Random(5)
    ps = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in (3, 13, 40, 57)]
    want = [hf_greedy(hf, p, 10) for p in ps]
    llm = _llm(path)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY)]
    assert got == want

    # the same kernels with the window dropped: other tokens for the prompts longer than it
    from modserve.plugins.attention import triton_kernels

    def without_window(launch):  # both launchers take (..., window, softcap) last
        return lambda *args: launch(*args[:-2], None, args[-1])

    for name in ("prefill_attention", "decode_attention"):
        monkeypatch.setattr(triton_kernels, name, without_window(getattr(triton_kernels, name)))
    ignored = [o.outputs[0].token_ids for o in _llm(path).generate([{"prompt_token_ids": p} for p in ps[2:]], GREEDY)]
    assert ignored != want[2:]
