"""Rotary position embeddings (HF's rotate-half layout) with llama3, linear and LongRoPE scaling.

The cos/sin table is computed once; each step gathers rows for its positions once and
every layer reuses them.

LongRoPE (Phi-3): cos/sin carry the attention factor, and every token of a sequence longer
than ``original_max_position_embeddings`` rotates with the long factors, a shorter one's
with the short factors (:func:`long_factors_from`), as in HF: its ``longrope_frequency_update``
picks the factors by the sequence length, and Phi-3's ``prepare_inputs_for_generation``
drops the cache to recompute everything when generation crosses the original length. The
engine does the same (``Engine._update``); the prefix cache keeps the two rotations apart
(``Request.kv_variant``). A token's choice never depends on its batch or prefill chunk.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from modserve.core.contract.attention import AttentionMetadata


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "longrope":
        raise ValueError("longrope needs two tables: use RotaryTable")
    if kind == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, blend in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def long_factors_from(scaling: dict | None) -> int | None:
    """The sequence length past which LongRoPE rotates with its long factors; None without LongRoPE."""
    if scaling is None or scaling["rope_type"] != "longrope":
        return None
    return int(scaling["original_max_position_embeddings"])



class RotaryTable:
    """Precomputed ``cos``/``sin`` rows in float32: ``[max_positions, head_dim]``, and for
    LongRoPE the long factors' rows followed by the short factors' rows for the positions
    below the original length (the only ones that use them)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, device) -> None:
        positions = torch.arange(max_positions, dtype=torch.int64).float()[:, None]
        self.max_positions = max_positions
        self.original: int | None = None  # LongRoPE's original length
        if scaling is not None and scaling["rope_type"] == "longrope":
            self.original = long_factors_from(scaling)
            emb, gain = _longrope(head_dim, positions, min(self.original, max_positions), theta, scaling)
        else:
            freqs = positions * inv_frequencies(head_dim, theta, scaling)[None, :]
            emb, gain = torch.cat((freqs, freqs), dim=-1), 1.0
        self.cos = (emb.cos() * gain).to(device)
        self.sin = (emb.sin() * gain).to(device)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata | None = None, gather=None,
        longrope_rows=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for this step's positions, shaped to broadcast over heads: ``[T, 1, D]``.
        LongRoPE picks each token's factors by its request's length in ``meta`` (without
        one, by its position alone); a position past the original length always takes the
        long factors. ``gather(table, rows, dtype)``: a kernel for ``table[rows].to(dtype)``;
        ``longrope_rows(positions, meta, original, max_positions)``: one for the LongRoPE rows."""
        if self.original is None:
            rows = positions
        elif longrope_rows is not None:
            rows = longrope_rows(positions, meta, self.original, self.max_positions)
        else:
            rows = self._longrope_rows(positions, meta)
        if gather is not None:
            return gather(self.cos, rows, dtype).unsqueeze(1), gather(self.sin, rows, dtype).unsqueeze(1)
        return self.cos[rows].to(dtype).unsqueeze(1), self.sin[rows].to(dtype).unsqueeze(1)

    def _longrope_rows(self, positions: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        length = positions + 1  # drafts past a short request's length: never kept (Engine._update)
        if meta is not None and meta.request_lens is not None:
            query_lens = meta.query_start_loc.diff()
            lens = torch.repeat_interleave(meta.request_lens.to(positions.dtype), query_lens, output_size=positions.shape[0])
            length = torch.maximum(length, lens)
        return torch.where(length > self.original, positions, positions + self.max_positions)


def _longrope(
    head_dim: int, positions: torch.Tensor, original: int, theta: float, scaling: dict
) -> tuple[torch.Tensor, float]:
    factor = float(scaling["factor"])
    gain = scaling.get("attention_factor")
    if gain is None:
        gain = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(int(scaling["original_max_position_embeddings"])))
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * base)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * base)
    freqs = torch.cat((positions * long[None, :], positions[:original] * short[None, :]))
    return torch.cat((freqs, freqs), dim=-1), float(gain)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
