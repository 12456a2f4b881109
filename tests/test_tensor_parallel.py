"""Tensor parallelism over gloo on the CPU: TP=2 is token-for-token TP=1 and HF, each rank
holds about half the weights, and a dead worker fails requests instead of hanging.

Every TP engine here spawns a worker process (a fresh interpreter importing torch), so the
module keeps their number small: two shared engines (llama, qwen2), one for memory, one
killed in-process and one killed in a subprocess.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from modserve import LLM, SamplingParams
from modserve.core.config import ConfigError
from modserve.core.distributed import WorkerDiedError
from modserve.core.distributed.sharding import TPShard, plan, take
from modserve.core.contract import ModelSpec
from tiny_models import build_model, hf_greedy, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# max_num_batched_tokens 64 chunks every prompt longer than that; 24 blocks of 16 tokens for
# up to 8 requests of ~100 tokens forces preemption, by swap, whose block copies the workers mirror.
TIGHT = dict(
    kv_cache={"plugin": "paged", "block_size": 16, "num_blocks": 24, "swap_space_gb": 0.01},
    scheduler={"plugin": "fcfs", "max_num_batched_tokens": 64, "preemption_mode": "swap"},
)


def tp_llm(path: str, n: int = 2, max_model_len: int = 256, **overrides) -> LLM:
    config = {"model": {"path": path, "max_model_len": max_model_len}, **TIGHT, **overrides}
    return LLM(config, parallel={"tensor_parallel_size": n})


@pytest.fixture(scope="module")
def engines(tiny_models):
    """{arch: (tp2 LLM, tp1 LLM, hf)} for llama (tied, GQA) and qwen2 (qkv bias, untied)."""
    out = {}
    try:
        for arch in ("llama", "qwen2"):
            path, hf = tiny_models[arch]
            assert hf.config.num_key_value_heads % 2 == 0
            out[arch] = (tp_llm(path), tp_llm(path, 1), hf)
        yield out
    finally:
        for tp2, _, _ in out.values():
            tp2.engine.shutdown()


def run(llm: LLM, token_prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in token_prompts], params)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_greedy_identical_to_tp1_and_hf(engines, arch):
    tp2, tp1, hf = engines[arch]
    ps = prompts(hf.config.vocab_size, count=8, seed=4) + [list(range(3, 103))]  # one prompt of 100 tokens
    preempted = tp2.engine.scheduler.num_preemptions
    got, ref = run(tp2, ps, GREEDY), run(tp1, ps, GREEDY)
    for p, g, r in zip(ps, got, ref):
        assert g == r == hf_greedy(hf, p, 24), f"prompt of {len(p)} tokens diverged"
    assert len({tuple(g) for g in got}) > 5
    assert tp2.engine.scheduler.num_preemptions > preempted  # the tight pool preempted, by swap:
    counts = tp2.engine.runner.copies.counts
    assert counts.get("device->host", 0) > 0 and counts.get("host->device", 0) > 0


def test_logprobs_match_tp1_within_float_rounding(engines):
    """The gathered vocab-parallel logits are TP=1's up to the all-reduce's summation order."""
    tp2, tp1, hf = engines["qwen2"]
    p = prompts(hf.config.vocab_size, count=1, seed=5)[0] + [7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, prompt_logprobs=5)
    a, b = (llm.generate({"prompt_token_ids": p}, params)[0] for llm in (tp2, tp1))
    pairs = list(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])) + list(zip(a.outputs[0].logprobs, b.outputs[0].logprobs))
    for x, y in pairs:
        assert x.keys() == y.keys()
        for tok in x:
            assert x[tok].logprob == pytest.approx(y[tok].logprob, abs=1e-5)


def test_mixed_batch_with_chunked_prefill(engines):
    """Long prompts arrive while others decode: steps mix decode tokens with prompt chunks."""
    tp2, _, hf = engines["qwen2"]
    engine = tp2.engine
    ps = prompts(hf.config.vocab_size, count=3, seed=7)
    long = [[(7 * i + 3 * j) % (hf.config.vocab_size - 3) + 3 for j in range(90 + 17 * i)] for i in range(2)]
    done, mixed = {}, 0
    for i, p in enumerate(ps):
        engine.add_request(p, GREEDY, request_id=f"short{i}")
    for _ in range(3):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for i, p in enumerate(long):
        engine.add_request(p, GREEDY, request_id=f"long{i}")
    while engine.has_unfinished():
        decoding = sum(r.num_output_tokens > 0 for r in engine.requests.values() if not r.is_finished)
        prefilling = sum(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values())
        mixed += bool(decoding and prefilling)
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert mixed >= 2
    for i, p in enumerate(ps):
        assert done[f"short{i}"].outputs[0].token_ids == hf_greedy(hf, p, 24)
    for i, p in enumerate(long):
        assert done[f"long{i}"].outputs[0].token_ids == hf_greedy(hf, p, 24)


def test_n_siblings_share_blocks_copy_on_write_mirrored(engines):
    """n=2 siblings share the prompt's blocks; the first write copies the shared block on
    rank 0 and the workers replay the copy: seeded samples equal TP=1's exactly."""
    tp2, tp1, hf = engines["llama"]
    params = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=16, ignore_eos=True)
    ps = prompts(hf.config.vocab_size, count=3, seed=9)
    before = tp2.engine.runner.copies.counts.get("device->device", 0)
    got = [[c.token_ids for c in o.outputs] for o in tp2.generate([{"prompt_token_ids": p} for p in ps], params)]
    ref = [[c.token_ids for c in o.outputs] for o in tp1.generate([{"prompt_token_ids": p} for p in ps], params)]
    assert got == ref
    assert tp2.engine.runner.copies.counts.get("device->device", 0) > before


def test_indivisible_heads_are_refused_naming_the_numbers(tiny_models, tmp_path):
    path, _ = tiny_models["llama"]  # 4 heads, 2 KV heads
    children = set(p.pid for p in __import__("multiprocessing").active_children())
    with pytest.raises(ConfigError, match=r"num_attention_heads 4 is not divisible by tensor_parallel_size 3"):
        tp_llm(path, 3)
    one_kv = str(tmp_path / "one_kv")
    build_model(one_kv, "llama", num_key_value_heads=1)
    with pytest.raises(ConfigError, match=r"num_key_value_heads 1 is not divisible by tensor_parallel_size 2"):
        tp_llm(one_kv, 2)
    assert set(p.pid for p in __import__("multiprocessing").active_children()) == children  # refused before spawning


def test_config_errors_name_the_key(tiny_models):
    path, _ = tiny_models["llama"]
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel_size: expected int >= 1, got 0"):
        LLM(model=path, parallel={"tensor_parallel_size": 0})
    with pytest.raises(ConfigError, match=r"parallel.backend: expected one of auto, gloo, nccl"):
        LLM(model=path, parallel={"backend": "mpi"})
    with pytest.raises(ConfigError, match=r"speculative.draft: a draft made of the target's own layers"):
        LLM(model=path, parallel={"tensor_parallel_size": 2}, speculative={"plugin": "draft_model", "draft": {"layers": 1}})


def test_vocab_shards_pad_the_last_rank():
    spec = ModelSpec("llama", 7, 4, 8, 1, 2, 2, 2, 1e-6, 1e4, None, 64, True, False)
    full = torch.arange(28.0).view(7, 4)
    parts = [take("model.embed_tokens.weight", full, spec, TPShard(r, 2)) for r in range(2)]
    assert [p.shape[0] for p in parts] == [4, 4]
    assert torch.equal(torch.cat(parts)[:7], full) and not parts[1][3].any()
    assert plan("model.norm.weight", spec, TPShard(1, 2)) is None
    assert plan("model.layers.0.self_attn.o_proj.weight", spec, TPShard(1, 2)) == (1, 2, 4, 2)


def test_each_rank_holds_about_half_the_weights(tmp_path, capsys):
    """Measured: parameter bytes per rank (exact) and the worker's resident growth while loading."""
    path = str(tmp_path / "medium")
    hf = build_model(path, "llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                     num_attention_heads=16, num_key_value_heads=8)  # 253 MB in float32
    full = sum(p.numel() * p.element_size() for p in hf.parameters())
    del hf
    llm = tp_llm(path, 2, 512, kv_cache={"plugin": "paged", "num_blocks": 64, "swap_space_gb": 0})
    stats = llm.engine.runner.rank_stats()
    worker = stats[1]
    grown = worker["rss"]["rss_anon"] - worker["rss_before_load"]["rss_anon"] - worker["kv_bytes"]
    with capsys.disabled():
        print(f"\n[tp memory] model {full / 2**20:.1f} MiB; param bytes per rank: "
              f"{[round(s['param_bytes'] / 2**20, 1) for s in stats]} MiB; worker anon RSS growth while "
              f"reading weights (KV bytes excluded): {grown / 2**20:.1f} MiB; RSS now: {[round(s['rss']['rss'] / 2**20) for s in stats]} MiB")
    for s in stats:
        assert 0.49 * full < s["param_bytes"] < 0.52 * full  # norms are replicated
    assert grown < 0.7 * full  # the half, plus ~35 MB of allocator slack whatever the model size
    assert llm.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].finish_reason == "length"
    # an idle engine notices a dead worker without stepping (what a server's health check reads)
    assert llm.engine.dead is None
    os.kill(worker["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while llm.engine.dead is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "rank 1" in llm.engine.dead and "SIGKILL" in llm.engine.dead
    with pytest.raises(WorkerDiedError):
        llm.generate([5, 6, 7], SamplingParams(max_tokens=4))
    llm.engine.shutdown()


def test_worker_killed_mid_forward_fails_in_flight_requests(tiny_models):
    """The worker dies while rank 0 is inside the forward's first all-reduce: the step fails
    at once (no hang), every request in the engine finishes with an error naming the rank."""
    path, _ = tiny_models["llama"]
    llm = LLM(model=path, parallel={"tensor_parallel_size": 2}, kv_cache={"plugin": "paged", "num_blocks": 64})
    engine = llm.engine
    pid = engine.runner.workers.procs[0].pid
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(3):
        engine.add_request([5 + i, 6, 7], params, request_id=f"r{i}")
    for _ in range(3):
        engine.step()
    engine.add_request([9, 10, 11], params, request_id="waiting")
    tp, all_reduce = engine.runner.tp, engine.runner.tp.all_reduce

    def kill_then_all_reduce(x):
        os.kill(pid, signal.SIGKILL)
        return all_reduce(x)

    tp.all_reduce = kill_then_all_reduce
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 \(pid \d+\) died \(killed by signal SIGKILL\)") as err:
        engine.step()
    assert time.monotonic() - t0 < 5
    outs = err.value.outputs
    assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2", "waiting"]
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "error" and "rank 1" in o.error
    assert "rank 1" in engine.dead and not engine.requests
    with pytest.raises(WorkerDiedError):
        engine.add_request([1, 2, 3], params)
    with pytest.raises(WorkerDiedError):
        engine.step()
    engine.shutdown()


def test_hung_worker_times_out_instead_of_hanging(tiny_models):
    path, _ = tiny_models["llama"]
    llm = LLM(model=path, parallel={"tensor_parallel_size": 2, "timeout_s": 2},
              kv_cache={"plugin": "paged", "num_blocks": 64})
    engine = llm.engine
    proc = engine.runner.workers.procs[0]
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=50), request_id="r")
    engine.step()
    os.kill(proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="timed out") as err:
        engine.step()
    assert time.monotonic() - t0 < 10
    assert [o.request_id for o in err.value.outputs] == ["r"] and engine.dead
    assert proc.exitcode is not None  # the hung worker was killed, not left behind
    engine.shutdown()


def test_process_using_tp_exits_non_zero_when_a_worker_dies(tiny_models):
    path, _ = tiny_models["llama"]
    script = textwrap.dedent(f"""
        import os, signal, threading
        from modserve import LLM, SamplingParams
        llm = LLM(model={path!r}, parallel={{"tensor_parallel_size": 2}}, kv_cache={{"plugin": "paged", "num_blocks": 64}})
        print("warm", llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids, flush=True)
        worker = llm.engine.runner.workers.procs[0]
        threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
        llm.generate([[5, 6, 7]] * 4, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        print("unreachable", flush=True)
    """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "warm" in proc.stdout and "unreachable" not in proc.stdout
    assert "WorkerDiedError: tensor-parallel worker rank 1" in proc.stderr and "SIGKILL" in proc.stderr
    assert time.monotonic() - t0 < 120


def test_shutdown_stops_the_workers(engines):
    tp2, _, _ = engines["qwen2"]
    procs = list(tp2.engine.runner.workers.procs)
    t0 = time.monotonic()
    tp2.engine.shutdown()
    assert all(p.exitcode == 0 for p in procs) and time.monotonic() - t0 < 5
    assert tp2.engine.dead is None  # a clean stop is not a death
    tp2.engine.shutdown()  # idempotent


def test_garbage_collection_stops_the_workers(engines):
    procs = list(engines["llama"][0].engine.runner.workers.procs)
    del engines["llama"]  # the last reference to that LLM
    gc.collect()
    for p in procs:
        p.join(10)
    assert all(p.exitcode == 0 for p in procs)


def test_deploy_manifests_parse_and_their_pipeline_validates():
    """examples/deploy is not applied to a cluster here; at least it parses, its pipeline
    validates (plugins, tensor parallelism) and the manifests agree on names and ports."""
    import yaml

    from modserve.core.distributed.tp_runner import check_pipeline
    from modserve.core.engine_factory import resolve

    root = os.path.join(os.path.dirname(__file__), "..", "examples", "deploy", "kubernetes")
    docs = {}
    for name in sorted(os.listdir(root)):
        if name.endswith(".yaml") and name != "pipeline.yaml":
            for doc in yaml.safe_load_all(open(os.path.join(root, name), encoding="utf-8")):
                docs[doc["kind"]] = doc
    r = resolve(os.path.join(root, "pipeline.yaml"))
    check_pipeline(r)
    assert r.pipeline.parallel.tensor_parallel_size > 1 and r.pipeline.server.host == "0.0.0.0"
    kustomize = docs["Kustomization"]
    assert set(kustomize["resources"]) == {f for f in os.listdir(root) if f not in ("kustomization.yaml", "pipeline.yaml")}
    assert kustomize["configMapGenerator"][0]["files"] == ["pipeline.yaml"]
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["ports"][0]["containerPort"] == r.pipeline.server.port
    assert container["args"] == ["-c", "/etc/modserve/pipeline.yaml"]
    assert {"name": "pipeline", "configMap": {"name": kustomize["configMapGenerator"][0]["name"]}} in pod["volumes"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
