"""Request sets for ``modserve bench serve``: synthetic (random, prefix_repetition) and files (JSONL, ShareGPT).

Synthetic prompts are lists of token ids, sent as-is to ``/v1/completions`` (modserve, vLLM
and llama.cpp's server accept token-id prompts), so their length in tokens is exact and no
tokenizer is needed on the client. Ids are drawn uniformly from an allowed range that keeps
clear of special tokens: from ``--tokenizer`` when given (every id but the special added
tokens), else ``--random-token-range`` (default ``1000:32000``, inside the ordinary vocabulary
of every model with a 32k+ vocabulary).

Everything here is deterministic given the seed, so two runs (two servers) get the same
requests.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

DEFAULT_TOKEN_RANGE = (1000, 32000)


@dataclass
class SampleRequest:
    """One request: a text or token-id prompt, its length in tokens if known, and ``max_tokens``."""

    prompt: str | list[int]
    prompt_len: int | None
    output_len: int


# --------------------------------------------------------------------- token ids


class TokenSpace:
    """The token ids a synthetic prompt may use (a sorted array without special ids)."""

    def __init__(self, allowed: np.ndarray) -> None:
        if len(allowed) == 0:
            raise ValueError("no token ids left to draw random prompts from")
        self.allowed = np.asarray(allowed, dtype=np.int64)

    @classmethod
    def from_range(cls, lo: int, hi: int) -> TokenSpace:
        if not 0 <= lo < hi:
            raise ValueError(f"--random-token-range: expected 0 <= LO < HI, got {lo}:{hi}")
        return cls(np.arange(lo, hi))

    @classmethod
    def from_tokenizer(cls, tokenizer) -> TokenSpace:
        """Every id of a ``tokenizers.Tokenizer`` except its special added tokens."""
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        return cls(np.array([i for i in range(vocab) if i not in special]))

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return self.allowed[rng.integers(0, len(self.allowed), size=n)].tolist()


def parse_token_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--random-token-range: expected LO:HI (e.g. 1000:32000), got {text!r}") from None
    TokenSpace.from_range(lo, hi)  # validates
    return lo, hi


def load_tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file or a directory holding one."""
    from tokenizers import Tokenizer

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"--tokenizer: no tokenizer.json at {path}")
    return Tokenizer.from_file(file)


# --------------------------------------------------------------------- synthetic


def check_at_least_one(args, names: tuple[str, ...]) -> None:
    """Each of ``args``' attributes ``names`` (counts, lengths) is >= 1; the error names the flag."""
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")


def check_range_ratio(range_ratio: float, flag: str) -> None:
    """A length spread is a fraction in [0, 1); the error names the caller's ``flag``."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"{flag}: must be in [0, 1), got {range_ratio}")


def length_bounds(mean: int, range_ratio: float, minimum: int = 1) -> tuple[int, int]:
    """``[floor(mean * (1 - r)), ceil(mean * (1 + r))]``, as vLLM's random dataset (low at least ``minimum``)."""
    check_range_ratio(range_ratio, "--random-range-ratio")
    lo = max(minimum, math.floor(mean * (1 - range_ratio)))
    hi = max(lo, math.ceil(mean * (1 + range_ratio)))
    return lo, hi


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    tokens: TokenSpace,
    seed: int = 0,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """``num`` prompts of ``prefix_len`` shared + U[in_lo, in_hi] random ids; ``max_tokens`` U[out_lo, out_hi]."""
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    rng = np.random.default_rng(seed)
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)
    input_lens = rng.integers(in_lo, in_hi + 1, size=num)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num)
    prefix = tokens.sample(rng, prefix_len) if prefix_len > 0 else []
    out = []
    for i in range(num):
        prompt = prefix + tokens.sample(rng, int(input_lens[i]))
        out.append(SampleRequest(prompt, len(prompt), int(output_lens[i])))
    return out


def prefix_repetition_requests(
    num: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    tokens: TokenSpace,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_prefixes`` random prefixes, each shared by ``num // num_prefixes`` prompts with their own suffix.

    As vLLM's ``prefix_repetition`` dataset: the prompts are shuffled, so requests that share a
    prefix arrive interleaved with others; ``num`` is rounded down to a multiple of ``num_prefixes``."""
    if num_prefixes < 1:
        raise ValueError("--prefix-repetition-num-prefixes must be >= 1")
    per_prefix = num // num_prefixes
    if per_prefix == 0:
        raise ValueError(f"--num-prompts ({num}) must be >= --prefix-repetition-num-prefixes ({num_prefixes})")
    if prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1 or output_len < 1:
        raise ValueError("prefix_repetition: need prefix + suffix length >= 1 and output length >= 1")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_prefixes):
        prefix = tokens.sample(rng, prefix_len)
        for _ in range(per_prefix):
            prompt = prefix + tokens.sample(rng, suffix_len)
            out.append(SampleRequest(prompt, len(prompt), output_len))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


# --------------------------------------------------------------------- files


def jsonl_requests(path: str, num: int, default_output_len: int) -> list[SampleRequest]:
    """The first ``num`` lines of a JSONL file, cycled if the file has fewer.

    A line is a JSON string (the prompt) or an object with ``prompt`` (text, or a list of
    token ids) and optionally ``output_len`` / ``max_tokens``."""
    rows: list[SampleRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if isinstance(obj, str):
                obj = {"prompt": obj}
            prompt = obj.get("prompt") if isinstance(obj, dict) else None
            ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
            if not (isinstance(prompt, str) and prompt) and not ids:
                raise ValueError(f"{path}:{lineno}: expected a prompt string or list of token ids")
            output_len = obj.get("output_len", obj.get("max_tokens", default_output_len))
            if not isinstance(output_len, int) or output_len < 1:
                raise ValueError(f"{path}:{lineno}: output_len must be an integer >= 1")
            rows.append(SampleRequest(prompt, len(prompt) if ids else None, output_len))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return [rows[i % len(rows)] for i in range(num)]


def sharegpt_pairs(path: str, seed: int = 0) -> list[tuple[str, str]]:
    """(first human turn, first reply) of every conversation with two turns or more, shuffled by ``seed``."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a ShareGPT JSON list of conversations")
    pairs = []
    for entry in data:
        conv = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        first, second = conv[0], conv[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        prompt, reply = first.get("value"), second.get("value")
        if isinstance(prompt, str) and isinstance(reply, str) and prompt:
            pairs.append((prompt, reply))
    if not pairs:
        raise ValueError(f"{path}: no conversation with two turns")
    order = np.random.default_rng(seed).permutation(len(pairs))
    return [pairs[i] for i in order]


def sharegpt_accept(
    prompt_len: int, reply_len: int, output_len_override: int | None, max_prompt: int = 1024, max_total: int = 2048
) -> int | None:
    """``max_tokens`` for a ShareGPT pair, or None when vLLM's filter drops it.

    vLLM drops prompts or replies under 4 tokens, prompts over 1024 and prompt + reply over 2048."""
    output_len = output_len_override or reply_len
    if prompt_len < 4 or (output_len_override is None and reply_len < 4):
        return None
    if prompt_len > max_prompt or prompt_len + output_len > max_total:
        return None
    return output_len
