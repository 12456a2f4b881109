"""``benchmarks/random_checkpoint.py``: the checkpoint it writes has the named shape, modserve
serves it with HF ``transformers``' greedy tokens (so a peer comparison on it runs the model it
names), and bad arguments fail naming the argument without touching an existing checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "random_checkpoint.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """One tiny checkpoint the script wrote, for both tests (each write starts torch anew)."""
    path = tmp_path_factory.mktemp("tiny")
    r = run("tiny", str(path), "--vocab", "500")
    assert r.returncode == 0, r.stderr[-2000:]
    return path


def test_the_checkpoint_has_the_shape_and_serves_hfs_tokens(tiny):
    import transformers

    from modserve import LLM, SamplingParams

    cfg = json.loads((tiny / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (128, 2, 1, 500)
    prompt = [5, 17, 42, 99, 3, 250]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(prompt):].tolist()
    llm = LLM(model={"path": str(tiny), "dtype": "float32", "max_model_len": 64}, kv_cache={"plugin": "paged", "num_blocks": 16})
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out[0].outputs[0].token_ids == want


def test_bad_arguments_name_themselves_and_keep_what_is_there(tiny, tmp_path):
    before = (tiny / "model.safetensors").read_bytes()
    again = run("tiny", str(tiny))
    assert again.returncode == 2 and "path:" in again.stderr and "already holds a checkpoint" in again.stderr
    assert (tiny / "model.safetensors").read_bytes() == before
    small = run("tiny", str(tmp_path / "other"), "--vocab", "2")
    assert small.returncode == 2 and "--vocab" in small.stderr and not (tmp_path / "other").exists()
    unknown = run("gpt-9", str(tmp_path / "other"))
    assert unknown.returncode == 2 and "shape" in unknown.stderr
