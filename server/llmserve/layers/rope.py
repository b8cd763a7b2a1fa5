"""Rotary-embedding frequencies, as HF transformers computes them (float32).

Both runners take their inverse frequencies from here, so a Llama-3.1-style
`rope_scaling` ({"rope_type": "llama3", ...}) means the same on each. YaRN
(`"yarn"`, DeepSeek's long context) also scales the attention: cos/sin by
`yarn_attention_factor` and, in MLA, the softmax scale by `yarn_softmax_mscale`.
"""

from __future__ import annotations

import math

import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "llama3", "yarn")


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
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)  # type: ignore[arg-type]
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


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction, 0.1 * mscale * ln(factor) + 1 (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by (1 unless YaRN), as transformers infers it when the config has none."""
    s = scaling or {}
    if rope_type(s) != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor, mscale, all_dim = float(s["factor"]), s.get("mscale"), s.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, all_dim)
    return yarn_get_mscale(factor)


def yarn_softmax_mscale(scaling: dict | None) -> float:
    """MLA's softmax-scale multiplier: mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's reference and
    transformers' `yarn_apply_mscale`), else 1. It scales the non-rotary dimensions too, unlike the cos/sin factor."""
    s = scaling or {}
    if rope_type(s) == "default" or not s.get("mscale_all_dim"):
        return 1.0
    m = yarn_get_mscale(float(s["factor"]), float(s["mscale_all_dim"]))
    return m * m


def _yarn(dim: int, theta: float, s: dict) -> np.ndarray:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context are interpolated
    (divided by `factor`), those turning more than `beta_fast` times kept, a linear ramp between (float32, as
    transformers' `_compute_yarn_parameters` with its default truncation)."""
    factor, old_len = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = np.power(np.float32(theta), np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = (np.float32(1) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1) - ramp).astype(np.float32)  # 1: extrapolate (keep the frequency)
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)
