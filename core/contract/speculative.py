"""Speculative proposers: draft tokens that the target model verifies."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import msgspec

from modserve.core.contract.plugin import Plugin

if TYPE_CHECKING:
    from modserve.core.contract.attention import AttentionBackend
    from modserve.core.contract.model_spec import ModelSpec
    from modserve.core.request import Request


class SpeculativeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Options every proposer's ``Config`` extends: how many drafts, and when the engine pauses
    speculation because it does not pay (large batches, low acceptance)."""

    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4  # drafts per request per step
    disable_above_batch_size: Annotated[int, msgspec.Meta(ge=1)] | None = None  # no drafts with more running requests
    min_acceptance_rate: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0  # pause when the moving acceptance falls below
    backoff_steps: Annotated[int, msgspec.Meta(ge=1)] = 16  # length of such a pause, in steps


@dataclass
class TargetModel:
    """The loaded target, for proposers (``ctx.target``): a layer-truncated draft shares its
    weights; a separate draft checkpoint loads through ``load`` with the target's settings."""

    module: object  # the target CausalLM
    tokenizer: object  # modserve.core.tokenizer.TokenizerBundle
    load: Callable[[str], object]  # a draft checkpoint's path -> LoadedModel, built like the target
    make_attention: Callable[[ModelSpec], AttentionBackend]


class Proposer(Plugin):
    """Proposes draft tokens for running requests; the target model verifies them.

    Drafts are treated as deterministic proposals: verification accepts draft ``d`` with
    probability ``p_target(d)``, which keeps the output distribution exactly the
    target's whatever the proposer does. ``Config`` extends :class:`SpeculativeConfig`.
    Built last but for observers, with ``ctx.target`` set.
    """

    @abstractmethod
    def propose(self, requests: list[Request], k: int) -> list[list[int]]:
        """Up to ``k`` draft tokens per request (an empty list means none)."""

    def release(self, request: Request) -> None:  # noqa: B027 - optional
        """The request left the engine: drop any state kept for it."""
