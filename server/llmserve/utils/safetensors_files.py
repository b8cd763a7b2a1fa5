"""The one reader of safetensors checkpoints: which files a directory's checkpoint has, and where each
tensor lies in them (from the files' own headers, memory-mapped: nothing is read until asked).

The torch layers (layers/weights.py) view a tensor through the `safetensors` library in its own dtype
(quantized weights, scales); the Paddle exporter (runners/paddle/export.py) views it as a float32 numpy
array (`as_float32`), with no torch.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The *.safetensors files of a checkpoint: its index's shards, else every file there."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files (only safetensors checkpoints are supported)")
    return files


@dataclass(frozen=True)
class TensorInfo:
    path: Path
    dtype: str  # safetensors' name: F32, BF16, F8_E4M3, I32, ...
    shape: tuple[int, ...]
    begin: int  # byte offsets in the file
    end: int


class SafetensorsFiles:
    """Tensors by name across the files of a checkpoint."""

    def __init__(self, files: list[Path]) -> None:
        self.tensors: dict[str, TensorInfo] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        for path in files:
            with open(path, "rb") as f:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[path] = buf
            (header_len,) = struct.unpack("<Q", buf[:8])
            header = json.loads(buf[8 : 8 + header_len])
            header.pop("__metadata__", None)
            for name, meta in header.items():
                lo, hi = meta["data_offsets"]
                base = 8 + header_len
                self.tensors[name] = TensorInfo(path, meta["dtype"], tuple(meta["shape"]), base + lo, base + hi)

    @classmethod
    def of_dir(cls, model_dir: str | Path) -> SafetensorsFiles:
        return cls(checkpoint_files(model_dir))

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def as_float32(self, name: str) -> np.ndarray:
        """A floating-point tensor as float32 (bf16 is the top half of a float32)."""
        t = self.tensors[name]
        dtype = _FLOAT_DTYPES.get(t.dtype)
        if dtype is None:
            raise ValueError(f"tensor {name}: dtype {t.dtype} is not a float type we can load")
        itemsize = np.dtype(dtype).itemsize
        raw = np.frombuffer(self._maps[t.path], dtype=dtype, count=(t.end - t.begin) // itemsize, offset=t.begin)
        arr = (raw.astype(np.uint32) << 16).view(np.float32) if t.dtype == "BF16" else raw.astype(np.float32)
        return arr.reshape(t.shape)
