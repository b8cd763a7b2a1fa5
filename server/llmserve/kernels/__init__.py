"""Kernels of the torch runner, each with a pure-torch reference.

Every op dispatches on `use_triton(tensor)`: Triton-lang kernels for CUDA
tensors (or anywhere under TRITON_INTERPRET=1, which the tests use to check
the kernels on a CPU), the reference otherwise. The references define what
the kernels compute; the CPU runner runs on them.
"""

from __future__ import annotations

import os

import torch

from llmserve.config import Config

try:  # the CPU wheel of torch ships without triton
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    HAS_TRITON = False

# Read once, at import (use_triton runs on every op). Config.read parses this one setting: a bad value
# of another setting must not break an import (it is reported when the service starts); a bad value of
# this one is a ConfigError naming LLMSERVE_TORCH_KERNELS.
_FORCE_REF = Config.read("torch_kernels") == "ref"


def use_triton(t: torch.Tensor) -> bool:
    if not HAS_TRITON or _FORCE_REF:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
