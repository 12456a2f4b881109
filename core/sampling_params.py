"""Per-request sampling options, named and defaulted like vLLM's so users feel at home."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs``: the output must match exactly one of these."""

    json: dict[str, Any] | str | None = None  # a JSON schema (an object, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None  # one of these strings
    grammar: str | None = None  # a Lark grammar, or GBNF (llama.cpp's EBNF, written with ``::=``)
    json_object: bool = False  # any JSON object (``response_format: {"type": "json_object"}``)

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: give exactly one of json, regex, choice, grammar, json_object; got {', '.join(given) or 'none'}"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice: must list at least one string")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, n) not in (None, False))


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick each next token and when to stop.

    Validation happens on construction; every error names the field and the bad value.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (0: only the chosen one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculative: bool = True  # a request may opt out of speculative decoding
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit (OpenAI: -100..100); a logits processor applies it
    structured_outputs: StructuredOutputs | None = None  # JSON schema, regex, choice or grammar the output must match
    bad_words: list[str] | None = None  # words never generated (vLLM's): a word's last token is banned after its other tokens
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated
    extra_args: dict[str, Any] | None = None  # options for third-party logits processors, one key each (vLLM's extra_args)

    # Fields implemented by logits processor plugins (``LogitsProcessor.request_field``), and
    # each ``extra_args`` key as ``extra_args.<key>``: a request setting one that no enabled
    # processor claims is refused, never ignored.
    PROCESSOR_FIELDS: ClassVar[tuple[str, ...]] = ("logit_bias", "structured_outputs", "bad_words", "allowed_token_ids")

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = self.logit_bias or None  # {} asks for nothing
        self.bad_words = [w for w in self.bad_words or [] if w] or None
        self.extra_args = self.extra_args or None
        if self.top_k == -1:
            self.top_k = 0
        _check(self.n >= 1, "n", "must be >= 1", self.n)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1", self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0", self.min_tokens)
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be <= max_tokens ({self.max_tokens})",
            self.min_tokens,
        )
        _check(0.0 <= self.temperature <= 2.0, "temperature", "must be in [0, 2]", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "top_k", "must be -1, 0 (disabled) or >= 1", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]", self.repetition_penalty)
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", "must be >= 0", self.logprobs)
        _check(
            self.prompt_logprobs is None or self.prompt_logprobs >= 0,
            "prompt_logprobs",
            "must be >= 0",
            self.prompt_logprobs,
        )
        _check(
            self.seed is None or -(2**63) <= self.seed <= 2**63 - self.n,  # child i uses seed + i
            "seed",
            "must fit in a signed 64-bit integer (seed + n - 1 included)",
            self.seed,
        )
        _check(all(s for s in self.stop), "stop", "must not contain empty strings", self.stop)
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0", self.stop_token_ids)

    def processor_fields(self) -> tuple[str, ...]:
        """The logits-processor fields this request sets (``extra_args.<key>`` for each extra arg)."""
        fields = tuple(f for f in self.PROCESSOR_FIELDS if getattr(self, f) is not None)
        return fields + tuple(f"extra_args.{key}" for key in self.extra_args or ())

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def with_changes(self, **changes) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _check(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field}: {rule}, got {value!r}")
