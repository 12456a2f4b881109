"""Q4_K, Q5_K and Q6_K blocks written from float weights, for tests: gguf's Python package reads
every K-quant but writes none. A plain round-to-nearest encoder (llama.cpp searches its scales
more carefully); what matters here is that the blocks are valid and hold the weights closely
(tests/test_gguf_kept_quantized.py checks both against gguf's own dequantization)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

QK_K = 256


def _f16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``v`` as float16 (its bytes, and its values back in float32)."""
    h = v.astype(np.float16)
    return h[..., None].view(np.uint8), h.astype(np.float32)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b > 0)


def encode_k(w: np.ndarray, kind: T) -> np.ndarray:
    """``w [N, K]`` (K a multiple of 256) as Q4_K, Q5_K or Q6_K blocks, ``[N, K / 256 * bytes]`` uint8."""
    n, k = w.shape
    nb = k // QK_K
    if kind == T.Q6_K:
        x = w.reshape(n, nb, 16, 16).astype(np.float32)
        d_bytes, d = _f16(np.abs(x).max(-1).max(-1) / 31 / 127)
        sc = np.rint(_safe_div(np.abs(x).max(-1) / 31, d[..., None])).clip(0, 127)
        q = (np.rint(_safe_div(x, (d[..., None] * sc)[..., None])) + 32).clip(0, 63).astype(np.uint8).reshape(n, nb, 2, 128)
        ql = (q[..., :64] & 0x0F) | ((q[..., 64:] & 0x0F) << 4)  # [.., half, 64]
        hi = (q >> 4).reshape(n, nb, 2, 4, 32)  # [.., half, i, l]: weight 32 i + l
        qh = sum(hi[..., i, :] << (2 * i) for i in range(4)).astype(np.uint8)
        return np.concatenate([ql.reshape(n, nb, 128), qh.reshape(n, nb, 64), sc.astype(np.int8).view(np.uint8), d_bytes], -1).reshape(n, -1)
    bits = 5 if kind == T.Q5_K else 4
    x = w.reshape(n, nb, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0)
    scale, mins = (x.max(-1) - lo) / (2**bits - 1), -lo
    d_bytes, d = _f16(scale.max(-1) / 63)
    m_bytes, dmin = _f16(mins.max(-1) / 63)
    sc = np.rint(_safe_div(scale, d[..., None])).clip(0, 63).astype(np.uint8)
    mn = np.rint(_safe_div(mins, dmin[..., None])).clip(0, 63).astype(np.uint8)
    step, offset = d[..., None] * sc, dmin[..., None] * mn
    q = np.rint(_safe_div(x + offset[..., None], step[..., None])).clip(0, 2**bits - 1).astype(np.uint8)  # [.., 8, 32]
    scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)], -1)
    qs = ((q[..., 0::2, :] & 0x0F) | ((q[..., 1::2, :] & 0x0F) << 4)).reshape(n, nb, 128)
    parts = [d_bytes, m_bytes, scales]
    if bits == 5:
        parts.append(sum((q[..., i, :] >> 4) << i for i in range(8)).astype(np.uint8))  # byte l, bit i: weight 32 i + l
    return np.concatenate([*parts, qs], -1).reshape(n, -1)
