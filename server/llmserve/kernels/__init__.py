"""Kernels of the torch runner, each with a pure-torch reference.

Every op dispatches on `use_triton(tensor)`: Triton-lang kernels for CUDA
tensors (or anywhere under TRITON_INTERPRET=1, which the tests use to check
the kernels on a CPU), the reference otherwise. The references define what
the kernels compute; the CPU runner runs on them.
"""

from __future__ import annotations

import os

import torch

from llmserve.kernels import switches

try:  # the CPU wheel of torch ships without triton
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAS_TRITON = False


def use_triton(t: torch.Tensor) -> bool:
    if not HAS_TRITON or switches.current.ref:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
