"""``python -m modserve.server -c pipeline.yaml [--host H] [--port P] [--replicas N]`` (what ``serve`` runs)."""

from __future__ import annotations

import argparse
import sys

from modserve.server.app import serve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m modserve.server", description="Run the OpenAI-compatible server.")
    p.add_argument("-c", "--config", help="pipeline YAML (default: the embedded SmolLM2 pipeline)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--replicas", type=int, help="data-parallel engine replicas (overrides parallel.data_parallel_size)")
    args = p.parse_args(argv)
    return serve(args.config, host=args.host, port=args.port, replicas=args.replicas)


if __name__ == "__main__":
    sys.exit(main())
