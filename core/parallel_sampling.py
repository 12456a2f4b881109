"""``n > 1``: one request fans out into n child sequences and their outputs merge back.

The engine computes the prompt once and forks the other children from it (they share
its KV blocks). A seeded parent gives child i the seed ``seed + i`` (as vLLM does), so
the n samples differ but are reproducible.
"""

from __future__ import annotations

from modserve.core.outputs import RequestOutput
from modserve.core.sampling_params import SamplingParams


def child_params(params: SamplingParams) -> list[SamplingParams]:
    if params.n == 1:
        return [params]
    return [
        params.with_changes(n=1, seed=None if params.seed is None else params.seed + i) for i in range(params.n)
    ]


def child_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{parent_id}#{index}"


def merge(parent_id: str, prompt: str | None, children: list[RequestOutput]) -> RequestOutput:
    """Combine the children's latest outputs into one, indexed 0..n-1."""
    outputs = []
    for i, child in enumerate(children):
        out = child.outputs[0]
        out.index = i
        outputs.append(out)
    first = children[0]
    return RequestOutput(
        request_id=parent_id,
        prompt=prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=outputs,
        finished=all(c.finished for c in children),
        error=next((c.error for c in children if c.error), None),
        prompt_logprobs=first.prompt_logprobs,
        num_cached_tokens=first.num_cached_tokens,
    )
