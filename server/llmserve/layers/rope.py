"""Rotary-embedding frequencies, as HF transformers computes them (float32).

Both runners take their inverse frequencies from here, so a Llama-3.1-style
`rope_scaling` ({"rope_type": "llama3", ...}) means the same on each.
"""

from __future__ import annotations

import math

import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_type(scaling: dict | None) -> str:
    """The scaling's type (HF's `rope_type`, formerly `type`); raises for one we do not implement."""
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return kind


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / np.power(np.float32(theta), exponent)).astype(np.float32)
    if rope_type(scaling) == "default":
        return inv_freq
    return _llama3(inv_freq, scaling)  # type: ignore[arg-type]


def _llama3(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    factor = np.float32(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s["original_max_position_embeddings"])
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low)).astype(np.float32)
    blended = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, blended, scaled).astype(np.float32)
