"""Released sliding-window blocks under the Triton kernels (interpreter): a tiny Mistral with a
window of 16 on every layer, 4-token blocks (so 16-key tiles straddle released blocks and the
placeholder), chunked prefill and split-K decode, gives HF's greedy tokens. Its own module:
``TRITON_INTERPRET=1`` must be set before triton is imported (run it in its own process)."""

import os
import sys

_TRITON_IMPORTED_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from tiny_models import build_model, hf_greedy  # noqa: E402

from modserve import LLM, SamplingParams  # noqa: E402

TRITON = {"plugin": "triton", "prefill_block_m": 32, "block_n": 16, "decode_split_tokens": 16, "decode_max_splits": 4}


def test_released_blocks_under_the_triton_kernels_match_hf(tmp_path):
    from modserve.plugins.attention import triton_kernels

    if _TRITON_IMPORTED_COMPILED or not triton_kernels.INTERPRETED:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: run this module in its own process")
    hf = build_model(str(tmp_path), "mistral", sliding_window=16, head_dim=64)  # the kernels take 64 or 128
    rng = random.Random(5)
    ps = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in (13, 40, 57)]
    llm = LLM({"model": {"path": str(tmp_path), "max_model_len": 128}}, attention=TRITON,
              scheduler={"plugin": "fcfs", "max_num_batched_tokens": 32},
              kv_cache={"plugin": "paged", "block_size": 4, "num_blocks": 64})
    kv = llm.engine.kv
    allocate, released = kv.allocate, []

    def counting(request, n, hit=None):
        ok = allocate(request, n, hit)
        released.append(kv.block_table(request).count(kv.null_block))
        return ok

    kv.allocate = counting
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))]
    assert got == [hf_greedy(hf, p, 20) for p in ps]
    assert kv.window == 16 and max(released) >= (57 + 18 - 15) // 4
