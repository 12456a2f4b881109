"""Out-of-tree plugins: the example packages install into a temporary environment (never the
user's), register through the ``modserve`` entry-point group, and change the engine's
behaviour as they claim. A KV backend written from scratch against the contract runs with
preemption, ``n > 1`` and tensor parallelism. Plugins breaking the contract are refused.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from plugin_env import install_plugins

from modserve import LLM, SamplingParams
from modserve import cli
from tiny_models import teacher_forced
from modserve.core.config import ConfigError
from modserve.core.contract import CONTRACT_VERSION, AttentionSpec, Scheduler, hookimpl
from modserve.core.engine_factory import resolve
from modserve.core.plugin_manager import PluginContractError, PluginRegistry, standalone_context
from modserve.core.request import Request

PLUGINS = Path(__file__).resolve().parent.parent / "examples" / "plugins"
SCRATCH_KV = Path(__file__).resolve().parent / "plugins" / "modserve-scratch-kv"
# distribution -> (plugin module, registered kind, registered name, config fields it adds)
PACKAGES = {
    "modserve-fairshare": ("modserve_fairshare", "schedulers", "fair_share", {"max_running_per_user"}),
    "modserve-lfu-eviction": ("modserve_lfu_eviction", "eviction_policies", "lfu", set()),
    "modserve-vendor-attention": (
        "modserve_vendor_attention", "attention_backends", "vendor_skeleton", {"log_shapes", "fallback"}
    ),
    "modserve-vendor-platform": ("modserve_vendor_platform", "platforms", "vendor_cpu", {"memory_gb", "int8_weights"}),
}


@pytest.fixture(scope="module")
def example_plugins(tmp_path_factory):
    """Every example package (and the scratch KV backend) installed into a temporary target
    directory, on ``sys.path`` for this module's tests only; ``.env()`` for subprocesses."""
    env = install_plugins([*(PLUGINS / d for d in PACKAGES), SCRATCH_KV], tmp_path_factory.mktemp("plugins"))
    with env.activate():
        yield env


def _cli(*args: str, env=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "modserve.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_nothing_is_installed_into_the_users_environment():
    out = _cli("plugins", "--json")
    assert out.returncode == 0, out.stderr
    listing = json.loads(out.stdout)["plugins"]
    names = {p["name"] for impls in listing.values() for p in impls}
    assert not names & {name for _, _, name, _ in PACKAGES.values()}


def test_modserve_plugins_json_lists_installed_packages(example_plugins):
    out = _cli("plugins", "--json", env=example_plugins.env())
    assert out.returncode == 0, out.stderr
    listing = json.loads(out.stdout)["plugins"]
    for dist, (module, kind, name, fields) in PACKAGES.items():
        impl = next((p for p in listing[kind] if p["name"] == name), None)
        assert impl is not None, f"{name} missing from modserve plugins --json {kind}"
        assert impl["source"] == f"{dist} ({module})"
        assert impl["contract"] == "2.0"  # written for 2.0, loaded by the 2.1 core unchanged
        assert impl["class"].startswith(f"{module}.")
        assert fields <= {f["name"] for f in impl["config"]}


def test_example_package_pipelines_validate(example_plugins, capsys):
    assert cli.main(["validate", "-c", *sorted(str(p) for p in PLUGINS.glob("*/pipeline.yaml"))]) == 0
    assert capsys.readouterr().out.count(": ok") == len(PACKAGES)


@pytest.fixture(scope="module")
def llm_with(tiny_llama):
    """``llm_with(section=options, ...)``: an LLM on the tiny model, one per distinct config.

    The base pipeline is small on purpose: two seats and 24 KV blocks of 4 tokens.
    """
    built: dict[str, LLM] = {}

    def make(**sections) -> LLM:
        config = {
            "model": {"path": tiny_llama[0], "max_model_len": 64},
            "scheduler": {"plugin": "fcfs", "max_num_seqs": 2},
            "kv_cache": {"plugin": "paged", "block_size": 4, "num_blocks": 24},
            **sections,
        }
        key = json.dumps(config, sort_keys=True)
        if key not in built:
            built[key] = LLM(config)
        return built[key]

    return make


# ----------------------------------------------------------------------------- fair share

MAX_TOKENS = 4
SEATS = 2  # the base pipeline's max_num_seqs


def _light_first_token_step(llm: LLM, num_heavy: int) -> int:
    """Engine steps until a light user's request, queued behind ``num_heavy`` heavy ones, gets a token."""
    engine = llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(num_heavy):
        engine.add_request([30 + i, 20, 30, 40], params, user="heavy")
    [light] = engine.add_request([200, 20, 30, 40], params, user="light")
    steps, first = 0, None
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if first is None and light.num_output_tokens:
            first = steps
    return first


@pytest.mark.parametrize("num_heavy", [6, 12])
def test_fair_share_bounds_light_user_wait_under_a_flood(example_plugins, llm_with, num_heavy):
    fair = _light_first_token_step(llm_with(scheduler={"plugin": "fair_share", "max_num_seqs": SEATS}), num_heavy)
    fcfs = _light_first_token_step(llm_with(), num_heavy)
    assert fcfs > num_heavy // SEATS * MAX_TOKENS  # FCFS: behind the whole backlog
    assert fair <= MAX_TOKENS + 1  # fair share: the first seat that frees, whatever the flood's size


def test_fair_share_caps_running_per_user(example_plugins, llm_with):
    engine = llm_with(scheduler={"plugin": "fair_share", "max_num_seqs": 4, "max_running_per_user": 2}).engine
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(6):
        engine.add_request([30 + i, 20, 30], params, user="heavy")
    [light] = engine.add_request([200, 20, 30], params, user="light")
    engine.step()
    first_batch, light_tokens = sorted(r.user for r in engine.scheduler.running), light.num_output_tokens
    most_heavy = 0
    while engine.has_unfinished():
        engine.step()
        most_heavy = max(most_heavy, sum(r.user == "heavy" for r in engine.scheduler.running))
    assert first_batch == ["heavy", "heavy", "light"]  # the fourth seat stays free rather than exceed the cap
    assert light_tokens == 1
    assert most_heavy == 2


def test_fair_share_preempts_the_busiest_users_newest_request(example_plugins):
    from modserve_fairshare import FairShareConfig, FairShareScheduler

    sched = FairShareScheduler(FairShareConfig(), standalone_context())
    users = ["a", "b", "b", "a", "b", "c"]
    sched.running = [Request(f"r{i}", [1], SamplingParams(), user=u) for i, u in enumerate(users)]
    assert sched.pick_victim(sched.running[0]).request_id == "r4"


# ----------------------------------------------------------------------------- LFU eviction

HOT_PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]  # two blocks of 4 tokens


def _hot_prefix_hits_after_churn(llm: LLM) -> tuple[int, int]:
    """(prefix-hit tokens while warming a shared prefix, its hit tokens after cold prompts churned the pool)."""
    llm.engine.kv.reset_prefix_cache()

    def hits() -> int:
        return llm.engine.scheduler.stats().prefix_hits

    params = SamplingParams(max_tokens=4, ignore_eos=True)
    start = hits()
    for i in range(4):
        llm.generate([HOT_PREFIX + [100 + i, 101, 102]], params)
    warm = hits() - start
    rng = random.Random(0)
    llm.generate([[rng.randrange(20, 300) for _ in range(20)] for _ in range(12)], params)
    start = hits()
    llm.generate([HOT_PREFIX + [200, 201, 202]], params)
    return warm, hits() - start


def test_lfu_keeps_a_hot_prefix_that_lru_evicts(example_plugins, llm_with):
    from modserve_lfu_eviction import LFUEviction

    lru = llm_with()
    lfu = llm_with(kv_cache={"plugin": "paged", "block_size": 4, "num_blocks": 24, "eviction": "lfu"})
    policy = type(lfu.engine.kv.pool.free_queue)
    assert policy is LFUEviction, f"kv_cache.eviction: lfu, but the block pool runs {policy.__name__}"
    warm_lru, after_lru = _hot_prefix_hits_after_churn(lru)
    warm_lfu, after_lfu = _hot_prefix_hits_after_churn(lfu)
    assert warm_lru == warm_lfu == 3 * len(HOT_PREFIX)
    assert after_lru == 0
    assert after_lfu == len(HOT_PREFIX)


def test_lfu_hand_out_order(example_plugins):
    from modserve_lfu_eviction import LFUEviction

    policy = LFUEviction()
    policy.hit(0)
    policy.hit(0)
    policy.add(0, cached=True)
    policy.add(1, cached=True)
    policy.add(2, cached=False)
    policy.add(3, cached=True)
    policy.remove(3)
    assert len(policy) == 3 and 3 not in policy and 0 in policy
    assert [policy.pop() for _ in range(3)] == [2, 1, 0]  # uncached, then fewest hits


def test_lfu_ages_out_a_prefix_that_stopped_being_hit(example_plugins):
    from modserve_lfu_eviction import LFUEviction

    policy = LFUEviction()
    for _ in range(3):
        policy.hit(0)
    policy.add(0, cached=True)
    evicted = []
    for block in range(1, 4):  # each newer block served one hit; the floor rises with each eviction
        policy.hit(block)
        policy.add(block, cached=True)
        evicted.append(policy.pop())
    assert evicted == [1, 2, 0]


# ----------------------------------------------------------------------------- vendor attention

PROMPTS = [[10, 20, 30, 40, 50], [60, 70, 80], list(range(100, 140))]


def test_vendor_skeleton_matches_torch_and_counts_calls(example_plugins, llm_with, caplog):
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    want = llm_with().generate(PROMPTS, params)
    llm = llm_with(attention={"plugin": "vendor_skeleton", "log_shapes": True})
    with caplog.at_level("INFO", logger="modserve_vendor_attention"):
        got = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    attention = llm.engine.c.attention
    assert attention.num_prepare_calls >= params.max_tokens
    assert attention.num_forward_calls == attention.num_prepare_calls * llm.engine.c.spec.num_layers
    logged = [r.getMessage() for r in caplog.records if r.name == "modserve_vendor_attention"]
    assert len(logged) == attention.num_prepare_calls + attention.num_forward_calls
    assert logged[:2] == [
        "step: 8 tokens, 2 requests, query lens [5, 3]",
        "layer: q (8, 4, 16) k (8, 2, 16) v (8, 2, 16) cache (24, 4, 2, 16)",
    ]


def test_vendor_skeleton_refuses_a_bad_fallback(example_plugins):
    from modserve_vendor_attention import VendorAttention, VendorConfig

    with pytest.raises(ConfigError, match="attention.fallback: must name another attention backend"):
        resolve({"attention": {"plugin": "vendor_skeleton", "fallback": "vendor_skeleton"}})
    spec = AttentionSpec(4, 2, 16, 0.25, torch.float32, torch.device("cpu"), 16)
    with pytest.raises(ValueError, match="attention.fallback: unknown attention backend 'cuda_kernels'; available: "):
        VendorAttention(VendorConfig(fallback="cuda_kernels"), standalone_context(attention=spec))


# ----------------------------------------------------------------------------- vendor platform




def test_vendor_platform_runs_int8_linears_within_its_stated_tolerance(example_plugins, llm_with):
    """The README's tolerance, teacher-forced over the float platform's own greedy text: the
    top token agrees at >= 85% of positions and the actual token's logprob moves <= 0.25 nats."""
    from modserve_vendor_platform import Int8WeightOnlyLinear

    ref = llm_with()
    vendor = llm_with(device={"plugin": "vendor_cpu", "memory_gb": 1.0})
    prompts = [[10, 20, 30, 40, 50], [60, 70, 80], list(range(100, 140)), [5] * 12]
    greedy = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts, ref.generate([{"prompt_token_ids": p} for p in prompts], greedy))]
    want, got = teacher_forced(ref, sequences), teacher_forced(vendor, sequences)
    agree = sum(w[0] == g[0] for w, g in zip(want, got))
    assert agree >= 0.85 * len(want), f"top token agrees at {agree}/{len(want)} positions"
    assert max(abs(w[1] - g[1]) for w, g in zip(want, got)) <= 0.25
    assert want != got  # the weights really are int8
    model = vendor.engine.c.runner.model
    int8 = [m for m in model.modules() if isinstance(m, Int8WeightOnlyLinear)]
    assert len(int8) == 4 * len(model.layers)  # qkv, o, gate_up, down of every layer; not the head
    assert type(model.lm_head) is torch.nn.Linear
    assert vendor.engine.c.platform.kv_bytes == sum(
        t.numel() * t.element_size() for c in vendor.engine.kv.layer_caches() for t in c.tensors().values()
    )


def test_vendor_platform_enforces_its_memory_and_auto_picks_it(example_plugins, tiny_llama):
    with pytest.raises(ValueError, match="device.memory_gb: the KV cache needs more than the vendor device's"):
        LLM(model={"path": tiny_llama[0]}, device={"plugin": "vendor_cpu", "memory_gb": 1e-6},
            kv_cache={"plugin": "paged", "num_blocks": 64})
    r = resolve({"model": {"path": tiny_llama[0]}, "device": "auto"})
    assert r.plugin_name("device") == "vendor_cpu"  # installed platforms come before cuda and cpu
    assert r.pipeline.attention["plugin"] == "torch"  # the platform's default attention


# ----------------------------------------------------------------------------- a KV backend from scratch


def _scratch_config(path: str, n: int) -> dict:
    """24 blocks of 4 tokens for prompts of 5-40 tokens: preemption (by recompute) is certain."""
    return {
        "model": {"path": path, "max_model_len": 96},
        "scheduler": {"plugin": "fcfs", "max_num_batched_tokens": 32},
        "kv_cache": {"plugin": "scratch", "block_size": 4, "num_blocks": 24},
        "parallel": {"tensor_parallel_size": n},
    }


def test_kv_backend_written_from_scratch_matches_paged(example_plugins, tiny_models):
    """Not a subclass of paged: prefix caching off, preemption, n > 1 forks through copy_blocks,
    tensor parallelism 2 replaying those copies on the worker; tokens equal paged's."""
    from modserve_scratch_kv import ScratchKV

    path, hf = tiny_models["qwen2"]  # 2 KV heads: splits over 2 ranks
    prompts = [list(range(3 + i, 3 + i + length)) for i, length in enumerate([5, 40, 17, 33, 9, 26])]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    sampled = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=7, n=3)
    paged = LLM({**_scratch_config(path, 1), "kv_cache": {"plugin": "paged", "block_size": 4, "num_blocks": 24, "prefix_caching": False}})
    want = [[c.token_ids for c in o.outputs] for o in paged.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    want_n = [[c.token_ids for c in o.outputs] for o in paged.generate([{"prompt_token_ids": prompts[1]}], sampled)]
    for n in (1, 2):
        llm = LLM(_scratch_config(path, n))
        try:
            kv = llm.engine.kv
            assert isinstance(kv, ScratchKV) and not isinstance(kv, type(paged.engine.kv))
            got = [[c.token_ids for c in o.outputs] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
            assert got == want, f"tensor_parallel_size {n}"
            assert llm.engine.scheduler.stats().num_preemptions > 0
            got_n = [[c.token_ids for c in o.outputs] for o in llm.generate([{"prompt_token_ids": prompts[1]}], sampled)]
            assert got_n == want_n, f"n > 1 with tensor_parallel_size {n}"
            assert kv.fork_copies > 0
            if n == 2:
                assert llm.engine.runner.copies.counts.get("device->device", 0) == kv.fork_copies
            assert kv.num_free_blocks == kv.num_blocks
        finally:
            llm.engine.shutdown()


# ----------------------------------------------------------------------------- the contract


def _plugin_module(contract: str | None) -> types.ModuleType:
    module = types.ModuleType("acme_scheduler")
    if contract is not None:
        module.MODSERVE_CONTRACT = contract

    @hookimpl
    def register_schedulers():
        return {"acme": object}

    module.register_schedulers = register_schedulers
    return module


@pytest.mark.parametrize("declared", ["3.0", "2.9", "0.9"])
def test_incompatible_contract_is_refused_naming_both_versions(declared):
    registry = PluginRegistry()
    with pytest.raises(PluginContractError) as err:
        registry.register_module(_plugin_module(declared), source="acme-scheduler")
    message = str(err.value)
    assert "acme-scheduler" in message
    assert f"contract {declared}" in message
    assert f"provides contract {CONTRACT_VERSION}" in message
    assert "acme" not in registry.implementations("schedulers")


def test_plugin_without_a_contract_is_refused():
    with pytest.raises(PluginContractError, match=f"does not declare MODSERVE_CONTRACT.*contract {CONTRACT_VERSION}"):
        PluginRegistry().register_module(_plugin_module(None), source="acme-scheduler")


def test_plugin_declaring_the_current_contract_registers():
    module = _plugin_module(CONTRACT_VERSION)
    module.register_schedulers = hookimpl(lambda: {"acme": _AcmeScheduler})
    registry = PluginRegistry()
    registry.register_module(module, source="acme-scheduler")
    impl = registry.implementations("schedulers")["acme"]
    assert (impl.source, impl.contract) == ("acme-scheduler", CONTRACT_VERSION)


def test_a_1x_plugin_is_refused_with_what_changed():
    with pytest.raises(PluginContractError) as err:
        PluginRegistry().register_module(_plugin_module("1.0"), source="acme-scheduler")
    message = str(err.value)
    assert "acme-scheduler targets modserve contract 1.0" in message
    assert "cls(config, ctx)" in message and "docs/plugins-tutorial.md#migrating-from-contract-1x" in message


class _AcmeScheduler(Scheduler):
    pass


def test_two_packages_registering_one_name_is_a_start_up_error_naming_both():
    module = _plugin_module(CONTRACT_VERSION)
    module.register_schedulers = hookimpl(lambda: {"fcfs": _AcmeScheduler})
    registry = PluginRegistry()
    registry.register_module(module, source="acme-scheduler (acme)")
    with pytest.raises(PluginContractError, match=r"scheduler 'fcfs' is registered twice: by modserve \(built-in\) and by acme-scheduler \(acme\)"):
        registry.implementations("schedulers")


def test_a_class_that_is_not_its_kinds_interface_is_refused():
    registry = PluginRegistry()
    registry.register_module(_plugin_module(CONTRACT_VERSION), source="acme-scheduler")
    with pytest.raises(PluginContractError, match=r"'acme' -> <class 'object'>, which does not derive from modserve.core.contract.Scheduler"):
        registry.implementations("schedulers")
