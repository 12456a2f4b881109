"""``benchmarks/gpu_throughput.py`` in its CPU smoke mode, so the script a GPU session runs in
its few device minutes cannot rot between those sessions: a tiny checkpoint, HF ``generate``,
modserve offline and its decode steps, a server on 127.0.0.1 (port 0) with the benchmark
client at 64 and 256 clients, and the JSON it writes. The word-level tokenizer must give every
id text (else the client's TTFT is the whole request)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_throughput  # noqa: E402


def test_smoke_mode_measures_every_figure(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_throughput.py"), "--device", "cpu", "--smoke",
                        "--out", str(tmp_path), "--tmp", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (res,) = json.loads((tmp_path / "gpu_throughput.json").read_text())["results"]
    assert "error" not in res, res
    for key in ("hf_offline_tok_s", "offline_tok_s", "decode_graphs_offline_tok_s", "eager_offline_tok_s", "step_ms_b1",
                "step_ms_b64", "step_ms_b256", "eager_step_ms_b256"):
        assert res[key] > 0, key
    assert res["graph_replays"] == {}  # the cpu platform captures no graphs
    online = res["online"]
    assert isinstance(online, dict), online
    for clients in ("64", "256"):
        assert online[clients]["failed"] == 0 and online[clients]["output_throughput"] > 0
        assert online[clients]["median_tpot_ms"] > 0  # tokens arrive one chunk at a time, not all at the end
        assert online[clients]["server_cpu_per_s"] > 0 and online[clients]["client_cpu_per_s"] > 0


def test_every_id_decodes_to_text(tmp_path):
    from tokenizers import Tokenizer

    gpu_throughput.build_tokenizer(str(tmp_path), 1000)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 1000
    assert all(tok.decode([i]) for i in range(2, 1000))
    assert tok.token_to_id("<|im_end|>") == 1


KERNEL_CASE = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import gpu_throughput as g
from modserve.plugins.attention.triton_backend import TritonAttention
plan = TritonAttention.Config(block_n=16, decode_split_tokens=32)
shape = dict(g.SHAPES["tiny"], hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
case = g.decode_case(shape, "cpu", 3, 70)
assert g.planned_splits(plan, case) == 3, g.planned_splits(plan, case)  # cdiv(70, 32); no fill limit on the CPU
b, h, d = case.q.shape
keys = case.k[case.table.long()].reshape(b, -1, d)[:, :70].float()
values = case.v[case.table.long()].reshape(b, -1, d)[:, :70].float()
want = torch.einsum("bhk,bkd->bhd", (torch.einsum("bhd,bkd->bhk", case.q.float(), keys) * d**-0.5).softmax(-1), values)
for splits in (1, 2, 4):
    case.out.fill_(float("nan"))
    g.decode_call(case, plan, splits)()
    err = float((case.out.float() - want).abs().max())
    assert err < 2e-2, (splits, err)
print("ok")
"""


def test_the_kernel_sweep_times_the_decode_it_means(tmp_path):
    """The kernel sweep's case and call (GPU-only timings) under Triton's interpreter: the paged
    cache it builds and the decode it times, split 1, 2 and 4 ways, give plain attention's output."""
    r = subprocess.run([sys.executable, "-c", KERNEL_CASE, str(ROOT / "benchmarks")], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env={**os.environ, "TRITON_INTERPRET": "1"})  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout[-2000:] + r.stderr[-2000:]
