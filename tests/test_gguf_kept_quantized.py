"""``device: {plugin: cpu, quantization: gguf}``: a GGUF file's Q8_0 / Q6_K / Q5_K / Q5_0 / Q5_1 /
Q4_K / Q4_0 / Q4_1 weights kept as they are (docs/quantization.md, "GGUF blocks kept as they are").

Stated bounds, each against the same file loaded with ``quantization: none`` (the file's
blocks dequantized to float at load, the reference):

1. Block decoding: the codes, scales and minima read from the blocks rebuild gguf's own
   dequantized values exactly (float32 equality); centred to int8 codes with a zero per group,
   exactly for the symmetric formats and within 1e-6 of the largest weight for the others (the
   zero ``m + 2^(bits-1) d`` is rounded once). The K-quant blocks come from tests/gguf_k_quants.py
   (gguf writes none), checked against gguf's dequantization too.
2. Each module against ``F.linear`` on the dequantized weight, as a fraction of the output's
   largest magnitude. float32: Q8_0 1e-6 (the same float32 products; measured 0), the others
   1e-5 (the int4 kernel computes ``(q - 8) d + (m + 8 d)`` where gguf computes ``d q + m``; the
   int8 codes ``(q - c) d + (m + c d)``: a rounding of the zero and the order of the float32
   operations; measured <= 4.2e-7). On the float32 panels the int4 layers keep the file's own
   scales and compute ``d q + m``: within float32 summation order of the float64 product. bfloat16: 1.5e-2 for all (Q4: the kernel holds ``d`` and ``m + 8 d`` in bfloat16, 8
   bits each, where the reference rounds each weight to bfloat16; plus the output's own
   bfloat16 rounding; measured <= 4.4e-3).
3. A whole engine, teacher-forced over the dequantized engine's own greedy text (prompt
   logprobs): float32, the top-1 token is the same at every position and the actual token's
   logprob moves by at most 1e-4 nats (the weights are the same values: only rounding differs;
   measured 0 for all four files), and free-running greedy text is identical; bfloat16, the
   top-1 token agrees at >= 90% of positions, the actual token's logprob moves by at most 0.15
   nats, 0.03 on average (measured: agreement 0.969-1.0, largest change 0.033, mean <= 0.0104;
   Q8_0 exactly 0). The bfloat16 engines round different things: the reference its weights,
   the kept int4 model its scales and zeros; a 2-layer random model flips its top-1 where two
   candidates lie within that rounding, so free-running text may part after a flip and is
   only compared in float32.
4. Refusals: every combination that cannot be honoured is a config error naming the field;
   a layer the file stores as floats (F32 / F16 / BF16) stays a float layer.
5. The embedded SmolLM2 (Q4_1 projections, a Q8_0 embedding tied to the head), float32: the
   same greedy text and logprobs within 1e-3 nats, with under half the model tensor bytes.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from gguf import GGMLQuantizationType as T
from torch import nn

from modserve import LLM, SamplingParams
from modserve.core.config import ConfigError
from modserve.core.engine_factory import resolve
from modserve.core.models.gguf_quantized import GGUFTensor, group_codes
from modserve.core.models.kept_weights import KeptLinear
from modserve.plugins.platforms.cpu_panel_linear import PanelLinear
from modserve.plugins.platforms.cpu_linear import PackedLinear
from modserve.plugins.platforms.cpu_int8_panel_linear import group_int8_kernel
from modserve.plugins.platforms.cpu_quant import Int4WeightOnlyLinear, Int8GroupLinear, gguf_linear
from modserve.plugins.platforms.cpu_split_linear import ColumnSplitLinear
from gguf_k_quants import encode_k
from test_gguf_reader import TINY_SHAPE, _finish, _shape_writer, _value_type, gguf_tensor_name, llama_cpp_permute, tiny_metadata
from tiny_models import teacher_forced

KEPT = [T.Q8_0, T.Q6_K, T.Q5_K, T.Q5_1, T.Q5_0, T.Q4_K, T.Q4_1, T.Q4_0]
K_QUANTS = {T.Q4_K, T.Q5_K, T.Q6_K}
ON_INT4 = {T.Q4_0, T.Q4_1, T.Q4_K}  # the rest are int8 codes (Int8GroupLinear)
SYMMETRIC = {T.Q8_0, T.Q6_K, T.Q5_0, T.Q4_0}
DTYPES = [torch.float32, torch.bfloat16]
MODULE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}
Q8_0_F32_TOL = 1e-6
BF16_AGREEMENT, BF16_MAX_NATS, BF16_MEAN_NATS = 0.90, 0.15, 0.03
F32_MAX_NATS = 1e-4
SMOLLM2_MAX_NATS = 1e-3


def quantize(weight: np.ndarray, kind: T) -> np.ndarray:
    """gguf's own quantizer, or tests/gguf_k_quants.py's for the K-quants (gguf has none)."""
    return encode_k(weight, kind) if kind in K_QUANTS else gguf.quants.quantize(weight, kind)


def gguf_tensor(weight: torch.Tensor, kind: T) -> GGUFTensor:
    """``weight`` quantized, as the reader would hand it over."""
    return GGUFTensor(quantize(weight.float().numpy(), kind), kind, tuple(weight.shape))


def gguf_layer(parts: list[GGUFTensor], dtype: torch.dtype, bias: bool = True) -> KeptLinear:
    rows, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
    base = nn.Linear(k, rows, bias=bias, device="meta")
    if bias:
        base.bias = nn.Parameter(torch.randn(rows).to(dtype), requires_grad=False)
    return KeptLinear(base, parts, torch.device("cpu"), dtype)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


# ----------------------------------------------------------------------------- blocks and modules


def test_k_quant_encoder_holds_the_weights():
    """The test encoder's blocks, read by gguf, are the weights within round-to-nearest's error."""
    torch.manual_seed(0)
    w = torch.randn(32, 512) * 0.05 + 0.01
    for kind, bound in ((T.Q4_K, 0.10), (T.Q5_K, 0.05), (T.Q6_K, 0.03)):  # rms error / std; measured 0.078, 0.038, 0.020
        got = gguf_tensor(w, kind).dequantize()
        assert ((got - w).pow(2).mean().sqrt() / w.std()).item() < bound, kind


@pytest.mark.parametrize("kind", KEPT, ids=lambda k: k.name)
def test_block_decoding_rebuilds_gguf_dequantize_exactly(kind):
    torch.manual_seed(0)
    part = gguf_tensor(torch.randn(48, 512) * 0.1 + 0.02, kind)
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(part.data, part.type), np.float32)).view(48, 512)  # gguf-py's
    assert torch.equal(part.dequantize(), want)  # ours, through the codes
    c = group_codes(part)
    groups = 512 // c.group
    assert c.q.dtype == torch.uint8 and c.q.shape == (48, 512) and c.scale.shape == (48, groups)
    assert (c.bits, c.group) == {T.Q8_0: (8, 32), T.Q6_K: (6, 16), T.Q5_K: (5, 32), T.Q5_1: (5, 32), T.Q5_0: (5, 32)}.get(kind, (4, 32))
    assert int(c.q.max()) < 2**c.bits and int(c.q.max()) >= 2 ** (c.bits - 1)
    assert (c.minimum is None) == (kind in SYMMETRIC)
    got = (c.q.float().view(48, groups, c.group) * c.scale[..., None] + c.minimum_or_center()[..., None]).view(48, 512)
    assert torch.equal(got, want)
    codes, scale, zero = c.signed(16)  # centred int8 codes in groups of 16 (a mixed layer's)
    assert codes.dtype == torch.int8 and scale.shape == (48, 32) and (zero is None) == (kind in SYMMETRIC)
    centred = (codes.float().view(48, 32, 16) * scale[..., None] + (0 if zero is None else zero[..., None])).view(48, 512)
    assert torch.equal(centred, want) if zero is None else _rel_err(centred, want) <= 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KEPT, ids=lambda k: k.name)
def test_kept_module_is_within_bound_of_linear_on_dequantized_weights(kind, dtype):
    torch.manual_seed(0)
    part = gguf_tensor(torch.randn(96, 256) * 0.05, kind)
    layer = gguf_layer([part], dtype)
    module = gguf_linear("layers.0.mlp.down_proj", layer)
    assert type(module) is (Int4WeightOnlyLinear if kind in ON_INT4 else Int8GroupLinear)
    assert "weight" not in layer._parameters  # the blocks went straight in: no float weight was made
    assert not any(t.is_floating_point() and t.numel() >= 96 * 256 for t in module.buffers())
    if kind in ON_INT4:
        assert module.group_size == 32
    else:
        assert module.group == (16 if kind == T.Q6_K else 32)
        assert module.below_128 == (kind != T.Q8_0)  # codes as stored: minima as zeros, or the symmetric formats' center
        assert (module.zero is None) == (kind in SYMMETRIC) and module.center == {T.Q6_K: 32, T.Q5_0: 16}.get(kind, 0)
    tol = Q8_0_F32_TOL if (kind, dtype) == (T.Q8_0, torch.float32) else MODULE_TOL[dtype]
    w = part.dequantize().to(dtype)
    for rows in (1, 5, 40):
        x = torch.randn(rows, 256).to(dtype)
        want = F.linear(x.float(), w.float(), layer.bias.float())
        got = module(x)
        assert got.dtype == dtype and got.shape == (rows, 96)
        assert _rel_err(got, want) <= tol, (rows, _rel_err(got, want))
    assert module(torch.empty(0, 256, dtype=dtype)).shape == (0, 96)


def _q4_on_the_panels(kind: T, dtype: torch.dtype, n: int = 128, k: int = 768):
    """A Q4 GGUF layer as the platform puts it on the panel kernels of ``dtype``, with its tensor."""
    torch.manual_seed(3)
    part = gguf_tensor(torch.randn(n, k) * 0.05, kind)
    module = gguf_linear("layers.0.mlp.down_proj", gguf_layer([part], dtype))
    module.use_panels()
    assert module.scales_and_zeros is None and module.records
    two = kind == T.Q4_K
    assert module.file_pairs.shape == (n // 64, k // 32, 2, 64) and module.file_pairs.dtype == (torch.int8 if two else torch.float16)
    assert (module.file_outer is not None and module.file_outer.shape == (n // 64, k // 256, 2, 64)) == two
    held_bits = sum(t.numel() * t.element_size() * 8 for t in (module.file_pairs, module.file_outer) if t is not None) / (n * k)
    assert held_bits == (0.75 if two else 1.0)
    return module, part


@pytest.mark.parametrize("build", [(), ("-mno-avx512f",)], ids=["native", "avx2-width"])
@pytest.mark.parametrize("kind", sorted(ON_INT4, key=lambda k: k.name), ids=lambda k: k.name)
def test_a_float32_q4_layer_on_the_panels_holds_its_files_own_scales(kind, build):
    """float32 on the panels: Q4_0 / Q4_1 keep their float16 (d, m) (1 bit a weight), Q4_K its two
    levels, int8 (sc, mn) per 32 and float32 (d, -dmin) per 256 (0.75 bits), instead of torch's
    float32 (s, m + 8 s) pairs (2 bits); every weight is then exactly d q + m, as gguf
    dequantizes it: the product within float32 summation order of the float64 one, directly (1 to
    24 rows 512 bits wide, blocks of 6 rows and their remainders; 1 and 2 rows at the AVX2 width),
    widened to panels (25 and 37 rows; from 3 at the AVX2 width) and widened to a plain matrix for
    torch's product (130 rows: bit for bit gguf's weights), at both widths."""
    from test_cpu_experts import HAS_AVX2

    from modserve.plugins.platforms.cpu_avx2_linear import int4_product, int4_widened

    if not HAS_AVX2:
        pytest.skip("this CPU has no AVX2 (or no compiler targets it)")
    module, part = _q4_on_the_panels(kind, torch.float32)
    w = part.dequantize().double()
    assert torch.equal(int4_widened(module.packed, module._held, 32, build), w.float())
    for rows in (1, 2, 3, 11, 24, 25, 37, 130):
        x = torch.randn(rows, 768)
        exact = x.double() @ w.T + module.bias.double()
        for got in (module(x), int4_product(x, module.packed, module._held, 32, module._bias32, build)):
            assert (got.double() - exact).abs().max() <= 2e-6 * exact.abs().max(), rows
    with pytest.raises(TypeError, match="Int4WeightOnlyLinear holding a GGUF file's scales takes torch.float32 rows, got torch.bfloat16"):
        module(torch.randn(2, 768).to(torch.bfloat16))


@pytest.mark.parametrize("kind", sorted(ON_INT4, key=lambda k: k.name), ids=lambda k: k.name)
def test_a_bfloat16_q4_layer_on_the_panels_holds_its_files_own_scales(kind):
    """bfloat16 on the panels: the file's own scales as in float32 (not torch's bfloat16 pairs,
    rounded to 8 bits each). Below 8 rows the weights d q + m are never rounded: the exact
    product rounded once to bfloat16; from 8 rows they are widened to bfloat16 once (gguf's own
    dequantized values, rounded): the bfloat16 panel kernel's product on those, bit for bit."""
    from test_cpu_experts import TAKES_KERNEL

    from modserve.plugins.platforms.cpu_avx512_linear import Avx512Linear

    if not TAKES_KERNEL:
        pytest.skip("bfloat16 layers take the panels on AVX512_BF16 CPUs without AMX (AMX CPUs: the tiles), where a compiler targets them")
    module, part = _q4_on_the_panels(kind, torch.bfloat16)
    reference = nn.Linear(768, 128).to(torch.bfloat16)
    with torch.no_grad():
        reference.weight.copy_(part.dequantize().to(torch.bfloat16))
        reference.bias.copy_(module.bias)
    w = part.dequantize().double()
    for rows in (1, 3, 5, 7):
        x = torch.randn(rows, 768).to(torch.bfloat16)
        exact = x.double() @ w.T + module.bias.double()
        got = module(x).double()
        assert ((got - exact).abs() <= exact.abs() * 2**-8 + 2e-6 * exact.abs().max()).all(), rows
    for rows in (8, 37):
        x = torch.randn(rows, 768).to(torch.bfloat16)
        assert torch.equal(module(x), Avx512Linear(reference)(x)), rows


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_parts_keep_their_rows_in_order(dtype):
    """q / k / v in one layer: the parts' rows stack in order, Q4_0 and Q4_1 in one int4 module."""
    torch.manual_seed(1)
    parts = [gguf_tensor(torch.randn(n, 64) * 0.1, kind) for n, kind in ((64, T.Q4_1), (32, T.Q4_0), (32, T.Q4_1))]
    layer = gguf_layer(parts, dtype, bias=False)
    module = gguf_linear("layers.0.self_attn.qkv_proj", layer)
    w = torch.cat([p.dequantize() for p in parts])
    x = torch.randn(7, 64).to(dtype)
    assert _rel_err(module(x), F.linear(x.float(), w.to(dtype).float())) <= MODULE_TOL[dtype]
    q8 = gguf_layer([gguf_tensor(torch.randn(n, 64), T.Q8_0) for n in (16, 48)], dtype, bias=False)
    w8 = torch.cat([p.dequantize() for p in q8.parts])
    assert _rel_err(gguf_linear("x", q8)(x), F.linear(x.float(), w8.to(dtype).float())) <= MODULE_TOL[dtype]


MIXES = {  # q / k / v kinds and widths: the pieces a layer mixing kinds is held as (int4, int8: Q8_0, codes: below 128)
    "Q4_K+Q4_K+Q6_K": ((T.Q4_K, T.Q4_K, T.Q6_K), (64, 64, 32), [("int4", 128), ("codes", 32)]),  # llama.cpp's Q4_K_M
    "Q5_0+Q5_0+Q8_0": ((T.Q5_0, T.Q5_0, T.Q8_0), (64, 32, 32), [("codes", 96), ("int8", 32)]),  # SmolLM2's Q4_K_M
    "Q8_0+Q4_1+Q4_1": ((T.Q8_0, T.Q4_1, T.Q4_1), (64, 32, 32), [("int8", 64), ("int4", 64)]),
    "Q4_K+Q4_K+Q6_K narrow": ((T.Q4_K, T.Q4_K, T.Q6_K), (64, 32, 32), [("codes", 128)]),  # 96 int4 outputs: not for the int4 panels
    "Q5_0+Q5_K+Q4_0": ((T.Q5_0, T.Q5_K, T.Q4_0), (64, 32, 32), [("codes", 128)]),
}


def _piece_kind(module) -> str:
    return "int4" if type(module) is Int4WeightOnlyLinear else "codes" if module.below_128 else "int8"


def _on_panels(module, dtype: torch.dtype) -> None:
    """What the cpu platform does to a kept module where this dtype's float linears are its panel kernels."""
    for piece in module.pieces if isinstance(module, ColumnSplitLinear) else [module]:
        if isinstance(piece, Int4WeightOnlyLinear):
            piece.use_panels()
        else:
            assert piece.use_panels(group_int8_kernel(dtype, below_128=piece.below_128), dtype)


@pytest.mark.parametrize("panels", [False, True], ids=["torch", "panels"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mix", list(MIXES))
def test_a_layer_mixing_kinds_is_held_as_pieces_of_one_kind(mix, dtype, panels):
    """q / k / v of different kinds (llama.cpp's Q4_K_M stores v as Q6_K in some layers): one
    module per run of parts of one kind (ColumnSplitLinear), each part's rows and bias in order;
    an int4 run the int4 panels cannot take (not a multiple of 64 outputs) joins the codes below
    128. On the panel kernels every piece writes its columns of one output (a call list records
    them); through torch the pieces' outputs are concatenated."""
    from test_cpu_experts import HAS_AVX2, TAKES_KERNEL

    if panels and not (TAKES_KERNEL if dtype == torch.bfloat16 else HAS_AVX2):
        pytest.skip("this dtype's panel kernels do not run on this CPU")
    kinds, widths, want_pieces = MIXES[mix]
    torch.manual_seed(2)
    parts = [gguf_tensor(torch.randn(n, 256) * 0.05, kind) for n, kind in zip(widths, kinds)]
    layer = gguf_layer(parts, dtype)
    module = gguf_linear("layers.0.self_attn.qkv_proj", layer)
    pieces = module.pieces if len(want_pieces) > 1 else [module]
    assert (type(module) is ColumnSplitLinear) == (len(want_pieces) > 1)
    assert [(_piece_kind(p), p.out_features) for p in pieces] == want_pieces
    for piece in pieces:
        if _piece_kind(piece) == "codes":  # as stored; Q6_K: groups of 16
            assert piece.group == (16 if T.Q6_K in kinds else 32)
    if panels:
        _on_panels(module, dtype)
    assert module.records == panels
    w = torch.cat([p.dequantize() for p in parts])
    for rows in (1, 6, 30):
        x = torch.randn(rows, 256).to(dtype)
        got = module(x)
        assert got.dtype == dtype and got.shape == (rows, sum(widths))
        assert _rel_err(got, F.linear(x.float(), w.to(dtype).float(), layer.bias.float())) <= MODULE_TOL[dtype], rows


def test_writing_in_place_needs_the_panels_and_an_output_of_the_pieces_shape():
    from test_cpu_experts import HAS_AVX2

    torch.manual_seed(0)
    module = gguf_linear("o", gguf_layer([gguf_tensor(torch.randn(32, 64), T.Q8_0)], torch.float32, bias=False))
    x = torch.randn(2, 64)
    with pytest.raises(TypeError, match="Int8GroupLinear writes in place only on the panel kernels"):
        module.product_into(x, torch.empty(2, 32))
    if not HAS_AVX2:
        return
    _on_panels(module, torch.float32)
    wide = torch.zeros(2, 48)
    module.product_into(x, wide[:, 8:40])  # columns of a wider output: the rest untouched
    assert torch.equal(wide[:, 8:40], module(x)) and not wide[:, :8].any() and not wide[:, 40:].any()
    with pytest.raises(ValueError, match=r"group_product: out must be \[2, 32\] torch.float32 with unit column stride"):
        module.product_into(x, torch.empty(2, 31))


def test_a_lone_layer_mixing_q4_and_6_bit_parts_keeps_the_minima_as_zeros():
    """One module for Q4_K + Q6_K (no int4 run the panels take): the codes as stored (below
    128), every group's minimum its zero (Q6_K's -32 d), in groups of 16."""
    torch.manual_seed(2)
    parts = [gguf_tensor(torch.randn(n, 256) * 0.05, kind) for n, kind in zip((64, 32, 32), (T.Q4_K, T.Q4_K, T.Q6_K))]
    module = gguf_linear("layers.0.self_attn.qkv_proj", gguf_layer(parts, torch.float32, bias=False))
    assert type(module) is Int8GroupLinear and module.below_128 and module.zero is not None and module.center == 0
    assert module.qweight.min() >= 0 and int(module.qweight.max()) < 64
    d = group_codes(parts[2]).per_group(16)[0]
    assert torch.equal(module.zero[96:, :, 0], -32 * d)


def test_unkept_types_and_layers_are_refused_by_name():
    torch.manual_seed(0)
    w = torch.randn(32, 64)
    f16 = GGUFTensor(w.half().numpy(), T.F16, (32, 64))
    layer = gguf_layer([f16], torch.float32)
    assert gguf_linear("layers.1.mlp.up", layer) is layer  # stored as floats: the platform's float path
    q3_k = GGUFTensor(np.zeros((32, 110), np.uint8), T.Q3_K, (32, 256))  # refused before its blocks are read
    with pytest.raises(ConfigError, match=r"device.quantization: gguf keeps Q8_0, Q6_K, Q5_K, Q5_1, Q5_0, Q4_K, Q4_1, Q4_0 "
                                          r"weights; layer 'layers.1.mlp.up' is stored as Q3_K: use none"):
        gguf_linear("layers.1.mlp.up", gguf_layer([q3_k], torch.float32))
    mixed = gguf_layer([gguf_tensor(w, T.Q4_1), f16], torch.float32)
    with pytest.raises(ConfigError, match=r"'qkv' is stored as Q4_1\+F16"):
        gguf_linear("qkv", mixed)
    with pytest.raises(ConfigError, match=r"device.quantization: gguf .*layer 'lm_head' is not a GGUF tensor of its own"):
        gguf_linear("lm_head", nn.Linear(64, 32))


def test_a_q4_layer_torch_cannot_pack_as_int4_is_held_as_int8_codes(caplog):
    """out_features 40: not a multiple of 16, which torch's int4 packing needs; the blocks are
    kept as int8 codes instead (a byte a weight, said in the log), not refused."""
    torch.manual_seed(0)
    part = gguf_tensor(torch.randn(40, 64), T.Q4_1)
    with caplog.at_level("INFO", logger="modserve.platform"):
        module = gguf_linear("o", gguf_layer([part], torch.float32, bias=False))
    assert type(module) is Int8GroupLinear and module.zero is not None
    assert "gguf: o has out_features 40, not a multiple of 16 for torch's int4 packing: its Q4_1 blocks held as int8 codes" in caplog.text
    x = torch.randn(3, 64)
    assert _rel_err(module(x), F.linear(x, part.dequantize())) <= MODULE_TOL[torch.float32]


def test_weight_of_a_gguf_linear_is_dequantized_on_demand():
    """What any other platform (or ``quantization: none``) sees: a plain linear's weight."""
    part = gguf_tensor(torch.randn(32, 64), T.Q4_1)
    layer = gguf_layer([part], torch.bfloat16)
    assert "weight" not in layer._parameters
    assert torch.equal(layer.weight, part.dequantize().to(torch.bfloat16)) and layer.weight is layer.weight


# ----------------------------------------------------------------------------- engines


def write_quantized_gguf(path, model: transformers.PreTrainedModel, kind_of) -> str:
    """``model`` as a llama GGUF whose tensors are stored in ``kind_of(name, tensor)`` (a
    GGMLQuantizationType, F32 for norms), q/k rows permuted as llama.cpp's converter does."""
    config = model.config
    writer = _shape_writer(path, "llama", config)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    for key, value in tiny_metadata().items():
        writer.add_key_value(key, value, _value_type(value))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if ".q_proj." in name:
            tensor = llama_cpp_permute(tensor, config.num_attention_heads)
        elif ".k_proj." in name:
            tensor = llama_cpp_permute(tensor, config.num_key_value_heads)
        kind = kind_of(name, tensor) if tensor.dim() == 2 else T.F32
        if kind == T.F32:
            writer.add_tensor(gguf_tensor_name(name), tensor.float().numpy())
        else:
            writer.add_tensor(gguf_tensor_name(name), quantize(tensor.float().numpy(), kind), raw_dtype=kind)
    return _finish(writer, path)


def q4_k_m(name: str, tensor: torch.Tensor) -> T:
    """llama.cpp's Q4_K_M mix, on a model 256 wide (K-quant rows hold 256 weights a block):
    Q4_K, with v and down Q6_K (llama.cpp does so in some layers: here in all, so that every
    qkv layer mixes formats), o Q5_K (a Q5_K_M layer), the head Q6_K, the embedding Q4_K."""
    return T.Q6_K if ("v_proj" in name or "down" in name or "lm_head" in name) else T.Q5_K if "o_proj" in name else T.Q4_K


FILES = {  # how each test file stores its projections (the embedding Q8_0 in all, the untied head Q8_0), and its modules
    "q4_1": (lambda name, t: T.Q4_1 if "proj" in name else T.Q8_0, {Int4WeightOnlyLinear}),
    "q4_0": (lambda name, t: T.Q4_0 if "proj" in name else T.Q8_0, {Int4WeightOnlyLinear}),
    "q8_0": (lambda name, t: T.Q8_0, {Int8GroupLinear}),
    "mixed": (lambda name, t: T.Q4_0 if ("q_proj" in name or "gate" in name) else T.Q4_1 if "proj" in name else T.Q8_0,
              {Int4WeightOnlyLinear}),
    "q5": (lambda name, t: T.Q5_0 if ("q_proj" in name or "gate" in name or "down" in name) else T.Q5_1 if "proj" in name else T.Q8_0,
           {Int8GroupLinear}),
    "q4_k_m": (q4_k_m, {Int4WeightOnlyLinear, Int8GroupLinear, ColumnSplitLinear}),  # gate_up Q4_K on int4; qkv: q / k int4, v codes
}
WIDE = {"q4_k_m"}  # files of the model 256 wide


def calm_llama(std: float, **shape) -> transformers.LlamaForCausalLM:
    """A tiny random Llama (untied head) with projection weights at ``std`` (embedding and head
    at 0.15), ``shape`` over TINY_SHAPE."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_SHAPE, **shape}, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15 if "embed" in name or "lm_head" in name else std)
    return hf


@pytest.fixture(scope="module")
def reference():
    """Projection weights at std 0.08 (as tests/test_cpu_quantization.py's calm model: a 2-layer
    random model at 0.15 is chaotic)."""
    return calm_llama(0.08)


@pytest.fixture(scope="module")
def reference_wide():
    """256 wide (intermediate 512), for the K-quants; weights at std 0.04 so that each layer's
    gain is the 64-wide model's."""
    return calm_llama(0.04, hidden_size=256, intermediate_size=512)


@pytest.fixture(scope="module")
def files(reference, reference_wide, tmp_path_factory):
    directory = tmp_path_factory.mktemp("gguf_kept")
    return {name: write_quantized_gguf(directory / f"{name}.gguf", reference_wide if name in WIDE else reference, kind_of)
            for name, (kind_of, _) in FILES.items()}


def _llm(path: str, dtype: str = "float32", **device) -> LLM:
    return LLM(model={"path": path, "dtype": dtype}, device={"plugin": "cpu", **device}, kv_cache={"plugin": "paged", "num_blocks": 64})


def _sequences(llm: LLM, vocab: int) -> list[list[int]]:
    """The engine's own greedy continuations of a few prompts (bytes and merges, no specials)."""
    rng = np.random.default_rng(3)
    ps = [rng.integers(4, vocab, size=n).tolist() for n in (5, 17, 40, 9)]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return [p + o.outputs[0].token_ids for p, o in zip(ps, outs)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("file", list(FILES))
def test_kept_engine_matches_the_dequantized_engine(files, reference, file, dtype):
    ref = _llm(files[file], dtype)
    sequences = _sequences(ref, reference.config.vocab_size)
    assert len({tuple(s) for s in sequences}) == len(sequences)
    want = teacher_forced(ref, sequences)
    llm = _llm(files[file], dtype, quantization="gguf", quantize_lm_head=True)
    model = llm.engine.c.runner.model
    kinds = [type(m) for name, m in model.layers.named_modules() if name.endswith("_proj")]
    assert len(kinds) == 4 * len(model.layers) and set(kinds) == FILES[file][1]  # qkv, o, gate_up, down
    assert type(model.lm_head) is Int8GroupLinear  # the untied head is Q8_0 (Q6_K) in every file
    assert not any(isinstance(m, (KeptLinear, nn.Linear, PackedLinear, PanelLinear)) for m in model.modules())
    got = teacher_forced(llm, sequences)
    assert len(got) == len(want)
    agree = sum(w[0] == g[0] for w, g in zip(want, got)) / len(want)
    moved = [abs(w[1] - g[1]) for w, g in zip(want, got)]
    if dtype == "float32":
        assert agree == 1.0 and max(moved) <= F32_MAX_NATS, (agree, max(moved))
    else:
        assert agree >= BF16_AGREEMENT, f"top-1 agrees at {agree:.3f} of positions"
        assert max(moved) <= BF16_MAX_NATS and sum(moved) / len(moved) <= BF16_MEAN_NATS, (max(moved), sum(moved) / len(moved))
    print(f"{file} {dtype}: top-1 agreement {agree:.3f}, logprob change max {max(moved):.2e} mean {sum(moved) / len(moved):.2e}")
    if dtype == "float32":  # free-running too: the very same greedy text
        assert _sequences(llm, reference.config.vocab_size) == sequences


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("file", ["q8_0", "q4_k_m"])
def test_a_kept_file_replays_its_decode_steps_where_its_layers_are_on_the_panels(files, reference, dtype, file):
    """Q8_0, Q6_K, Q5_K and mixed layers on the panel kernels (Int8GroupLinear.use_panels, where
    the platform's float linears of this dtype are ours; Q4_K layers: Int4WeightOnlyLinear.panels)
    are native calls, so decode steps replay as call lists with the eager engine's greedy tokens;
    elsewhere they run eagerly."""
    def run(graphs: bool):
        llm = LLM(model={"path": files[file], "dtype": dtype}, kv_cache={"plugin": "paged", "num_blocks": 64},
                  device={"plugin": "cpu", "quantization": "gguf", "decode_graphs": graphs, **({"graph_max_batch": 4} if graphs else {})})
        rng = np.random.default_rng(5)
        ps = [rng.integers(4, reference.config.vocab_size, size=n).tolist() for n in (5, 17, 9, 30)]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 12, 20, 24)]
        return llm, [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]

    llm, got = run(True)
    layers = [m for m in llm.engine.c.runner.model.layers.modules() if isinstance(m, (Int8GroupLinear, Int4WeightOnlyLinear))]
    on_panels = all(m.records for m in layers)
    split = [m for m in llm.engine.c.runner.model.layers.modules() if isinstance(m, ColumnSplitLinear)]
    assert len(split) == (2 if file == "q4_k_m" else 0) and all(m.records == on_panels for m in split)  # q / k int4, v Q6_K codes
    from test_cpu_experts import HAS_AVX2, TAKES_KERNEL  # where this dtype's float linears are our panel kernels

    assert layers and on_panels == (TAKES_KERNEL if dtype == "bfloat16" else HAS_AVX2)
    graphs = llm.engine.c.runner.graphs
    if on_panels:
        assert graphs is not None and all(graphs.replays[s] > 0 for s in graphs.sizes), graphs and graphs.replays
    assert run(False)[1] == got


def test_the_heads_own_blocks_are_kept_by_default_and_none_is_the_dequantized_model(files, reference):
    """By default gguf keeps an untied head's own blocks (as llama.cpp and vLLM read it: they
    replace the float weight, exactly); quantize_lm_head: false dequantizes it to a float layer;
    with quantization none every layer is the file's dequantized values, as read_gguf gives them."""
    from modserve.core.models.gguf_reader import read_gguf

    model = _llm(files["q4_1"], quantization="gguf").engine.c.runner.model
    assert type(model.lm_head) is Int8GroupLinear  # the file's Q8_0 head
    model = _llm(files["q4_1"], quantization="gguf", quantize_lm_head=False).engine.c.runner.model
    assert isinstance(model.lm_head, (PackedLinear, PanelLinear, nn.Linear)) and type(model.lm_head) is not KeptLinear
    plain = _llm(files["q4_1"], pack_weights=False).engine.c.runner.model
    tensors = read_gguf(files["q4_1"]).tensors
    assert torch.equal(plain.layers[1].self_attn.qkv_proj.weight, torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(plain.lm_head.weight, tensors["lm_head.weight"])
    assert torch.equal(plain.embed_tokens.weight, tensors["model.embed_tokens.weight"])


# ----------------------------------------------------------------------------- refusals


def test_gguf_needs_a_gguf_checkpoint(tiny_models):
    path, _ = tiny_models["llama"]  # an HF safetensors directory
    with pytest.raises(ConfigError, match=r"device.quantization: gguf keeps a GGUF file's blocks.*is not a GGUF tensor"):
        _llm(path, quantization="gguf")


def test_a_tied_head_is_kept_from_the_embeddings_blocks(reference, tmp_path):
    """A head tied to a Q8_0 embedding has no tensor of its own: with quantize_lm_head it is
    built from the embedding's blocks (the values llama.cpp's output layer reads), the embedding
    staying the float parameter it was; by default, the head shares that parameter as before.
    float32: the same top-1 tokens and logprobs within F32_MAX_NATS of the dequantized engine."""
    torch.manual_seed(0)
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_SHAPE, tie_word_embeddings=True)).eval()
    path = write_quantized_gguf(tmp_path / "tied.gguf", tied, FILES["q4_1"][0])
    plain = _llm(path, quantization="gguf")
    model = plain.engine.c.runner.model
    assert type(model.lm_head) is not Int8GroupLinear and not isinstance(model.lm_head, KeptLinear)
    llm = _llm(path, quantization="gguf", quantize_lm_head=True)
    model = llm.engine.c.runner.model
    assert type(model.lm_head) is Int8GroupLinear and model.lm_head.group == 32
    from modserve.core.models.gguf_reader import read_gguf

    assert torch.equal(model.embed_tokens.weight, read_gguf(path).tensors["model.embed_tokens.weight"])
    sequences = _sequences(_llm(path), TINY_SHAPE["vocab_size"])
    want, got = teacher_forced(_llm(path), sequences), teacher_forced(llm, sequences)
    assert [w[0] for w in want] == [g[0] for g in got] and max(abs(w[1] - g[1]) for w, g in zip(want, got)) <= F32_MAX_NATS


def test_float_layers_stay_float_and_mixed_layers_are_split(files, reference, tmp_path):
    path = write_quantized_gguf(tmp_path / "f16.gguf", reference, lambda name, t: T.F16 if "down_proj" in name else T.Q4_1)
    llm = _llm(path, quantization="gguf")
    layer = llm.engine.c.runner.model.layers[0]
    assert isinstance(layer.mlp.down_proj, (PackedLinear, PanelLinear, nn.Linear)) and type(layer.mlp.down_proj) is not KeptLinear
    assert type(layer.mlp.gate_up_proj) is Int4WeightOnlyLinear
    sequences = _sequences(_llm(path), reference.config.vocab_size)
    assert [w[0] for w in teacher_forced(llm, sequences)] == [w[0] for w in teacher_forced(_llm(path), sequences)]
    path = write_quantized_gguf(tmp_path / "mixed.gguf", reference, lambda name, t: T.Q8_0 if "q_proj" in name else T.Q4_1)
    llm = _llm(path, quantization="gguf")
    qkv = llm.engine.c.runner.model.layers[0].self_attn.qkv_proj
    assert type(qkv) is ColumnSplitLinear and [type(p) for p in qkv.pieces] == [Int8GroupLinear, Int4WeightOnlyLinear]  # Q8_0, Q4_1
    sequences = _sequences(_llm(path), reference.config.vocab_size)
    want, got = teacher_forced(_llm(path), sequences), teacher_forced(llm, sequences)
    assert [w[0] for w in want] == [g[0] for g in got] and max(abs(w[1] - g[1]) for w, g in zip(want, got)) <= F32_MAX_NATS


@pytest.mark.parametrize("device,message", [
    ({"plugin": "cpu", "quantization": "gguf4"}, "device.quantization: expected one of none, int8, w8a8, int4, gguf, gptq, awq, compressed-tensors, got 'gguf4'"),
    ({"plugin": "cuda", "quantization": "gguf"}, "device.quantization: unknown key"),
])
def test_bad_combinations_are_config_errors_naming_the_field(device, message):
    with pytest.raises(ConfigError) as e:
        resolve({"device": device})
    assert message in str(e.value)


# ----------------------------------------------------------------------------- the embedded SmolLM2 (Q4_1)


def _tensor_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])  # oneDNN-packed ones too


def test_embedded_smollm2_kept_in_q4_1_matches_its_dequantized_engine():
    """float32: the same greedy text, teacher-forced logprobs within SMOLLM2_MAX_NATS (measured
    1.75e-5: the int4 kernel's rounding over 30 layers), every projection an int4 module with the file's groups of 32, and the model's
    tensors under half the dequantized model's (measured 292 MB against 621: the float32
    embedding and the tied head's packed copy stay)."""
    pipeline = dict(model={"path": "smollm2-135m-instruct", "dtype": "float32", "max_model_len": 512},
                    kv_cache={"plugin": "paged", "num_blocks": 48})
    ref = LLM(**pipeline, device={"plugin": "cpu"})
    prompt = ref.tokenizer.encode("The three primary colours are")
    out = ref.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    sequence = prompt + out[0].outputs[0].token_ids
    want, ref_bytes = teacher_forced(ref, [sequence]), _tensor_bytes(ref.engine.c.runner.model)
    del ref, out
    llm = LLM(**pipeline, device={"plugin": "cpu", "quantization": "gguf"})
    model = llm.engine.c.runner.model
    kept = [m for m in model.layers.modules() if type(m) is Int4WeightOnlyLinear]
    assert len(kept) == 4 * 30 and {m.group_size for m in kept} == {32}
    assert _tensor_bytes(model) < 0.5 * ref_bytes
    got = teacher_forced(llm, [sequence])
    moved = max(abs(w[1] - g[1]) for w, g in zip(want, got))
    print(f"SmolLM2 float32: largest logprob change {moved:.2e}; tensors {_tensor_bytes(model) / 2**20:.0f} MB against {ref_bytes / 2**20:.0f}")
    assert [w[0] for w in want] == [g[0] for g in got] and moved <= SMOLLM2_MAX_NATS
    gen = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert prompt + gen[0].outputs[0].token_ids == sequence
