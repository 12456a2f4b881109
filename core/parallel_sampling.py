"""``n > 1`` in one place: one request fans out into n sequences, their outputs merge back.

The engine computes the prompt once and forks the other sequences from it (they share
its KV blocks). A seeded request gives sequence i the seed ``seed + i`` (as vLLM does), so
the n samples differ but are reproducible. The engine emits one output per request and
step, holding the choices that advanced in that step (index 0..n-1); :class:`Finals`
gathers the last state of every choice for a caller that wants only the end.
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


class Parents:
    """Which sequences make up which request; merges the sequences' outputs per request."""

    def __init__(self) -> None:
        self._of: dict[str, tuple[str, int]] = {}  # sequence id -> (request id, choice index)
        self._children: dict[str, list[str]] = {}  # request id -> its sequence ids
        self._open: dict[str, set[str]] = {}  # request id -> sequences not finished yet

    def add(self, parent_id: str, n: int) -> list[str]:
        ids = [child_id(parent_id, i, n) for i in range(n)]
        for i, cid in enumerate(ids):
            self._of[cid] = (parent_id, i)
        self._children[parent_id] = ids
        self._open[parent_id] = set(ids)
        return ids

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._children or request_id in self._of

    def sequences(self, request_ids: list[str]) -> list[str]:
        """Sequence ids of ``request_ids`` (a request id stands for all its sequences)."""
        out: list[str] = []
        for rid in request_ids:
            out += self._children.get(rid, [rid])
        return list(dict.fromkeys(out))

    def merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Sequence outputs of one step -> one output per request, its advanced choices by
        index; ``finished`` once every choice has finished. A sequence with two outputs in
        one step (a token, then a plugin failure) gives one choice with both deltas."""
        groups: dict[str, dict[str, RequestOutput]] = {}
        merged: list[RequestOutput] = []
        singles: dict[str, int] = {}  # n == 1 requests: position in ``merged``
        for out in outputs:
            parent, index = self._of[out.request_id]
            if parent == out.request_id:  # n == 1: the sequence is the request, passed through
                if parent in singles:
                    _fold(merged[singles[parent]], out)
                    merged[singles[parent]] = out
                else:
                    singles[parent] = len(merged)
                    merged.append(out)
                if out.finished:
                    self._forget(parent)
                continue
            out.outputs[0].index = index
            seqs = groups.setdefault(parent, {})
            if out.request_id in seqs:
                _fold(seqs[out.request_id], out)
            seqs[out.request_id] = out
            if out.finished:
                self._open[parent].discard(out.request_id)
        for parent, seqs in groups.items():
            outs = sorted(seqs.values(), key=lambda o: o.outputs[0].index)
            first = outs[0]
            finished = not self._open[parent]
            merged.append(RequestOutput(
                request_id=parent,
                prompt=None,
                prompt_token_ids=first.prompt_token_ids,
                outputs=[o.outputs[0] for o in outs],
                finished=finished,
                error=next((o.error for o in outs if o.error), None),
                prompt_logprobs=first.prompt_logprobs,
                num_cached_tokens=first.num_cached_tokens,
            ))
            if finished:
                self._forget(parent)
        return merged

    def _forget(self, parent: str) -> None:
        for cid in self._children.pop(parent):
            del self._of[cid]
        del self._open[parent]


def _fold(earlier: RequestOutput, later: RequestOutput) -> None:
    """``later`` takes ``earlier``'s deltas in front of its own (one sequence, two outputs in a step)."""
    a, b = earlier.outputs[0], later.outputs[0]
    b.text_delta, b.token_ids_delta = a.text_delta + b.text_delta, a.token_ids_delta + b.token_ids_delta


class Finals:
    """The final output of each request, every choice at its last state (non-streamed results)."""

    def __init__(self) -> None:
        self._latest: dict[str, RequestOutput] = {}
        self._choices: dict[str, dict[int, object]] = {}

    def add(self, out: RequestOutput) -> None:
        """Every choice appears finished exactly once, in its last state: keep only those."""
        if out.finished:
            self._latest[out.request_id] = out
        for c in out.outputs:
            if c.finish_reason is not None:
                self._choices.setdefault(out.request_id, {})[c.index] = c

    def get(self, request_id: str) -> RequestOutput:
        final = self._latest[request_id]
        chosen = self._choices[request_id]
        final.outputs = [chosen[i] for i in sorted(chosen)]
        return final
