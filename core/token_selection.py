"""Choosing each request's new tokens from the step's logits, with or without drafts.

Without drafts the sampler plugin picks one token per request. With drafts, each draft
is verified against the target distribution ``p`` of its row (after the sampler's
penalties, temperature and filters): it is accepted with probability ``p(draft)``
(drafts are deterministic proposals, so this is rejection sampling with a one-hot
draft distribution); the first rejected row resamples from ``p`` without the draft, and
a fully accepted run draws a bonus token from the last row. For greedy rows ``p`` is
one-hot, so this accepts exactly the drafts equal to the target's argmax. The output
distribution is exactly the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modserve.core.contract import LogitsProcessor, LogitsRow, Sampler
from modserve.core.sample_plan import SampleEntry
from modserve.core.sampling_batch import SamplingBatch, inverse_cdf, row_uniforms

LogprobRecord = tuple[float, list[tuple[int, float]]]


@dataclass
class Chosen:
    tokens: list[int]
    logprobs: list[LogprobRecord] | None
    num_drafts: int
    num_accepted: int


@torch.inference_mode()  # the logits are the forward's inference tensors; processors change them in place
def select_tokens(
    sampler: Sampler, logits: torch.Tensor, entries: list[SampleEntry], vocab: int,
    processors: dict[str, LogitsProcessor] | None = None,
) -> list[Chosen]:
    """``logits`` has one row per entry row, in order. The logits processors named by the
    rows' requests change them first (draft-verification rows included)."""
    if processors and any(e.request.processor_fields for e in entries):
        apply_processors(processors, logits, entries)
    reqs, counters = [], []
    for e in entries:
        for j in range(len(e.rows)):
            reqs.append(e.request)
            counters.append(e.request.num_output_tokens + j)
    batch = SamplingBatch.build(reqs, counters, vocab, logits.device)
    if not any(e.drafts for e in entries):
        out = sampler.sample(logits, batch)
        tokens = out.token_ids.tolist()
        records = _records(out, entries) if out.logprobs is not None else None
        return [Chosen([t], None if records is None else [records[i]], 0, 0) for i, t in enumerate(tokens)]
    return _verify(sampler, logits, batch, entries)


def apply_processors(processors: dict[str, LogitsProcessor], logits: torch.Tensor, entries: list[SampleEntry]) -> None:
    """Each processor gets the rows whose request sets its field, with the drafts before each row."""
    rows: list[LogitsRow] = []
    fields: list[tuple[str, ...]] = []
    for e in entries:
        for j in range(len(e.rows)):
            rows.append(LogitsRow(e.request, tuple(e.drafts[:j])))
            fields.append(e.request.processor_fields)
    for name, processor in processors.items():
        which = [i for i, f in enumerate(fields) if name in f]
        if which:
            processor.apply(logits, [rows[i] for i in which], which)


def _records(out, entries: list[SampleEntry]) -> list[LogprobRecord]:
    chosen = out.logprobs.tolist()
    top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
    records = []
    for i, e in enumerate(entries):
        n = e.request.sampling_params.logprobs or 0
        top = list(zip(top_ids[i][:n], top_lp[i][:n])) if top_ids is not None and n else []
        records.append((chosen[i], top))
    return records


def _verify(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, entries: list[SampleEntry]) -> list[Chosen]:
    probs = sampler.probs(logits, batch)
    drafts = torch.tensor(
        [d for e in entries for d in (*e.drafts, 0)], dtype=torch.long, device=logits.device
    )  # per row: its draft (0 on bonus rows, unused)
    p_draft = probs.gather(1, drafts[:, None]).squeeze(1)
    accept = (row_uniforms(batch.seeds, batch.counters, stream=1) < p_draft).tolist()
    residual = probs.scatter(1, drafts[:, None], 0.0)
    # (a row whose draft has p = 1 has an empty residual, but such a draft is never rejected)
    resampled = inverse_cdf(residual, row_uniforms(batch.seeds, batch.counters, stream=2)).tolist()
    fresh = inverse_cdf(probs, row_uniforms(batch.seeds, batch.counters)).tolist()
    want_logprobs = any(e.request.sampling_params.logprobs is not None for e in entries)
    raw = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    chosen, row = [], 0
    for e in entries:
        tokens = []
        for j, d in enumerate(e.drafts):
            if accept[row + j]:
                tokens.append(d)
            else:
                tokens.append(resampled[row + j])
                break
        else:
            tokens.append(fresh[row + len(e.drafts)])
        records = _raw_records(raw, row, tokens, e.request.sampling_params.logprobs) if raw is not None else None
        chosen.append(Chosen(tokens, records, len(e.drafts), len(tokens) - 1))
        row += len(e.rows)
    return chosen


def _raw_records(raw: torch.Tensor, row: int, tokens: list[int], n: int | None) -> list[LogprobRecord] | None:
    if n is None:
        return None
    rows = raw[row : row + len(tokens)]
    chosen = rows.gather(1, torch.tensor(tokens, device=raw.device)[:, None]).squeeze(1).tolist()
    if not n:
        return [(c, []) for c in chosen]
    top_lp, top_ids = rows.topk(n, dim=-1)
    return [(c, list(zip(i, lp))) for c, i, lp in zip(chosen, top_ids.tolist(), top_lp.tolist())]
