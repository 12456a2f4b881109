"""``modserve bench roofline``: how close the engine gets to this machine's limits.

Throughput alone does not say whether a number is good: 300 tokens/s can be near the
hardware's ceiling on one machine and a tenth of it on another. This command measures the
ceilings first — matmul FLOP/s per dtype (``torch.nn.functional.linear`` on the model's own
GEMM shapes and one large GEMM) and memory bandwidth (read and copy) — then runs the engine on
a fixed workload with an observer plugin that adds up every step's ``StepStats`` and the
context each scheduled token attends to. From those it reports MFU (analytic model FLOPs over
model-forward time and over wall time, against the measured peak), where the wall time went
(model forward, schedule, prepare, sample, output, other) and where decode steps sit on the
roofline (bytes moved ≈ weights + KV read; achieved GB/s and arithmetic intensity against the
measured bandwidth and the machine balance). The formulas and their limits are in
docs/benchmarks.md ("Roofline").
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from modserve.bench import datasets as ds
from modserve.bench import forward_parts
from modserve.core.contract import hookimpl

DTYPE_NAMES = ("float32", "bfloat16", "float16")
STEP_TIMES = ("model", "schedule", "prepare", "sample", "output")  # StepStats.<name>_time_s
SHARES = (*STEP_TIMES, "other")


def add_arguments(p) -> None:
    p.add_argument("-c", "--config", help="pipeline YAML (default: embedded SmolLM2)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="matmul dtypes to measure, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (fewer for 16-bit on CPU)")
    p.add_argument("--concurrency", type=int, default=32, help="max_num_seqs of the engine")
    p.add_argument("--num-prompts", type=int, default=None, help="requests (default: --concurrency)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths vary uniformly by this fraction, in [0, 1) (bench serve's random dataset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-engine", action="store_true", help="measure the machine only")
    p.add_argument("--output", help="write all results as JSON")
    p.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # tiny tensors, one repeat: tests
    p.set_defaults(func=run)


# ----------------------------------------------------------------------------- FLOPs and bytes


def gemm_shapes(spec) -> list[tuple[str, int, int]]:
    """``(name, out_features N, in_features K)`` of each matmul the model runs per token."""
    h, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    return [
        ("qkv", q + 2 * kv, h),
        ("o", h, q),
        ("gate_up", 2 * spec.intermediate_size, h),
        ("down", h, spec.intermediate_size),
        ("lm_head", spec.vocab_size, h),
    ]


def layer_matmul_params(spec) -> int:
    """Weights of one decoder layer's matmuls (qkv, o, gate_up, down); biases and norms left out."""
    return sum(n * k for name, n, k in gemm_shapes(spec) if name != "lm_head")


def _context_sum(first: int, last: int) -> int:
    """``first + (first + 1) + ... + last``: the contexts of consecutive positions."""
    return (first + last) * (last - first + 1) // 2 if last >= first else 0


def _linear_flops(spec, tokens: int, sampled_rows: int) -> float:
    """FLOPs of the linear layers: ``tokens`` computed tokens, ``sampled_rows`` rows through the LM head."""
    per_token = 2 * layer_matmul_params(spec) * spec.num_layers
    return float(per_token * tokens + 2 * spec.hidden_size * spec.vocab_size * sampled_rows)


def _attention_flops(spec, context_sum: int) -> float:
    """QK^T and PV FLOPs of computed tokens whose contexts add up to ``context_sum``."""
    return float(4 * spec.num_heads * spec.head_dim * spec.num_layers * context_sum)


def _flops(spec, tokens: int, context_sum: int, sampled_rows: int) -> float:
    """Matmul FLOPs of ``tokens`` computed tokens whose contexts add up to ``context_sum``,
    with ``sampled_rows`` rows through the LM head."""
    return _linear_flops(spec, tokens, sampled_rows) + _attention_flops(spec, context_sum)


def model_flops(spec, prompt_len: int, output_len: int) -> float:
    """Model FLOPs of one request: ``prompt_len`` prompt tokens, ``output_len`` generated tokens.

    Computed tokens are the prompt (positions ``0 .. L-1``) and every output token but the
    last (positions ``L .. L+O-2``): ``L + O - 1`` tokens through the layers, attending to
    ``position + 1`` tokens each. The LM head runs for the sampled rows only: the last prompt
    token and each decode step, ``O`` rows. Embedding lookups, norms, RoPE, activations and
    biases are not counted.
    """
    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"model_flops: prompt_len and output_len must be >= 1, got {prompt_len}, {output_len}")
    computed = prompt_len + output_len - 1
    return _flops(spec, computed, _context_sum(1, computed), output_len)


def weight_bytes(spec, dtype_bytes: int) -> int:
    """Bytes of every matmul weight (all layers and the LM head): what one forward reads at least."""
    return (layer_matmul_params(spec) * spec.num_layers + spec.hidden_size * spec.vocab_size) * dtype_bytes


def held_weight_bytes(model) -> int:
    """Bytes of every tensor ``model`` holds outside its embedding table, each storage once: what
    one forward reads at least, as the platform keeps it (a float32 model's linears held as
    bfloat16 panels, quantized codes and their scales, a tied head's own packed copy), where
    :func:`weight_bytes` assumes every weight in the model's dtype."""
    seen, total = set(), 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "embed_tokens":  # a lookup reads a step's rows, not the table
            continue
        for tensor in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)):
            try:
                storage = tensor.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
            except NotImplementedError:  # oneDNN's packed weights: opaque, no storage to share
                key, nbytes = id(tensor), tensor.numel() * tensor.element_size()
            if key not in seen:
                seen.add(key)
                total += nbytes
    return total


def kv_bytes_per_context_token(spec, dtype_bytes: int, int8: bool = False) -> int:
    """K and V bytes of one context position across layers (int8: one byte per value plus a
    float32 scale per token and head)."""
    per_head = spec.head_dim + 4 if int8 else spec.head_dim * dtype_bytes
    return 2 * spec.num_layers * spec.num_kv_heads * per_head


# ----------------------------------------------------------------------------- the command


def run(args) -> int:
    dtypes = _check_args(args)
    from modserve.core.engine_factory import resolve

    resolved = resolve(args.config)
    print_platform(resolved)
    llm = None
    if args.skip_engine:
        spec, device = read_model_spec(resolved.source, resolved.registry), resolved.platform.device()
    else:  # built first: its spec gives the GEMM shapes, and a GGUF's metadata is parsed once
        llm = build_engine(args, resolved)
        spec, device = llm.engine.c.spec, llm.engine.c.device
        model_dtype = str(llm.engine.c.dtype).removeprefix("torch.")
        if model_dtype not in dtypes:  # MFU needs the peak of the model's own dtype
            dtypes.append(model_dtype)
    machine = measure_machine(spec, dtypes, device, args.repeats, args.quick)
    print_machine(machine)
    engine = None
    if llm is not None:
        engine = run_engine(args, resolved, llm, machine)
        print()
        print_engine(engine)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"machine": machine, "engine": engine}, f, indent=2)
    return 0


def _check_args(args) -> list[str]:
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    for d in dtypes:
        if d not in DTYPE_NAMES:
            raise ValueError(f"--dtypes: expected float32, bfloat16 or float16, got {d!r}")
    if args.num_prompts is None:
        args.num_prompts = args.concurrency
    ds.check_at_least_one(args, ("concurrency", "num_prompts", "input_len", "output_len", "repeats"))
    ds.check_range_ratio(args.range_ratio, "--range-ratio")
    return list(dict.fromkeys(dtypes))


def read_model_spec(source, registry=None):
    """The model's shape without reading its weights (HF ``config.json`` or GGUF metadata)."""
    from modserve.core.contract import BuildContext, ModelSpec
    from modserve.core.models.loader import read_spec
    from modserve.core.plugin_manager import default_registry

    if source.kind == "hf":
        return read_spec(source, BuildContext(registry or default_registry(), None))
    from modserve.core.models import gguf_reader

    reader = gguf_reader._open(source.path)
    meta = reader.metadata
    arch = meta.get("general.architecture")
    if arch not in gguf_reader._ARCHITECTURES:
        raise ValueError(f"{source.path}: unsupported GGUF architecture {arch!r}")
    cfg = gguf_reader._config(meta, arch, {t.name for t in reader.tensors}, source.path)
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    cfg["vocab_size"] = int(embed.n_elements) // cfg["hidden_size"]
    return ModelSpec.from_hf_config(cfg, source.path)


# ----------------------------------------------------------------------------- part 1: the machine


def measure_machine(spec, dtypes: list[str], device, repeats: int = 5, quick: bool = False) -> dict[str, Any]:
    """Matmul FLOP/s per dtype on the model's GEMM shapes and one large GEMM; read and copy GB/s."""
    import torch

    ms = (1, 8) if quick else (1, 32, 512)
    square = 128 if quick else 2048
    shapes = [(name, m, n, k) for m in ms for name, n, k in gemm_shapes(spec)] + [("square", square, square, square)]
    out: dict[str, Any] = {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtypes": {},
    }
    with torch.inference_mode():
        for name in dtypes:
            dtype = getattr(torch, name)
            # 16-bit matmuls on a CPU without native support are several times slower: fewer repeats
            reps = repeats if name == "float32" or device.type != "cpu" else max(1, repeats // 4)
            results = []
            for label, m, n, k in shapes:
                t = _time_linear(m, n, k, dtype, device, 1 if quick else reps)
                results.append({"name": label, "m": m, "n": n, "k": k, "time_s": t, "flops_per_s": 2 * m * n * k / t})
            best = max(results, key=lambda x: x["flops_per_s"])
            out["dtypes"][name] = {
                "peak_flops_per_s": best["flops_per_s"],
                "peak_shape": f"{best['name']} {best['m']}x{best['n']}x{best['k']}",
                "repeats": 1 if quick else reps,
                "shapes": results,
            }
        out["bandwidth"] = _measure_bandwidth(device, (4 if quick else 256) * 2**20, 1 if quick else max(3, repeats))
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _best_time(fn, device, repeats: int, budget_s: float = 0.5) -> float:
    """Seconds per call: one warm-up call, then the best of ``repeats`` timed samples. Calls
    under 5 ms are looped inside a sample; sampling stops early once ``budget_s`` is spent."""
    t0 = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - t0
    inner = 1
    if first < 0.05:  # calibrate on a second (warm) call
        t0 = time.perf_counter()
        fn()
        _sync(device)
        inner = max(1, min(10_000, math.ceil(0.005 / max(time.perf_counter() - t0, 1e-7))))
    best, spent = math.inf, 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        dt = time.perf_counter() - t0
        best, spent = min(best, dt / inner), spent + dt
        if spent > budget_s:
            break
    return best


def _time_linear(m: int, n: int, k: int, dtype, device, repeats: int) -> float:
    import torch
    import torch.nn.functional as F

    from modserve.plugins.platforms import cpu_amx_linear, cpu_avx512_linear
    from modserve.plugins.platforms.cpu import amx_unavailable, avx512_bf16_unavailable
    from modserve.plugins.platforms.cpu_linear import PackedLinear, can_pack

    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device)
    best = _best_time(lambda: F.linear(x, w), device, repeats)
    linear = torch.nn.Linear(k, n, bias=False, dtype=dtype)
    linear.weight.data = w
    if can_pack(device, dtype):  # the engine's own paths on the CPU: weights packed for oneDNN ...
        packed = PackedLinear(linear)
        best = min(best, _best_time(lambda: packed(x), device, repeats))
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16:  # ... or as panels for our AMX or AVX512_BF16 kernel
        for module, unavailable in ((cpu_amx_linear.AmxLinear, lambda: amx_unavailable(cpu_amx_linear.load)),
                                    (cpu_avx512_linear.Avx512Linear, avx512_bf16_unavailable)):  # fmt: skip
            if unavailable() is None:
                panels = module(linear)
                best = min(best, _best_time(lambda: panels(x), device, repeats))
    return best


def _read_gb_s(src, device, repeats: int) -> float:
    """The rate ``src.sum()`` reads ``src`` at, best of ``repeats``."""
    return src.numel() * src.element_size() / _best_time(lambda: src.sum(), device, repeats, budget_s=2.0) / 1e9


def _measure_bandwidth(device, nbytes: int, repeats: int) -> dict[str, Any]:
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.zeros_like(src)  # preallocated and touched: the copy measures memory, not page faults
    read_gb_s = _read_gb_s(src, device, repeats)
    copy = _best_time(lambda: dst.copy_(src), device, repeats, budget_s=2.0)
    size = src.numel() * 4
    return {
        "bytes": size,
        "repeats": repeats,
        "read_gb_s": read_gb_s,
        "copy_gb_s": 2 * size / copy / 1e9,  # read + write
    }


def print_platform(resolved) -> None:
    """What the platform found (device, ISA) and what it chose for the pipeline's ``auto`` settings."""
    import torch

    info = resolved.platform.info()
    p = resolved.pipeline
    dtype = resolved.dtype + (" (model.dtype auto)" if p.model.dtype == "auto" else "")
    print(f"Platform: {resolved.plugin_name('device')} on {info.name}; dtypes {', '.join(info.dtypes)}")
    chosen = [f"dtype {dtype}", f"attention {p.attention['plugin']}", *info.kernels, f"{torch.get_num_threads()} torch threads"]
    print(f"Chose: {', '.join(chosen)}")


def print_machine(m: dict[str, Any]) -> None:
    names = list(m["dtypes"])
    reps = ", ".join(f"{n} {m['dtypes'][n]['repeats']}" for n in names)
    print(f"Machine: {m['device']}, {m['threads']} torch threads, torch {m['torch']}")
    print(f"Matmul GFLOP/s ([M,K] x [N,K]^T: F.linear or, on CPU, oneDNN-packed weights as the engine runs them, the faster; warm-up, best of: {reps})")
    print(f"  {'shape':<8} {'M':>6} {'N':>6} {'K':>6}" + "".join(f" {n:>10}" for n in names))
    rows = zip(*(m["dtypes"][n]["shapes"] for n in names))
    for row in rows:
        s = row[0]
        cells = "".join(f" {r['flops_per_s'] / 1e9:>10.1f}" for r in row)
        print(f"  {s['name']:<8} {s['m']:>6} {s['n']:>6} {s['k']:>6}{cells}")
    print(f"  {'peak':<29}" + "".join(f" {m['dtypes'][n]['peak_flops_per_s'] / 1e9:>10.1f}" for n in names))
    bw = m["bandwidth"]
    print(
        f"Memory bandwidth (float32, {bw['bytes'] / 2**20:.0f} MiB, best of {bw['repeats']}): "
        f"read {bw['read_gb_s']:.1f} GB/s (x.sum()), "
        f"copy {bw['copy_gb_s']:.1f} GB/s (dst.copy_(src), read + write bytes)"
    )


# ----------------------------------------------------------------------------- part 2: the engine


@dataclass(eq=False)  # identity hash: pluggy keeps plugins in dicts
class _StepAccount:
    """An observer plugin adding up every step's ``StepStats`` and the FLOPs and bytes of its
    batch. The contexts come from the scheduler's output (wrapped in ``attach``): each
    scheduled request's computed tokens before the step and how many it computes now."""

    spec: Any
    weight_bytes: int
    kv_bytes_per_token: int
    times: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    decode: dict[str, float] = field(default_factory=dict)
    executed_flops: float = 0.0
    linear_flops: float = 0.0
    _pending: list[tuple[int, int]] = field(default_factory=list)
    parts: forward_parts.ForwardParts | None = None  # timed parts, split by the kind of each step here

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.times = dict.fromkeys(("step", *STEP_TIMES), 0.0)
        self.counts = dict.fromkeys(
            ("steps", "scheduled_tokens", "prompt_tokens", "generation_tokens", "preemptions", "prefix_hits"), 0
        )
        self.decode = dict.fromkeys(("steps", "sequences", "model_time_s", "flops", "bytes", "kv_bytes"), 0)
        self.executed_flops = 0.0
        self.linear_flops = 0.0

    def attach(self, scheduler):
        """Record each step's ``(computed tokens before, tokens now)`` per scheduled request."""
        original = scheduler.schedule

        def schedule():
            out = original()
            self._pending = [(s.request.num_computed_tokens, s.num_tokens) for s in out.scheduled]
            return out

        scheduler.schedule = schedule
        return lambda: delattr(scheduler, "schedule")

    @hookimpl
    def on_step_finished(self, stats) -> None:
        pending, self._pending = self._pending, []
        for name in ("step", *STEP_TIMES):
            self.times[name] += getattr(stats, f"{name}_time_s", 0.0)
        c = self.counts
        c["steps"] += 1
        c["scheduled_tokens"] += stats.num_scheduled_tokens
        c["prompt_tokens"] += stats.num_prompt_tokens
        c["generation_tokens"] += stats.num_generation_tokens
        c["preemptions"] += stats.num_preemptions
        c["prefix_hits"] += stats.prefix_hits
        context = sum(_context_sum(before + 1, before + n) for before, n in pending)
        linear = _linear_flops(self.spec, sum(n for _, n in pending), stats.num_generation_tokens)
        flops = linear + _attention_flops(self.spec, context)
        self.executed_flops += flops
        self.linear_flops += linear
        decode_only = bool(pending) and stats.num_prompt_tokens == 0 and all(n == 1 for _, n in pending)
        if self.parts is not None:
            self.parts.step_done("decode_only" if decode_only else "with_prompt", stats.model_time_s)
        if decode_only:
            d = self.decode
            kv = self.kv_bytes_per_token * context
            d["steps"] += 1
            d["sequences"] += len(pending)
            d["model_time_s"] += stats.model_time_s
            d["flops"] += flops
            d["kv_bytes"] += kv
            d["bytes"] += self.weight_bytes + kv


def _check_lengths(args, max_len: int) -> None:
    """The longest request the lengths and ``--range-ratio`` allow must fit the model."""
    longest = ds.length_bounds(args.input_len, args.range_ratio)[1] + ds.length_bounds(args.output_len, args.range_ratio)[1]
    if longest > max_len:
        spread = f" at --range-ratio {args.range_ratio:g}" if args.range_ratio else ""
        raise ValueError(f"--input-len + --output-len: up to {longest} tokens{spread} exceed max_model_len {max_len}")


def build_engine(args, resolved):
    """The pipeline's engine with ``max_num_seqs = --concurrency`` (the rest of its scheduler section kept)."""
    from modserve import LLM

    if resolved.pipeline.model.max_model_len:  # fail before loading weights when the pipeline says
        _check_lengths(args, resolved.pipeline.model.max_model_len)
    scheduler = {**resolved.pipeline.scheduler, "max_num_seqs": args.concurrency}
    llm = LLM(args.config, scheduler=scheduler)
    _check_lengths(args, llm.engine.max_model_len)
    return llm


def run_engine(args, resolved, llm, machine: dict[str, Any]) -> dict[str, Any]:
    """Run the workload on the engine and account for every step."""
    import torch

    from modserve import SamplingParams
    from modserve.bench.throughput import greedy_params, make_prompts, make_requests

    c = llm.engine.c
    spec, dtype_bytes = c.spec, c.dtype.itemsize
    dtype = str(c.dtype).removeprefix("torch.")
    int8 = getattr(getattr(llm.engine.kv, "config", None), "kv_dtype", "auto") == "int8"
    # timers measure launches on a GPU, and never see a decode step replayed from a graph or call list
    graphs = llm.engine.runner.graphs is not None
    parts = forward_parts.ForwardParts() if c.device.type == "cpu" and not graphs else None
    account = _StepAccount(spec, held_weight_bytes(llm.engine.runner.model), kv_bytes_per_context_token(spec, dtype_bytes, int8),
                           parts=parts)
    c.registry.pm.register(account)
    detach = account.attach(llm.engine.scheduler)
    detach_parts = parts.attach(llm.engine.runner.model, llm.engine.runner.attention) if parts else lambda: None
    try:
        requests = make_requests(args, spec.vocab_size)
        # other ids than the measured prompts: no prefix-cache hits later
        warm = make_prompts(min(2, args.num_prompts), args.input_len, spec.vocab_size, args.seed + 1)
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        account.reset()
        if parts:
            parts.reset()
        t0 = time.perf_counter()
        outs = llm.generate([r.prompt for r in requests], greedy_params(requests))
        wall = time.perf_counter() - t0
    finally:
        detach_parts()
        detach()
        c.registry.pm.unregister(account)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    lengths = [(r.prompt_len, r.output_len) for r in requests]
    # measured again once the run is over: a shared host's bandwidth drifts (a VM's read rate moved
    # between 35.6 and 51.2 GB/s from one run to the next), so the decode steps' share gets both ends
    before = machine["bandwidth"]
    after = _read_gb_s(torch.ones(before["bytes"] // 4, dtype=torch.float32, device=c.device), c.device, before["repeats"])
    report = engine_report(account, spec, machine, dtype, wall, out_tokens, args, c.model_name, lengths, after)
    report["forward_parts"] = None if parts is None else forward_parts.report(
        parts, account.times["model"], wall, out_tokens, account.linear_flops, report["peak_flops_per_s"])
    replayed = "not timed: decode steps replay as graphs, which no timer sees (device.decode_graphs: false times them)"
    report["forward_parts_off"] = None if parts else replayed if graphs else "timed on the CPU only"
    report["plugins"] = {k: v for k, v in c.info()["plugins"].items() if v is not None}
    if resolved.pipeline.speculative:
        report["notes"].append("speculative decoding is on: drafts make the FLOP and decode figures inexact")
    return report


def engine_report(
    account: _StepAccount, spec, machine, dtype: str, wall: float, out_tokens: int, args, model_name: str,
    lengths: list[tuple[int, int]], read_gb_s_after: float | None = None,
) -> dict[str, Any]:
    """The engine figures from one run's accounting and the machine's measured limits;
    ``lengths``: each request's ``(prompt tokens, output tokens)``; ``read_gb_s_after``: the read
    bandwidth measured again after the run (the decode steps' share of it too)."""
    flops = sum(model_flops(spec, prompt, output) for prompt, output in lengths)
    asked = sum(output for _, output in lengths)
    peak = machine["dtypes"][dtype]["peak_flops_per_s"]
    read_bw = machine["bandwidth"]["read_gb_s"] * 1e9
    times = {name: account.times[name] for name in STEP_TIMES}
    times["other"] = max(0.0, wall - sum(times.values()))
    shares = {name: times[name] / wall for name in STEP_TIMES}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    model_time = times["model"]
    notes = []
    if abs(account.executed_flops - flops) > 1e-9 * flops:
        diff = 100 * (account.executed_flops / flops - 1)
        notes.append(
            f"executed FLOPs differ from the analytic model FLOPs by {diff:+.2f}% "
            f"(prefix-cache hits {account.counts['prefix_hits']} tokens, preemptions {account.counts['preemptions']}); "
            "MFU counts the analytic (useful) FLOPs"
        )
    if out_tokens != asked:
        notes.append(
            f"{out_tokens} output tokens instead of {asked}: the analytic FLOPs assume every request ran to its max_tokens"
        )
    d = account.decode
    decode = None
    if d["steps"] and d["model_time_s"] > 0:
        ai = d["flops"] / d["bytes"]
        achieved_bw = d["bytes"] / d["model_time_s"]
        achieved = d["flops"] / d["model_time_s"]
        attainable = min(peak, ai * read_bw)
        decode = {
            "steps": d["steps"],
            "mean_batch": d["sequences"] / d["steps"],
            "model_time_s": d["model_time_s"],
            "flops": d["flops"],
            "bytes": d["bytes"],
            "weight_bytes_per_step": account.weight_bytes,
            "kv_bytes_per_step": d["kv_bytes"] / d["steps"],
            "achieved_gb_s": achieved_bw / 1e9,
            "bandwidth_share": achieved_bw / read_bw,
            "read_gb_s_after": read_gb_s_after,
            "bandwidth_share_after": None if read_gb_s_after is None else achieved_bw / (read_gb_s_after * 1e9),
            "achieved_flops_per_s": achieved,
            "arithmetic_intensity": ai,
            "machine_balance": peak / read_bw,
            "bound": "memory" if ai < peak / read_bw else "compute",
            "roofline_flops_per_s": attainable,
            "roofline_share": achieved / attainable,
        }
    return {
        "model": model_name,
        "dtype": dtype,
        "concurrency": args.concurrency,
        "num_prompts": len(lengths),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "counts": dict(account.counts),
        "model_flops": flops,
        "executed_flops": account.executed_flops,
        "peak_flops_per_s": peak,
        "mfu_model": flops / model_time / peak if model_time > 0 else 0.0,
        "mfu_wall": flops / wall / peak,
        "overhead_share": 1.0 - model_time / wall,
        "times_s": times,
        "shares": shares,
        "decode": decode,
        "notes": notes,
    }


def print_engine(e: dict[str, Any]) -> None:
    c = e["counts"]
    spread = f" ± {100 * e['range_ratio']:g}%" if e.get("range_ratio") else ""
    print(
        f"Engine: {e['model']} {e['dtype']}, {e['num_prompts']} prompts x "
        f"({e['input_len']} in + {e['output_len']} out{spread}), max_num_seqs {e['concurrency']}, ignore_eos, greedy"
    )
    if e.get("plugins"):
        print("  pipeline: " + ", ".join(f"{k} {v}" for k, v in e["plugins"].items()))
    print(
        f"  wall {e['wall_s']:.2f} s, {e['output_tok_s']:.1f} out tok/s, {c['steps']} steps, "
        f"{c['scheduled_tokens']} tokens computed, {c['preemptions']} preemptions"
    )

    def row(label: str, value: str, comment: str = "") -> None:
        print(f"  {label:<30} {value:>16}   {comment}".rstrip())

    row("model FLOPs (analytic)", _si(e["model_flops"], "FLOP"), f"(counted per executed step: {_si(e['executed_flops'], 'FLOP')})")
    row(f"peak matmul {e['dtype']}", _si(e["peak_flops_per_s"], "FLOP/s"), "(measured above)")
    row("MFU over model forward", f"{100 * e['mfu_model']:.2f} %", "(model FLOPs / model-forward time / peak)")
    row("MFU over wall time", f"{100 * e['mfu_wall']:.2f} %", "(model FLOPs / wall / peak)")
    row("engine overhead share", f"{100 * e['overhead_share']:.1f} %", "(1 - model forward / wall)")
    print("  wall time breakdown:")
    labels = {"model": "model forward", "schedule": "schedule", "prepare": "prepare (batch flattening)",
              "sample": "sample", "output": "output (append/stop/detok/finish)", "other": "other (generate loop, between steps)"}
    for name in SHARES:
        print(f"    {labels[name]:<38} {e['times_s'][name]:9.3f} s {100 * e['shares'][name]:6.1f} %")
    d = e["decode"]
    if d is None:
        print("  decode roofline: no decode-only step")
    else:
        print(f"  decode roofline ({d['steps']} decode-only steps, mean batch {d['mean_batch']:.1f}):")
        moved = _si(d["weight_bytes_per_step"] + d["kv_bytes_per_step"], "B")
        row("  bytes moved per step", f"≈ {moved}",
            f"(weights {_si(d['weight_bytes_per_step'], 'B')} + KV read {_si(d['kv_bytes_per_step'], 'B')})")
        after = "" if d.get("read_gb_s_after") is None else (
            f" ({100 * d['bandwidth_share_after']:.0f} % of the {d['read_gb_s_after']:.1f} GB/s measured after the run)")
        row("  achieved bandwidth", f"≈ {d['achieved_gb_s']:.2f} GB/s",
            f"= {100 * d['bandwidth_share']:.0f} % of the measured read bandwidth{after}")
        row("  arithmetic intensity", f"≈ {d['arithmetic_intensity']:.1f} FLOP/B",
            f"vs machine balance {d['machine_balance']:.1f} FLOP/B (peak / read bandwidth): {d['bound']}-bound")
        row("  achieved compute", _si(d["achieved_flops_per_s"], "FLOP/s"),
            f"= {100 * d['roofline_share']:.0f} % of the roofline bound min(peak, intensity x bandwidth) "
            f"≈ {_si(d['roofline_flops_per_s'], 'FLOP/s')}")
    _print_forward_parts(e.get("forward_parts"), e.get("forward_parts_off"), e["output_tok_s"], row)
    for note in e["notes"]:
        print(f"  note: {note}")


def _print_forward_parts(p: dict[str, Any] | None, why_not: str | None, output_tok_s: float, row) -> None:
    if p is None:
        print(f"  model forward by part: {why_not or 'timed on the CPU only'}")
        return
    print("  model forward by part (timers around each call), share of the wall time:")
    labels = {"linears": f"linears ({p['calls']['linears']} calls)",
              "attention": f"attention backend ({p['calls']['attention']} calls)",
              "rest_of_forward": "rest (norms, RoPE, activations, copies)"}
    for name, label in labels.items():
        print(f"    {label:<38} {p['seconds'][name]:9.3f} s {100 * p['shares'][name]:6.1f} %")
    row("  linears' compute", _si(p["linear_flops_per_s"], "FLOP/s"),
        f"= {100 * p['linear_peak_share']:.0f} % of the measured peak")
    row("  ceiling: linears alone", f"{p['ceiling_linears_tok_s']:.1f} tok/s",
        f"(output tokens / linear time; this run {output_tok_s:.1f})")
    row("  ceiling: linears + attention", f"{p['ceiling_linears_attention_tok_s']:.1f} tok/s",
        "(if norms, RoPE, activations and the engine around the forward took no time)")
    print("    by kind of step, model forward: linears / attention / rest")
    names = {"decode_only": "decode-only steps", "with_prompt": "steps with prompt chunks or drafts"}
    for kind, k in p["by_step_kind"].items():
        label = f"{names[kind]} ({k['steps']})"
        print(f"      {label:<42} {k['model_s']:8.3f} s: {k['linears_s']:.3f} / {k['attention_s']:.3f} / {k['rest_s']:.3f} s")


def _si(value: float, unit: str) -> str:
    """``12.3 GFLOP``, ``540.2 MB``: decimal prefixes."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {prefix}{unit}"
    return f"{value:.1f} {unit}"
