"""Rotary position embeddings (HF's rotate-half layout) with llama3, linear and LongRoPE scaling.

The cos/sin table is computed once; each step gathers rows for its positions once and
every layer reuses them.

LongRoPE (Phi-3): positions below ``original_max_position_embeddings`` rotate with the
short factors, later ones with the long factors, and cos/sin carry the attention factor.
HF switches a whole sequence to the long factors once it grows past the original length
(and keeps the K already cached); a per-position table keeps every request's rotation
independent of its batch and of when it was computed.
"""

from __future__ import annotations

import math

import torch


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


class RotaryTable:
    """Precomputed ``cos``/``sin`` ``[max_positions, head_dim]`` in float32."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, device) -> None:
        positions = torch.arange(max_positions, dtype=torch.int64).float()[:, None]
        if scaling is not None and scaling["rope_type"] == "longrope":
            emb, gain = _longrope(head_dim, positions, theta, scaling)
        else:
            freqs = positions * inv_frequencies(head_dim, theta, scaling)[None, :]
            emb, gain = torch.cat((freqs, freqs), dim=-1), 1.0
        self.cos = (emb.cos() * gain).to(device)
        self.sin = (emb.sin() * gain).to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for this step's positions, shaped to broadcast over heads: ``[T, 1, D]``."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def _longrope(head_dim: int, positions: torch.Tensor, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    original, factor = int(scaling["original_max_position_embeddings"]), float(scaling["factor"])
    gain = scaling.get("attention_factor")
    if gain is None:
        gain = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * base)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * base)
    freqs = positions * torch.where(positions < original, short[None, :], long[None, :])
    return torch.cat((freqs, freqs), dim=-1), float(gain)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
