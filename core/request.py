"""A request's state inside the engine: the token counts the one scheduling rule chases."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from modserve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.monotonic``) that metrics and tracing read."""

    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    ``num_computed_tokens`` chases ``num_tokens`` (prompt + output + draft tokens): a new
    prompt, a chunk of it, a decode step and speculative drafts are all just tokens whose
    KV is not computed yet. Preemption by recompute resets ``num_computed_tokens`` to 0.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    cache_salt: str | None = None
    user: str | None = None
    kv_variant: str = ""  # what besides the tokens sets this sequence's K/V ("long-rope": LongRoPE's long factors)
    parent_id: str = ""  # the request this sequence belongs to (``n > 1``); its own id when n == 1
    processor_fields: tuple[str, ...] = ()  # the logits-processor fields its params set (computed once)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hits at first admission; -1 = not looked up yet
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # per-token logprob records: (chosen_logprob, [(token_id, logprob), ...])
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # prompt_logprobs[p] scores prompt token p + 1 (same record shape as ``logprobs``)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        self.parent_id = self.parent_id or self.request_id
        self.processor_fields = self.sampling_params.processor_fields()

    @property
    def cache_namespace(self) -> bytes:
        """What keys the prefix cache besides the tokens: the client's ``cache_salt`` and the
        ``kv_variant``. Blocks are shared only between sequences with equal namespaces."""
        return f"{self.cache_salt or ''}\x00{self.kv_variant}".encode() if self.kv_variant else (self.cache_salt or "").encode()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
