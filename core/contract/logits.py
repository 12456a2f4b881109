"""Logits processors: per-request constraints and biases, applied to the step's logits rows
before the sampler sees them (``logit_bias`` ships; structured outputs and bad words use
the same kind).

Each processor claims one :class:`~modserve.core.sampling_params.SamplingParams` field
(``request_field``), or one key of its ``extra_args`` (``"extra_args.<key>"``, how a
third-party processor takes per-request options). A request that sets a field or key no
enabled processor claims is refused at admission with an error naming it: no parameter is
ever silently ignored. Two enabled processors claiming one field is a start-up error.

Speculative decoding: every sampled row is processed, draft-verification rows included.
Row ``j`` of a request comes with the ``j`` draft tokens that precede it, so a stateful
constraint (a grammar) advances over them; verification then accepts a draft only with
its probability under the processed logits, so a draft the constraint forbids is always
rejected.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from modserve.core.contract.plugin import Plugin

if TYPE_CHECKING:
    import torch

    from modserve.core.request import Request
    from modserve.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitsRow:
    """One sampled row: its request and the draft tokens placed before it in this step."""

    request: Request
    drafts_before: tuple[int, ...] = ()


class LogitsProcessor(Plugin):
    """Built once per engine (``ctx.model`` gives ``vocab_size``); called once per step."""

    request_field: ClassVar[str]  # the SamplingParams field it implements, or "extra_args.<key>"

    def check(self, params: SamplingParams) -> None:  # noqa: B027 - optional
        """Validate the request's field at admission (e.g. token ids inside the vocabulary);
        raise ``ValueError`` starting with the field name (the server answers 400 with it)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: list[LogitsRow], which: list[int]) -> None:
        """Change ``logits[which[i]]`` in place for ``rows[i]``: only the rows whose request sets
        ``request_field`` are passed. Batched tensor work, no loop over vocabulary-sized rows."""

    def release(self, request: Request) -> None:  # noqa: B027 - optional
        """The request left the engine: drop any state kept for it."""
