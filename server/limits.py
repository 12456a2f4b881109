"""The request limits the server enforces, read once from the pipeline's ``server`` section.

Every limit answers a client that passes it with a 400 (or 413 for the body size) whose
message names the field, the limit and the config key. ``max_prompt_tokens`` and
``max_output_tokens`` are read with defaults, so a pipeline schema without them still
works (they then fall back to the ``max_model_len`` rule alone).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class Limits:
    max_body_bytes: int = 4 * 1024 * 1024  # 413 above
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_len: int = 256  # characters
    max_top_logprobs: int = 20
    max_messages: int = 512
    max_prompt_tokens: int | None = None  # None: only prompt + max_tokens <= max_model_len
    max_output_tokens: int | None = None  # largest max_tokens; None: only the max_model_len rule
    request_timeout_s: float | None = None  # wall time from admission to the last byte (504 after)

    @classmethod
    def from_config(cls, server: Any) -> Limits:
        return cls(**{f.name: getattr(server, f.name, f.default) for f in fields(cls)})
