"""Logprobs of prompt tokens (completions ``echo`` with ``logprobs``, lm-eval's loglikelihood)."""

from __future__ import annotations

import torch

from modserve.core.request import Request


def record_prompt_logprobs(rows: list[tuple[Request, int, int]], logits: torch.Tensor) -> None:
    """``rows[i] = (request, position p, row)``: the logits at p score prompt token p + 1."""
    logprobs = logits.log_softmax(dim=-1)
    targets = [req.prompt_token_ids[p + 1] for req, p, _ in rows]
    chosen = logprobs[range(len(rows)), targets].tolist()
    n = max(req.sampling_params.prompt_logprobs for req, _, _ in rows)
    top_lp, top_ids = logprobs.topk(max(n, 1), dim=-1)
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    for i, (req, p, _) in enumerate(rows):
        if len(req.prompt_logprobs) == p:  # a recomputed (preempted) prompt is not recorded twice
            k = req.sampling_params.prompt_logprobs
            req.prompt_logprobs.append((chosen[i], list(zip(top_ids[i][:k], top_lp[i][:k]))))
