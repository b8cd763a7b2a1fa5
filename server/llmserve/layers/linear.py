"""Linear layers: y = x @ W.T (+ bias), with W held the way its quantization method runs it.

A layer is loaded from one or more checkpoint projections that read the same input (q/k/v, or
gate/up), fused along the output dimension into one matrix product where the method allows it;
where it does not (GPTQ act-order parts with different orders, FP8 blocks that would straddle two
projections) the parts run one after another and their outputs are concatenated. How a method
reads, converts and multiplies its tensors is its own business (quant/methods.py): adding a format
is adding a method, not editing the model.
"""

from __future__ import annotations

from typing import Protocol

import torch


class LinearMethod(Protocol):
    """How a format multiplies (layers/quant/methods.py holds the formats; they build `Linear`s)."""

    def apply(
        self, w: dict[str, torch.Tensor], x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
    ) -> torch.Tensor: ...


class Linear:
    def __init__(
        self,
        method: LinearMethod,
        w: dict[str, torch.Tensor],
        bias: torch.Tensor | None = None,
        parts: list[Linear] | None = None,
    ) -> None:
        self.method = method
        self.w = w  # the method's canonical tensors (quant/__init__.py); "perm": an input permutation
        self.bias = bias
        self.parts = parts  # set instead of `w` when the projections could not be fused
        self.perm = w.get("perm")  # looked up once, not per call

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if self.parts is not None:
            return torch.cat([p(x, out_dtype) for p in self.parts], dim=-1)
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return self.method.apply(self.w, x, self.bias, out_dtype)

    def gemv_operands(
        self, x: torch.Tensor, out_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
        """(weight, scale, block) when `self(x, out_dtype)` is one kernels/gemv.py product as it stands (no
        bias, no input permutation, not in parts), else None: for a caller that runs the GEMV itself, with an
        epilogue (a row-parallel projection pushing its row into the fused sum, kernels/sum_norm.py; qkv's
        rotary, gate_up's SwiGLU: model.py)."""
        if self.parts is not None or self.perm is not None or self.bias is not None:
            return None
        return self.method.gemv_operands(self.w, x, out_dtype)

    def skinny_operands(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
        """The weight when `self(x, out_dtype)` is one kernels/skinny.py product as it stands (2-16 rows; no bias,
        permutation or parts), else None: for a caller that runs it with an epilogue (model.py)."""
        if self.parts is not None or self.perm is not None or self.bias is not None:
            return None
        return self.method.skinny_operands(self.w, x, out_dtype)

    @property
    def nbytes(self) -> int:
        """Bytes a batch-1 step reads (the decode floor's): where a method keeps a second layout for
        small products (int4's 4-bit GEMV operands), that one."""
        if self.parts is not None:
            return sum(p.nbytes for p in self.parts)
        ts = self.method.decode_tensors(self.w) + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in ts)
