"""Checkpoint tensors by name across the *.safetensors files of a directory (the torch layers' one reader)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

Split = tuple[int, int, int]  # (dim, lo, hi): the rows (dim 0) or columns (dim 1) lo..hi of a tensor


class WeightReader:
    """Tensors by name across all *.safetensors files of a directory."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        self.where: dict[str, Path] = {}
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            for name, f in json.loads(index.read_text())["weight_map"].items():
                self.where[name] = model_dir / f
        else:
            for f in files:
                with safe_open(f, framework="pt") as h:
                    for name in h.keys():
                        self.where[name] = f
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
