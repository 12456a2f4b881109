"""int4 packing in the native kernels' layout on every CPU, and torch's product reading its copy."""

import pytest
import torch

from modserve.plugins.platforms.cpu_int4_packing import for_torch, pack_int4, unpack_int4


def test_pack_int4_puts_output_j_and_j_plus_32_in_one_byte_of_each_block():
    """Byte j of input k in block b holds output 64 b + j (low nibble) and 64 b + j + 32 (high):
    the layout native/int4_panels.h reads, written out by hand for two blocks."""
    n, k = 128, 4
    q = (torch.arange(n)[:, None] * 3 + torch.arange(k)[None, :] * 5).remainder(16).to(torch.int32)
    flat = pack_int4(q).view(-1)
    for b in range(2):
        for kk in range(k):
            for j in range(32):
                byte = int(flat[b * 64 * (k // 2) + kk * 32 + j])
                assert byte & 0xF == int(q[64 * b + j, kk]) and byte >> 4 == int(q[64 * b + j + 32, kk])
    assert torch.equal(unpack_int4(pack_int4(q)), q)


@pytest.mark.parametrize("n", [64, 192, 48])
def test_torchs_product_on_its_copy_equals_the_dequantized_weights(n):
    """Whatever layout torch packs in on this CPU (blocks of 64 on AVX-512, 32 on AVX2), its int4
    product on ``for_torch``'s copy multiplies the same weights; N = 48 keeps torch's own packing."""
    torch.manual_seed(n)
    k, group = 128, 32
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale, zero = torch.rand(k // group, n) + 0.5, torch.randn(k // group, n)
    x = torch.randn(3, k)
    w = (q.float() - 8) * scale.repeat_interleave(group, 0).t() + zero.repeat_interleave(group, 0).t()
    got = torch._weight_int4pack_mm_for_cpu(x, for_torch(pack_int4(q)), group, torch.stack([scale, zero], -1).contiguous())
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-4)

