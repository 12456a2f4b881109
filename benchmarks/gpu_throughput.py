"""modserve on one GPU against HF ``transformers`` and the memory roofline.

For SmolLM2-, Llama-3.2-1B- and Llama-3.1-8B-shaped checkpoints with random bfloat16 weights
(built here, no download) it measures, all in one run on one GPU:

- offline output tok/s: modserve with CUDA graphs (and graph pieces where ``--device-options``
  turns them on), with decode graphs alone, the same engine with graphs off, and HF
  ``generate`` in static batches of 64 on the same requests (prompts 256 +- 50%, outputs
  128 +- 50%, ``ignore_eos``);
- online output tok/s, median TPOT and p99 TTFT at 64 and 256 clients (``modserve serve`` and
  ``modserve bench serve`` on 127.0.0.1), CUDA graphs on, each after a short warm-up round
  (graphs are captured when a size is first needed);
- online, the CPU seconds the server and the client spent per wall second, and with
  ``--py-spy PATH`` a py-spy profile of the server (collapsed stacks, per thread) during the
  256-client run: where the host time goes when online lags offline;
- decode steps of 1, 64 and 256 requests: wall time per step with and without graphs, the GPU
  time of the forward alone (a graph replay timed with CUDA events), hence the engine's share
  of the step, and the bytes a step reads (weights + KV) against the measured copy bandwidth;
- the Triton paged-decode kernel against ``scaled_dot_product_attention`` on contiguous K/V
  (flash, GQA), 64 requests x 1,024 and 4,096 positions, each model's head shape; and the
  kernel at 16, 64 and 256 requests of 450 and 2,048 positions split 1 to 16 ways, beside the
  partitions the backend plans there.

    python benchmarks/gpu_throughput.py [--models smollm2,llama1b,llama8b] [--no-online] [--out DIR]

``--device cpu --smoke`` runs the plumbing on a tiny shape without a GPU (no timings worth
reading). Raw results: DIR/gpu_throughput.json (default benchmarks/results/, ignored).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from modserve.core.contract import hookimpl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

SHAPES = {  # LlamaConfig fields; head size 64 (SmolLM2, 1B) and 128 (8B), both Triton's
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=384, tie_word_embeddings=True, rope_theta=10000.0),
}
PROMPTS, INPUT_LEN, OUTPUT_LEN, RANGE = 256, 256, 128, 0.5
HF_BATCH = 64


def build_tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer with one word per id of the model's vocabulary: random weights
    emit any id, and each must decode to text, or the client sees empty chunks and its TTFT
    and TPOT lose their meaning (the first GPU run's did, with a 384-id tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {"<unk>": 0, "<|im_end|>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.ByteLevel()  # ASCII words decode to themselves; the loader needs a known decoder
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None}, f)


def build_checkpoint(shape: dict, path: str, device: str):
    """A random bfloat16 Llama of ``shape`` saved to ``path``, with a word-level tokenizer as
    large as its vocabulary; returns the HF model, on ``device``."""
    import transformers

    build_tokenizer(path, shape["vocab_size"])
    cfg = transformers.LlamaConfig(**shape, max_position_embeddings=4096, eos_token_id=1, bos_token_id=None,
                                   pad_token_id=0)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16: an 8B model in float32 first would take 32 GB
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path)
    return model


def requests(vocab: int, num: int = PROMPTS):
    from modserve.bench import datasets as ds
    from modserve.bench.throughput import _token_space

    return ds.random_requests(num, INPUT_LEN, OUTPUT_LEN, RANGE, _token_space(vocab), 0)


def hf_offline(model, reqs, device: str) -> float:
    """Output tok/s of HF generate in static batches (``bench throughput --baseline hf``'s:
    left-padded, each row generating its batch's longest output; tokens counted per request,
    as vLLM counts them)."""
    from modserve.bench.throughput import _hf_generate

    _hf_generate(model, reqs[:2], 4, device)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(reqs), HF_BATCH):
        _hf_generate(model, reqs[i : i + HF_BATCH], device=device)
    sync(device)
    return sum(r.output_len for r in reqs) / (time.perf_counter() - t0)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def pipeline(path: str, device: str, smoke: bool, options: dict | None = None) -> dict:
    """``options``: the device section's own (e.g. ``{"piecewise_graphs": false}``)."""
    return {
        "model": {"path": path, "dtype": "bfloat16", "max_model_len": 2048},
        "device": {"plugin": device, **options} if options else device,
        "attention": {"plugin": "torch" if smoke else "triton"},
        "kv_cache": {"plugin": "paged", "block_size": 16, "memory_gb": 1.0 if smoke else 24.0},
        "scheduler": {"plugin": "fcfs", "max_num_seqs": 256, "max_num_batched_tokens": 8192},
        "observers": [],
    }


class StepLog:
    """Observer: every step's size and where its wall time went."""

    PARTS = ("step", "schedule", "prepare", "model", "sample", "output")

    def __init__(self) -> None:
        self.steps: list = []  # StepStats

    @hookimpl
    def on_step_finished(self, stats) -> None:
        self.steps.append(stats)


def capture_every_size(llm) -> None:
    """Staggered outputs drain the batch one request a step: every graph size is captured."""
    from modserve import SamplingParams

    graphs = llm.engine.runner.graphs
    if graphs is None:
        return
    top = graphs.sizes[-1]
    llm.generate([[100 + i % 50] * 8 for i in range(top)],
                 [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True) for i in range(top)])


def modserve_offline(llm, reqs) -> float:
    from modserve import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


STEP_BATCHES = (1, 64, 256)


def decode_steps(llm, batch: int, log: StepLog) -> dict[str, float]:
    """Median milliseconds of a decode-only step of ``batch`` requests (128-token prompts), whole
    and by part (schedule, prepare, model: the forward and the wait for it, sample, output)."""
    from modserve import SamplingParams

    log.steps.clear()
    llm.generate([[100 + (i * 7 + j) % 250 for j in range(128)] for i in range(batch)],
                 SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    decode = [s for s in log.steps if s.num_prompt_tokens == 0 and s.num_scheduled_tokens == batch][4:]
    return {part: statistics.median(getattr(s, f"{part}_time_s") for s in decode) * 1e3 for part in StepLog.PARTS}


def gpu_seconds(fn, repeats: int) -> float:
    """GPU seconds a call of ``fn`` takes: three warm-up calls, then ``repeats`` between CUDA events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats / 1000


def forward_gpu_seconds(llm, batch: int) -> float | None:
    """GPU time of the captured forward for ``batch`` rows (graph replays)."""
    graphs = llm.engine.runner.graphs
    if graphs is None or batch not in graphs.captured:
        return None
    return gpu_seconds(graphs.captured[batch], 20)


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy (read + write), the roofline's denominator."""
    if device != "cuda":
        return float("nan")
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / gpu_seconds(lambda: dst.copy_(src), 10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def profile_server(py_spy: str | None, pid: int, out: Path):
    """py-spy sampling the server for 20 s from 5 s into the run (past the first prefills)."""
    import subprocess

    if not py_spy:
        return None
    cmd = f"sleep 5; exec {py_spy} record --pid {pid} --duration 20 --rate 50 --format raw --threads --nonblocking -o {out}"
    return subprocess.Popen(["bash", "-c", cmd], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def online(path: str, device: str, smoke: bool, out_dir: Path, name: str, py_spy: str | None = None,
           options: dict | None = None) -> dict:
    """Output tok/s, median TPOT and p99 TTFT at 64 and 256 clients, and each side's CPU use."""
    import resource
    import subprocess

    import yaml
    from modserve.bench.launch import launch_server

    config = out_dir / f"{name}.yaml"
    config.write_text(yaml.safe_dump({**pipeline(path, device, smoke, options), "observers": [{"plugin": "metrics"}]}))
    proc, url, _ = launch_server(["modserve.server", "-c", str(config), "--port", "0"], out_dir / f"{name}-server.log", 600,
                                 cwd=str(out_dir))
    results = {}
    try:
        for clients in (64, 256):
            result = out_dir / f"{name}-online-{clients}.json"
            cmd = [sys.executable, "-m", "modserve.cli", "bench", "serve", "--base-url", url, "--tokenizer", path,
                   "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
                   "--random-range-ratio", str(RANGE), "--ignore-eos", "--max-concurrency", str(clients),
                   "--num-prompts", str(8 if smoke else 2 * clients), "--no-progress", "--output", str(result)]
            # a short round first, so that most graph sizes are captured before the measured one
            warm = [*cmd[: cmd.index("--random-output-len") + 1], "32", *cmd[cmd.index("--random-output-len") + 2 :]]
            warm[warm.index("--num-prompts") + 1] = str(8 if smoke else clients)
            warm[warm.index("--output") + 1] = str(out_dir / f"{name}-warm-{clients}.json")
            subprocess.run(warm, check=True, capture_output=True, text=True, timeout=600, cwd=str(out_dir))
            spy = profile_server(py_spy, proc.pid, out_dir / f"{name}-server-{clients}.pyspy.txt") if clients == 256 else None
            t, server0 = time.perf_counter(), cpu_seconds(proc.pid)
            client0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600, cwd=str(out_dir))
            wall, client1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN)
            m = json.loads(result.read_text())
            results[clients] = {k: m[k] for k in ("output_throughput", "median_tpot_ms", "p99_ttft_ms", "failed")
                                if k in m}
            results[clients]["server_cpu_per_s"] = (cpu_seconds(proc.pid) - server0) / wall
            results[clients]["client_cpu_per_s"] = (client1.ru_utime + client1.ru_stime - client0.ru_utime
                                                    - client0.ru_stime) / wall
            if spy is not None:
                spy.wait(timeout=60)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return results


@dataclass
class DecodeCase:
    """``b`` decode rows of ``ctx`` positions over a paged bfloat16 cache (blocks of 16, shuffled)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    meta: Any
    reqs: torch.Tensor
    out: torch.Tensor
    kv_heads: int


def decode_case(shape: dict, device: str, b: int, ctx: int) -> DecodeCase:
    from modserve.core.contract import AttentionMetadata

    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    d, bs = shape["hidden_size"] // heads, 16
    width = -(-ctx // bs)
    k = torch.randn(b * width, bs, kv_heads, d, dtype=torch.bfloat16, device=device)
    table = torch.randperm(b * width, device=device, dtype=torch.int32).view(b, width)
    q = torch.randn(b, heads, d, dtype=torch.bfloat16, device=device)
    seq = torch.full((b,), ctx, dtype=torch.int32, device=device)
    meta = AttentionMetadata(b, torch.arange(b + 1, dtype=torch.int32, device=device), seq, seq - 1,
                             torch.zeros(b, dtype=torch.int64, device=device), table, [1] * b, [ctx] * b, 1, ctx)
    return DecodeCase(q, k, torch.randn_like(k), table, meta, torch.arange(b, dtype=torch.int32, device=device),
                      torch.empty_like(q), kv_heads)


def decode_call(case: DecodeCase, plan, splits: int):
    """The Triton decode over ``case`` split ``splits`` ways, as a callable to time."""
    from modserve.core.contract import LayerKVCache
    from modserve.plugins.attention import triton_kernels as tk

    b, heads, d = case.q.shape
    partials = (torch.empty(b, heads, splits, d, dtype=torch.float32, device=case.q.device),
                torch.empty(b, heads, splits, dtype=torch.float32, device=case.q.device)) if splits > 1 else None
    cache = LayerKVCache(k=case.k, v=case.v)
    return lambda: tk.decode_attention(case.q, cache, case.meta, case.reqs, plan.block_n, d**-0.5, case.out, partials)


def planned_splits(plan, case: DecodeCase) -> int:
    """The partitions the backend plans for ``case`` on its device (the default plan)."""
    from modserve.plugins.attention.triton_backend import decode_splits, fill_programs

    b, ctx = case.q.shape[0], case.meta.max_seq_len
    return decode_splits(plan, b * case.kv_heads, ctx, fill_programs(case.q.device))


def decode_kernel_vs_sdpa(shape: dict, device: str) -> dict:
    """Microseconds of the Triton paged decode (split-K as the backend plans it) and of SDPA
    on contiguous K/V, 64 requests, bfloat16; then the split sweep."""
    import torch.nn.functional as F

    from modserve.plugins.attention.triton_backend import TritonAttention

    plan = TritonAttention.Config()
    out = {}
    for ctx in (1024, 4096):
        b, case = 64, decode_case(shape, device, 64, ctx)
        kv_heads, d = case.kv_heads, case.q.shape[2]
        kc = case.k[case.table.long()].reshape(b, ctx, kv_heads, d).transpose(1, 2).contiguous()
        vc = case.v[case.table.long()].reshape(b, ctx, kv_heads, d).transpose(1, 2).contiguous()
        runs = {
            "triton_us": decode_call(case, plan, planned_splits(plan, case)),
            "sdpa_us": lambda: F.scaled_dot_product_attention(case.q[:, :, None], kc, vc, enable_gqa=True),
        }
        for name, fn in runs.items():
            out.setdefault(ctx, {})[name] = gpu_seconds(fn, 50) * 1e6
        out[ctx]["kv_bytes"] = 2 * b * ctx * kv_heads * d * 2
    for b in (16, 64, 256):
        for ctx in (450, 2048):
            out[f"splits_b{b}_ctx{ctx}"] = split_sweep(shape, device, plan, b, ctx)
    return out


def split_sweep(shape: dict, device: str, plan, b: int, ctx: int) -> dict:
    """Microseconds of the decode kernel over ``b`` rows of ``ctx`` positions split into 1, 2,
    4, 8 and 16 partitions, beside the partitions the backend plans there."""
    case = decode_case(shape, device, b, ctx)
    out: dict = {"planned": planned_splits(plan, case)}
    for splits in (1, 2, 4, 8, 16):
        out[str(splits)] = gpu_seconds(decode_call(case, plan, splits), 30) * 1e6
    return out


def bench_model(name: str, args, bandwidth: float) -> dict:
    device = args.device
    res: dict = {"model": name}
    with tempfile.TemporaryDirectory(dir=args.tmp) as path:
        t = time.perf_counter()
        hf = build_checkpoint(SHAPES[name], path, device)
        res["weight_bytes"] = sum(p.numel() * p.element_size() for p in hf.parameters())
        res["build_s"] = time.perf_counter() - t
        reqs = requests(SHAPES[name]["vocab_size"], 8 if args.smoke else PROMPTS)
        if args.hf:
            res["hf_offline_tok_s"] = hf_offline(hf, reqs, device)
        del hf
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        if args.offline:
            modserve_measures(res, name, args, path, reqs, bandwidth)
        if args.online:
            if device == "cuda":  # what this process still holds when the server needs the GPU
                res["gib_held_before_server"] = torch.cuda.memory_reserved() / 2**30
            try:
                res["online"] = online(path, device, args.smoke, Path(args.out), name, args.py_spy, args.device_options)
            except Exception as e:  # noqa: BLE001 - reported beside the offline figures
                res["online"] = f"{type(e).__name__}: {e}"
    return res


def modserve_measures(res: dict, name: str, args, path: str, reqs, bandwidth: float) -> None:
    """Offline tok/s and decode steps with graphs and then eagerly, and the kernel comparison."""
    from modserve import LLM

    device, smoke = args.device, args.smoke
    llm = LLM(pipeline(path, device, smoke, args.device_options))
    log = StepLog()
    llm.engine.c.registry.pm.register(log)
    t = time.perf_counter()
    capture_every_size(llm)
    res["capture_s"] = time.perf_counter() - t
    modserve_offline(llm, reqs[:16])  # compiles the prefill kernels, else the first timed run pays for it
    graphs = llm.engine.runner.graphs
    res["offline_tok_s"] = modserve_offline(llm, reqs)
    pieces = llm.engine.runner.pieces
    res["piece_replays"] = {s: n for s, n in (pieces.replays.items() if pieces else []) if n}
    for b in STEP_BATCHES:
        res[f"step_parts_ms_b{b}"] = parts = decode_steps(llm, b, log)
        res[f"step_ms_b{b}"] = parts["step"]
        gpu = forward_gpu_seconds(llm, b) if device == "cuda" else None
        res[f"forward_gpu_ms_b{b}"] = gpu * 1e3 if gpu else None
    llm.engine.runner.pieces = None  # the same engine and KV, decode graphs only (piecewise_graphs: false)
    res["decode_graphs_offline_tok_s"] = modserve_offline(llm, reqs)
    llm.engine.runner.graphs = None  # and every step eager (what cuda_graphs: false builds)
    res["eager_offline_tok_s"] = modserve_offline(llm, reqs)
    for b in STEP_BATCHES:
        res[f"eager_step_parts_ms_b{b}"] = parts = decode_steps(llm, b, log)
        res[f"eager_step_ms_b{b}"] = parts["step"]
    res["graph_replays"] = {s: n for s, n in (graphs.replays.items() if graphs else []) if n}
    kv_per_token = 2 * SHAPES[name]["num_hidden_layers"] * SHAPES[name]["num_key_value_heads"] * (
        SHAPES[name]["hidden_size"] // SHAPES[name]["num_attention_heads"]) * 2
    res["b1_bytes_per_step"] = res["weight_bytes"] + kv_per_token * 152  # 128-token prompt, ~24 outputs in
    # a step's bytes over the copy's bytes moved per second (read + write: HBM's whole rate)
    res["b1_fraction_of_copy_bw"] = res["b1_bytes_per_step"] / (res["step_ms_b1"] / 1e3) / bandwidth
    llm.engine.c.registry.pm.unregister(log)
    del llm, graphs, log  # the graphs hold their memory pool: gone before a server needs the GPU
    gc.collect()  # the engine's reference cycles kept 44 GiB alive once, and the 8B server ran out of memory
    if device == "cuda":
        torch.cuda.empty_cache()
        if args.kernel:
            res["decode_kernel"] = decode_kernel_vs_sdpa(SHAPES[name], device)
    print(json.dumps(res, default=str), flush=True)  # what a time limit would otherwise lose


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,llama1b,llama8b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--smoke", action="store_true", help="tiny shape, few requests: the plumbing only")
    p.add_argument("--online", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True, help="modserve offline and steps")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="the HF generate baseline")
    p.add_argument("--kernel", action=argparse.BooleanOptionalAction, default=True, help="Triton decode vs SDPA")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--tmp", default=None, help="where checkpoints are written (default: the system's temp)")
    p.add_argument("--py-spy", default=None, metavar="PATH", help="profile the server with this py-spy binary")
    p.add_argument("--device-options", type=json.loads, default=None, metavar="JSON",
                   help='the device section\'s options, e.g. \'{"piecewise_graphs": false}\'')
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bandwidth = copy_bandwidth(args.device)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    results = []
    for model in (["tiny"] if args.smoke else args.models.split(",")):
        t = time.perf_counter()
        try:
            res = bench_model(model, args, bandwidth)
        except Exception as e:  # noqa: BLE001 - one model's failure is reported, the others still run
            res = {"model": model, "error": f"{type(e).__name__}: {e}"}
        res["seconds"] = time.perf_counter() - t
        results.append(res)
        print(json.dumps(res, default=str), flush=True)
    Path(args.out, "gpu_throughput.json").write_text(json.dumps({"device": name, "bandwidth": bandwidth, "results": results},
                                                                default=str, indent=1))


if __name__ == "__main__":
    main()
