"""row_argmax gives torch.argmax's indices: ties, NaN, infinities, signed zeros, every
length around the vector width, both builds (AVX-512 and portable)."""

from __future__ import annotations

import pytest
import torch

from modserve.core.row_argmax import load, row_argmax

BUILDS = {"native": (), "portable": ("-mno-avx512f",)}


def cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(rows, n, generator=g) for rows, n in [(1, 1), (3, 15), (2, 16), (5, 31), (4, 32), (7, 33),
                                                            (64, 49152), (9, 1000)]]  # fmt: skip
    x = torch.randn(6, 100, generator=g)
    x[0] = 1.0  # all equal: the first index
    x[1, [7, 40, 99]] = 50.0  # a repeated maximum, in a vector lane and in the tail
    x[2, 70] = float("nan")  # NaN wins ...
    x[3, [20, 90]] = float("nan")  # ... the first one
    x[3, 5] = float("inf")
    x[4] = float("-inf")
    x[5] = 0.0
    x[5, 3], x[5, 50] = -0.0, 0.0  # signed zeros compare equal
    out.append(x)
    y = torch.randn(4, 77, generator=g)
    y[0, 76] = float("nan")  # in the scalar tail after a vector sweep
    y[1, 0] = float("nan")  # the very first
    y[2, 76] = 100.0
    y[3, 64] = float("inf")
    out.append(y)
    return out


@pytest.mark.parametrize("build", list(BUILDS))
def test_matches_torch_argmax(build):
    lib = load(BUILDS[build])
    assert lib is not None
    for x in cases():
        assert torch.equal(row_argmax(x, lib), x.argmax(dim=-1)), x.shape


def test_what_it_does_not_take_goes_to_torch():
    x = torch.randn(4, 40)
    for t in (x.t().contiguous().t(), x.double(), x.bfloat16(), x[0], torch.empty(0, 40)):
        assert torch.equal(row_argmax(t), t.argmax(dim=-1))
