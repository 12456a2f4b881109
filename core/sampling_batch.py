"""Per-step sampling parameters gathered into tensors, one row per sampled position.

Built once per step by the engine so that samplers do batched tensor math only. Each row
carries its request's seed and a counter (the index of the token it produces), from
which :func:`row_uniforms` derives that row's random numbers: the same seed gives the
same tokens whatever else shares the batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from modserve.core.request import Request

_M1, _M2, _GOLDEN = -4658895280553007687, -7723592293110705685, -7046029254386353131  # splitmix64


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [R] float32 (1.0 on greedy rows)
    greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [R] long, vocab size where disabled
    top_p: torch.Tensor | None  # [R] float32
    min_p: torch.Tensor | None  # [R] float32
    seeds: torch.Tensor  # [R] int64
    counters: torch.Tensor  # [R] int64
    presence: torch.Tensor | None  # [R] float32
    frequency: torch.Tensor | None
    repetition: torch.Tensor | None
    output_ids: torch.Tensor | None  # [R, L] long, padded with vocab (out of range)
    seen_ids: torch.Tensor | None  # [R, P] long: prompt + output, padded with vocab
    banned_rows: torch.Tensor | None  # min_tokens: (row, token) pairs to mask
    banned_tokens: torch.Tensor | None
    max_logprobs: int  # top-N to return (-1: none)

    @classmethod
    def build(cls, requests: list[Request], counters: list[int], vocab_size: int, device) -> SamplingBatch:
        """One row per entry of ``requests``; ``counters[i]`` is the output index row i samples."""
        sps = [r.sampling_params for r in requests]
        greedy = [sp.greedy for sp in sps]
        f32 = dict(dtype=torch.float32, device=device)
        top_k = top_p = min_p = None
        if any(sp.top_k for sp in sps):
            top_k = torch.tensor([sp.top_k or vocab_size for sp in sps], dtype=torch.long, device=device)
        if any(sp.top_p < 1.0 for sp in sps):
            top_p = torch.tensor([sp.top_p for sp in sps], **f32)
        if any(sp.min_p > 0.0 for sp in sps):
            min_p = torch.tensor([sp.min_p for sp in sps], **f32)
        presence = frequency = repetition = output_ids = seen_ids = None
        if any(sp.needs_penalties for sp in sps):
            presence = torch.tensor([sp.presence_penalty for sp in sps], **f32)
            frequency = torch.tensor([sp.frequency_penalty for sp in sps], **f32)
            repetition = torch.tensor([sp.repetition_penalty for sp in sps], **f32)
            outputs = [r.output_token_ids[:c] for r, c in zip(requests, counters)]
            output_ids = _pad(outputs, vocab_size, device)
            seen_ids = _pad([r.prompt_token_ids + o for r, o in zip(requests, outputs)], vocab_size, device)
        banned = [
            (row, tok)
            for row, (r, c) in enumerate(zip(requests, counters))
            if c < r.sampling_params.min_tokens
            for tok in (*r.sampling_params.stop_token_ids, *(() if r.sampling_params.ignore_eos else r.eos_token_ids))
        ]
        banned_rows = banned_tokens = None
        if banned:
            banned_rows = torch.tensor([b[0] for b in banned], dtype=torch.long, device=device)
            banned_tokens = torch.tensor([b[1] for b in banned], dtype=torch.long, device=device)
        return cls(
            temperature=torch.tensor([1.0 if g else sp.temperature for g, sp in zip(greedy, sps)], **f32),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=torch.tensor([sp.seed for sp in sps], dtype=torch.int64, device=device),
            counters=torch.tensor(counters, dtype=torch.int64, device=device),
            presence=presence,
            frequency=frequency,
            repetition=repetition,
            output_ids=output_ids,
            seen_ids=seen_ids,
            banned_rows=banned_rows,
            banned_tokens=banned_tokens,
            max_logprobs=max((sp.logprobs for sp in sps if sp.logprobs is not None), default=-1),
        )


def _pad(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def _splitmix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping multiply, logical shifts)."""
    z = z + _GOLDEN
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _M1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _M2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def row_uniforms(seeds: torch.Tensor, counters: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """A float64 uniform in [0, 1) per row, a pure function of (seed, counter, stream)."""
    z = _splitmix(_splitmix(seeds) ^ _splitmix(counters * 8 + stream))
    return ((z >> 11) & ((1 << 53) - 1)).double() * (2.0**-53)


def fresh_seed(rng: random.Random) -> int:
    """A seed for a request that gave none (so every row samples the same way)."""
    return rng.getrandbits(63)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample one token per row by inverting the (unnormalised) CDF at ``uniforms``."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
