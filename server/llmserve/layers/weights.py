"""Checkpoint tensors by name, as torch tensors in their own dtype, on the device (the torch layers' view of
utils/safetensors_files.py, the one reader)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from llmserve.utils.safetensors_files import SafetensorsFiles

Split = tuple[int, int, int]  # (dim, lo, hi): the rows (dim 0) or columns (dim 1) lo..hi of a tensor


class WeightReader:
    """Tensors by name across all *.safetensors files of a directory."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        files = SafetensorsFiles.of_dir(model_dir)  # the checkpoint's files and tensors, from their headers
        self.where: dict[str, Path] = {name: info.path for name, info in files.tensors.items()}
        self.handles = {f: safe_open(f, framework="pt") for f in set(self.where.values())}
        self.device, self.dtype = device, dtype

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, split: Split | None = None) -> torch.Tensor:
        """The tensor on the device, in the model's dtype (of a split, only those rows / columns)."""
        return self.raw(name, split).to(self.dtype)

    def raw(self, name: str, split: Split | None = None) -> torch.Tensor:
        """The tensor on the device, in the checkpoint's dtype (quantized weights, their scales). With a
        split, only its rows (dim 0) or columns (dim 1) are read from the file."""
        if name not in self.where:
            raise KeyError(f"weight {name!r} not found in the checkpoint")
        h = self.handles[self.where[name]]
        if split is None:
            return h.get_tensor(name).to(self.device)
        dim, lo, hi = split
        s = h.get_slice(name)
        t = s[lo:hi] if dim == 0 else s[:, lo:hi]
        return t.contiguous().to(self.device)
