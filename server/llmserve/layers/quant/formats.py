"""Quantized weight layouts -> the canonical forms of quant/__init__.py, and online quantization.

Every function here runs once per linear at load (or in tests), in plain torch on any device, so
the GEMM kernels only ever see the canonical forms. Layouts converted:

- GPTQ (AutoGPTQ / optimum / GPTQModel): qweight int32 [K/8, N] packed along K, qzeros int32
  [K/G, N/8] packed along N, low nibble first. Format v1 ("gptq") stores zero_point - 1 in each
  zero nibble (AutoGPTQ's pack does `zeros -= 1`, its forward `zeros + 1`); v2 ("gptq_v2") stores
  the zero point itself. g_idx int32 [K] names each input row's group; with act-order (desc_act)
  it is not arange(K) // G and the rows are sorted by group here, with a `perm` for activations.
- AWQ (AutoAWQ "gemm"): qweight int32 [K, N/8] and qzeros int32 [K/G, N/8], packed along N in
  AWQ's interleaved order: nibble i of word c holds column 8c + AWQ_ORDER[i]; zeros not offset.
- FP8 E4M3: per output channel (compressed-tensors / fbgemm `weight_scale`) or 128 x 128 blocks
  (DeepSeek-V3 / HF FineGrainedFP8 `weight_scale_inv`, which despite its name multiplies).
"""

from __future__ import annotations

import torch

# The config half (quantization_config -> QuantSpec, tensor names) lives in checkpoint_config.py.

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_SHIFTS = tuple(range(0, 32, 4))


# ---- 4-bit packing ----


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2**32) -> int32 with the same bits (bit 31 becomes the sign)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_int4_k(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] integers in 0..15 -> int32 [K // 8, N]; bits 4j..4j+3 of row r hold q[8r + j]."""
    K, N = q.shape
    if K % 8:
        raise ValueError(f"pack_int4_k: K={K} is not a multiple of 8")
    q = (q.to(torch.int64) & 0xF).view(K // 8, 8, N)
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=q.device).view(1, 8, 1)
    return _to_int32((q << shifts).sum(dim=1))


def unpack_int4_k(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K // 8, N] -> uint8 [K, N] in 0..15 (inverse of pack_int4_k)."""
    R, N = qweight.shape
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=qweight.device).view(1, 8, 1)
    # Arithmetic shift smears bit 31 into the high bits; the mask keeps only the nibble.
    return ((qweight.view(R, 1, N) >> shifts) & 0xF).to(torch.uint8).view(R * 8, N)


def _unpack_n(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [R, N / 8] packed along N (nibble i of word c = column 8c + order[i]) -> uint8 [R, N]."""
    R, C = packed.shape
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8], nibble i
    out = torch.empty_like(nib)
    out[..., list(order)] = nib
    return out.to(torch.uint8).view(R, C * 8)


# ---- online weight-only quantization ----


def quantize_w8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w [N, K] -> (qweight int8 [N, K], scale fp32 [N])."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))  # zero rows: q = 0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_w8(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scale.float()[:, None]


def quantize_w4(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of `group_size` inputs: w [N, K] -> canonical w4
    (qweight int32 [K // 8, N], scales fp32 [K // G, N], zeros fp32 [K // G, N]).

    Each group's range is widened to include 0 (as GPTQ does), so the integer zero point
    round(-min / scale) lies in 0..15 without clamping and every element is within scale / 2.
    """
    N, K = w.shape
    G = K if group_size in (-1, 0) else group_size
    if K % G or K % 8:
        raise ValueError(f"quantize_w4: K={K} must be a multiple of 8 and of group_size={G}")
    wg = w.float().t().reshape(K // G, G, N)
    lo = wg.amin(dim=1).clamp(max=0.0)
    hi = wg.amax(dim=1).clamp(min=0.0)
    scales = (hi - lo) / 15.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero groups
    zeros = torch.round(-lo / scales).clamp_(0, 15)
    q = (torch.round(wg / scales[:, None]) + zeros[:, None]).clamp_(0, 15)
    return pack_int4_k(q.reshape(K, N)), scales, zeros


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Canonical w4 -> W [N, K] fp32 (group_size -1: one group over K)."""
    q = unpack_int4_k(qweight).float()
    K = q.shape[0]
    G = K if group_size in (-1, 0) else group_size
    g = torch.arange(K, device=q.device) // G
    return ((q - zeros.float()[g]) * scales.float()[g]).t().contiguous()


# ---- GPTQ and AWQ checkpoints ----


def gptq_to_canonical(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    desc_act: bool,
    sym: bool,
    v2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A GPTQ 4-bit linear -> canonical w4 (qweight, scales, zeros, perm).

    perm (int64 [K]) is None unless g_idx is an act-order one (not arange(K) // G); then the rows
    are sorted by group (stable) and x[:, perm] @ W_canon.T == x @ W.T. `desc_act` and `sym` are
    informational: g_idx alone decides the order, and zeros are read whatever `sym` says.
    """
    del desc_act, sym
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    groups = scales.shape[0]
    G = K if group_size in (-1, 0) or groups == 1 else group_size  # one group also when K < group_size
    if K % G or groups != K // G or qzeros.shape != (groups, N // 8) or scales.shape[1] != N:
        raise ValueError(
            f"GPTQ shapes do not agree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}, group_size {group_size}"
        )
    zeros = _unpack_n(qzeros).float()
    if not v2:
        zeros += 1  # v1 stores zero_point - 1
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(device=qweight.device, dtype=torch.int64)
        if not torch.equal(g_idx, torch.arange(K, device=g_idx.device) // G):
            bad = int(g_idx.min()) < 0 or int(g_idx.max()) >= groups
            if bad or torch.bincount(g_idx, minlength=groups).ne(G).any():
                raise ValueError(f"GPTQ g_idx does not put exactly {G} rows in each of {groups} groups")
            perm = torch.argsort(g_idx, stable=True)
            qweight = pack_int4_k(unpack_int4_k(qweight)[perm])
    return qweight.contiguous(), scales.contiguous(), zeros, perm


def awq_to_canonical(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An AutoAWQ "gemm" 4-bit linear -> canonical w4 (qweight [K // 8, N], scales, zeros)."""
    K, N = qweight.shape[0], qweight.shape[1] * 8
    G = K if group_size in (-1, 0) or scales.shape[0] == 1 else group_size
    if K % G or scales.shape != (K // G, N) or qzeros.shape != (K // G, N // 8):
        raise ValueError(
            f"AWQ shapes do not agree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}, group_size {group_size}"
        )
    q = _unpack_n(qweight, AWQ_ORDER)
    zeros = _unpack_n(qzeros, AWQ_ORDER).float()
    return pack_int4_k(q), scales.contiguous(), zeros


# ---- FP8 ----


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel E4M3: w [N, K] -> (weight float8_e4m3fn [N, K], scale fp32 [N])."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return _to_fp8(w / scale[:, None]), scale


def _block_view(x: torch.Tensor, block: int) -> torch.Tensor:
    """[N, K] -> zero-padded [nb, block, kb, block]."""
    N, K = x.shape
    nb, kb = -(-N // block), -(-K // block)
    x = torch.nn.functional.pad(x, (0, kb * block - K, 0, nb * block - N))
    return x.view(nb, block, kb, block)


def quantize_fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """block x block E4M3: w [N, K] -> (weight float8_e4m3fn [N, K], scale_inv fp32 [ceil(N/B), ceil(K/B)]),
    W ~= weight * scale_inv[n // B, k // B]."""
    N, K = w.shape
    wb = _block_view(w.float(), block)
    amax = wb.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wb / scale[:, None, :, None]).view(scale.shape[0] * block, scale.shape[1] * block)
    return _to_fp8(q[:N, :K]).contiguous(), scale


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: int = 128) -> torch.Tensor:
    """scale [ceil(N/B), ceil(K/B)] -> one factor per element, [N, K] fp32."""
    full = scale.float().repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return full[: shape[0], : shape[1]]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """fp8 weight [N, K] with scale [N] (or [N, 1]; block None) or block scales -> W fp32 [N, K]."""
    w = weight.float()
    if block is None:
        return w * scale.float().reshape(-1, 1)
    return w * expand_block_scale(scale, tuple(w.shape), block)
