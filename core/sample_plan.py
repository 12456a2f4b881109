"""Which logits rows a step needs, and what each row is for.

A request that catches up with its known tokens in this step samples from its last
row; with ``d`` draft tokens scheduled it needs its last ``d + 1`` rows (one per draft
to verify, one for the bonus token). A forked sibling of an ``n > 1`` request samples
its first token from its leader's last prompt row. Requests asking for prompt logprobs
add one row per prompt position computed in this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modserve.core.contract import SchedulerOutput
from modserve.core.request import Request


@dataclass
class SampleEntry:
    request: Request
    rows: list[int]  # flat rows in the step's logits, one per token to choose
    drafts: list[int]  # draft tokens to verify (len(rows) - 1 of them)
    fork_of: Request | None = None  # set on an n > 1 sibling forking from this leader now


@dataclass
class SamplePlan:
    entries: list[SampleEntry] = field(default_factory=list)
    prompt_rows: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, position, row)

    @property
    def rows(self) -> list[int]:
        return [r for e in self.entries for r in e.rows] + [r for _, _, r in self.prompt_rows]

    @property
    def num_sample_rows(self) -> int:
        return sum(len(e.rows) for e in self.entries)

    def sample_offsets(self) -> dict[int, int]:
        """``id(entry)`` -> the entry's first row in the sampled part of the logits."""
        offsets, pos = {}, 0
        for e in self.entries:
            offsets[id(e)] = pos
            pos += len(e.rows)
        return offsets

    @property
    def has_drafts(self) -> bool:
        return any(e.drafts for e in self.entries)

    @classmethod
    def build(cls, sched: SchedulerOutput, forks: dict[str, list[Request]]) -> SamplePlan:
        plan = cls()
        start = 0
        for s in sched.scheduled:
            req = s.request
            end = start + s.num_tokens
            computed_after = req.num_computed_tokens + s.num_tokens
            if computed_after >= req.num_tokens:
                num_drafts = computed_after - req.num_tokens
                rows = list(range(end - 1 - num_drafts, end))
                plan.entries.append(SampleEntry(req, rows, req.spec_token_ids[:num_drafts]))
                for sibling in forks.get(req.request_id, ()):
                    plan.entries.append(SampleEntry(sibling, [end - 1], [], fork_of=req))
            if req.sampling_params.prompt_logprobs is not None:
                first = req.num_computed_tokens
                for p in range(first, min(computed_after, req.num_prompt_tokens - 1)):
                    plan.prompt_rows.append((req, p, start + p - first))
            start = end
        return plan
