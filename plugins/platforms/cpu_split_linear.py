"""A fused layer held as pieces of different kinds, each multiplying its own rows of the weight.

Why: the model fuses q / k / v (and gate / up) into one layer, but a GGUF file stores each part
in its own format, and llama.cpp's most used mix, Q4_K_M, keeps q and k in Q4_K and v in Q6_K
in about half the layers. One module for such a layer has to hold every part the widest way
(int8 codes, a byte a weight plus a float32 scale and minimum per 16: 12 bits for what the
file holds in 4.5), and it runs every part on the slower path. As pieces, q and k stay int4
on the int4 kernels and only v takes codes (:func:`~modserve.plugins.platforms.cpu_quant.gguf_linear`).

Each piece is a quantized module for a run of the layer's outputs; where every piece is one
native call on the panel kernels (:attr:`records`) they write their columns of one output in
place (a decode call list records the calls), else their outputs are concatenated.
"""

from __future__ import annotations

import torch
from torch import nn

from modserve.plugins.platforms.cpu_quant import QuantizedLinear


class ColumnSplitLinear(QuantizedLinear):
    """``y = x @ W.T + b`` where ``pieces[i]`` holds rows ``[start_i, start_i + out_i)`` of ``W``
    (and their bias), in order: ``y``'s columns are the pieces' outputs side by side."""

    def __init__(self, layer: nn.Linear, pieces: list[QuantizedLinear]) -> None:
        super().__init__(layer)
        widths = [p.out_features for p in pieces]
        if sum(widths) != self.out_features or any(p.in_features != self.in_features for p in pieces):
            raise ValueError(f"ColumnSplitLinear: pieces of {widths} outputs do not make a {self.in_features} -> {self.out_features} layer")
        self.pieces = nn.ModuleList(pieces)
        self.starts = [sum(widths[:i]) for i in range(len(widths))]

    @property
    def records(self) -> bool:
        """Whether every piece is one native call: then a call is those calls (recordable)."""
        return all(p.records for p in self.pieces)

    def product(self, rows: torch.Tensor) -> torch.Tensor:  # the pieces add their own bias
        if not self.records:
            return torch.cat([p.product(rows) for p in self.pieces], dim=1)
        out = rows.new_empty(rows.shape[0], self.out_features)
        self.product_into(rows, out)
        return out

    def product_into(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        for start, piece in zip(self.starts, self.pieces):
            piece.product_into(rows, out[:, start : start + piece.out_features])
