"""What the engine hands back: vLLM-shaped ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    token_id: int
    logprob: float
    token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence. In a streamed output ``text``/``token_ids`` hold the whole
    sequence so far and ``text_delta``/``token_ids_delta`` what this step added."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: chosen + top-N
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
