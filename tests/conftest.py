"""Shared fixtures: tiny checkpoints (built once per session) and the block-accounting guard.

Every engine a test creates is checked after the test: no request left inside and every
KV block back in the pool.
"""

from __future__ import annotations

import os
import sys
import weakref

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from modserve.core.engine import Engine  # noqa: E402
from tiny_models import build_model  # noqa: E402

_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()
_original_init = Engine.__init__


def _tracking_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _ENGINES.add(self)


Engine.__init__ = _tracking_init


@pytest.fixture(autouse=True)
def every_block_back_in_the_pool():
    yield
    for engine in list(_ENGINES):
        assert not engine.requests, f"requests left in the engine: {list(engine.requests)}"
        assert not engine.has_unfinished()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks, (
            f"{engine.kv.num_blocks - engine.kv.num_free_blocks} KV blocks leaked"
        )


@pytest.fixture
def on_an_intel_cpu(monkeypatch):
    """/proc/cpuinfo read as an Intel CPU's (a Cascade Lake's fields). Where the platform's
    choice depends on the vendor (``cpu.library_from_rows``: AMD cores up to Zen 4 keep the
    panels at every row count), a test that relies on Intel's choice pins it, so that it
    passes on whatever CPU CI has."""
    from modserve.plugins.platforms import cpu

    monkeypatch.setattr(cpu, "_cpuinfo", lambda: {"vendor_id": "GenuineIntel", "cpu family": "6"})


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{arch: (path, hf_model)} for llama (tied, GQA), mistral (head_dim 32), qwen2 (qkv bias)."""
    out = {}
    for arch in ("llama", "mistral", "qwen2"):
        path = str(tmp_path_factory.mktemp(arch))
        out[arch] = (path, build_model(path, arch))
    return out


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers loading the embedded SmolLM2 GGUF itself (the oracle for the real model)."""
    from hf_gguf_oracle import smollm2_from_transformers

    from modserve.core.models.gguf_reader import find_smollm2_gguf

    return smollm2_from_transformers(find_smollm2_gguf())


@pytest.fixture(scope="session")
def smollm2_llm():
    from modserve import LLM

    return LLM({"model": {"path": "smollm2-135m-instruct", "max_model_len": 2048}, "kv_cache": {"plugin": "paged", "num_blocks": 512}})
