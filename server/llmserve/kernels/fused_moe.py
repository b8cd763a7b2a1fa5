"""Fused routed experts (DeepSeek-V2/V3): two grouped GEMMs over stacked expert weights, no host sync.

`fused_moe(x, weights, ids, w1, w2, s1, s2)`: x [T, H]; the router's weights [T, k] (fp32) and expert ids [T, k];
  w1 [E, 2I, H] each expert's fused gate_up (gate rows first), w2 [E, H, I] its down projection; either in a float
  dtype (s1 = s2 = None) or E4M3 (float8_e4m3fn) with fp32 scales per 128 x 128 block, s1 [E, 2I/128, H/128] and
  s2 [E, H/128, I/128] (quant/__init__.py's canonical block form, one per expert). Returns the routed sum
  sum_s weights[t, s] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, s], fp32 [T, H].

Layout: the experts' weights stay [N, K] as `Linear` holds them (K contiguous), stacked on a leading expert
dimension. A tile of B = W.T is then BLOCK_N rows of BLOCK_K contiguous elements (128-256-byte segments, fully
coalesced), the 128 x 128 scale blocks line up with the K loop, and stacking at load is a copy with no transpose
(the per-expert Linears become views of the stack: one copy in memory).

1. moe_align.py sorts the (token, slot) pairs by expert and pads each expert's run to BLOCK_M rows.
2. GEMM 1, one program per (row block, BLOCK_N columns of I): the block's expert's gate and up tiles, two fp32
   accumulators over the tokens' rows of x (gathered by pair // k), silu(gate) * up in the epilogue, written to
   h [T * k, I] in x's dtype (where the loop rounds it too).
3. GEMM 2, one program per (row block, BLOCK_N columns of H): h @ down.T, times the pair's routing weight, into
   y [T * k, H] fp32 at the pair's row; then y.view(T, k, H).sum(1). Not atomics: a fixed summation order, so
   the result is the same bit for bit on every run (the buffer costs T * k * H * 4 bytes written and read once,
   small beside the weights at the batch sizes where decode runs).
Blocks of padding (expert -1) return at once, so only the chosen experts' weights are read: at batch 1, k experts.

FP8: w8a16, the E4M3 bytes are read as uint8 and decoded by bit manipulation as kernels/fp8_gemm.py's weight-only
GEMM does (fp16 bits of the value * 2^-8, exact; any CUDA arch), converted to x's dtype for tl.dot, and each
128-deep K step's product is scaled by its block's scale (* 2^8) into the fp32 accumulator. Only FP8 bytes and
the small scales cross memory.

Launch shapes (`moe_config`): by the mean number of pairs an expert gets, T * k / E. Up to 8 (decode, DeepSeek-V3
up to 256 tokens) BLOCK_M = 16: one block holds an expert's pairs, so each weight tile is read once, and narrow
BLOCK_N gives enough programs to stream weights from every SM; 32 and 64 rows up to 20 and 64 pairs (still one
block for most experts); 128 rows beyond (prefill: tensor-core bound).
"""

from __future__ import annotations

import torch

from llmserve.kernels.moe_align import moe_align

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

SCALE_BLOCK = 128  # DeepSeek-V3's weight_block_size

if triton is not None:

    @triton.jit
    def _load_w(ptrs, mask, FP8: tl.constexpr, dtype: tl.constexpr):
        """A weight tile in `dtype`; E4M3 bytes decode to their value * 2^-8 (fp8_gemm.py's weight-only trick)."""
        if FP8:
            u = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
            bits = ((u & 0x80) << 8) | ((u & 0x7F) << 7)
            return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(dtype)
        return tl.load(ptrs, mask=mask, other=0.0).to(dtype)

    @triton.jit
    def _moe_gemm_kernel(
        a_ptr,
        w_ptr,
        ws_ptr,
        c_ptr,
        pairs_ptr,
        block_expert_ptr,
        rw_ptr,
        N,
        K,
        P,
        stride_am,
        stride_we,
        stride_wn,
        stride_wse,
        stride_wsn,
        stride_cm,
        A_DIV: tl.constexpr,
        SWIGLU: tl.constexpr,
        MUL_WEIGHT: tl.constexpr,
        FP8: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """C[pair, n] for the pairs of one row block and BLOCK_N columns (module doc). A's row of a pair is
        pair // A_DIV; with SWIGLU, W holds 2N rows (gate, then up) and C gets silu(gate) * up."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(block_expert_ptr + pid_m)
        if e < 0:  # padding past the last expert's rows
            return
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = pair < P
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + (pair // A_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        w_base = w_ptr + e.to(tl.int64) * stride_we
        g_ptrs = w_base + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
        u_ptrs = g_ptrs + N * stride_wn
        s_base = ws_ptr + e.to(tl.int64) * stride_wse
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask_k = offs_k < K - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            mask_w = mask_k[:, None] & mask_n[None, :]
            g = _load_w(g_ptrs, mask_w, FP8, a.dtype)
            if FP8:  # scale each 128-deep step's product by its block's scale (2^8: the decoding's)
                kb = k0 // 128
                sg = tl.load(s_base + (offs_n // 128) * stride_wsn + kb, mask=mask_n, other=0.0)
                acc += tl.dot(a, g) * (sg * 256.0)[None, :]
            else:
                acc = tl.dot(a, g, acc)
            if SWIGLU:
                u = _load_w(u_ptrs, mask_w, FP8, a.dtype)
                if FP8:
                    su = tl.load(s_base + ((offs_n + N) // 128) * stride_wsn + kb, mask=mask_n, other=0.0)
                    acc_u += tl.dot(a, u) * (su * 256.0)[None, :]
                else:
                    acc_u = tl.dot(a, u, acc_u)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        if SWIGLU:
            acc = acc * tl.sigmoid(acc) * acc_u
        if MUL_WEIGHT:
            acc = acc * tl.load(rw_ptr + pair, mask=mask_m, other=0.0)[:, None]
        c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def moe_config(n_pairs: int, n_experts: int) -> dict:
    """Launch shapes of both GEMMs by the mean pairs per expert (module doc); BLOCK_N1 is GEMM 1's (two tiles)."""
    per_expert = n_pairs / n_experts
    if per_expert <= 8:
        return dict(BLOCK_M=16, BLOCK_N1=32, BLOCK_N2=64, BLOCK_K=128, num_warps=4, num_stages=4)
    if per_expert <= 20:
        return dict(BLOCK_M=32, BLOCK_N1=32, BLOCK_N2=64, BLOCK_K=128, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return dict(BLOCK_M=64, BLOCK_N1=64, BLOCK_N2=64, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N1=64, BLOCK_N2=128, BLOCK_K=64, num_warps=8, num_stages=3)


def _check(x, w1, w2, s1, s2) -> None:
    E, N1, H = w1.shape
    if x.shape[1] != H or w2.shape != (E, H, N1 // 2) or N1 % 2:
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    if (s1 is None) != (w1.dtype != torch.float8_e4m3fn) or (s2 is None) != (w2.dtype != torch.float8_e4m3fn):
        raise ValueError("fused_moe: E4M3 weights take block scales, float weights none")
    for w, s in ((w1, s1), (w2, s2)):
        cd = triton.cdiv
        if s is not None and tuple(s.shape) != (E, cd(w.shape[1], SCALE_BLOCK), cd(w.shape[2], SCALE_BLOCK)):
            raise ValueError(f"fused_moe: scale {tuple(s.shape)} for weight {tuple(w.shape)}")
    if not (w1.stride(-1) == w2.stride(-1) == x.stride(-1) == 1):
        raise ValueError("fused_moe: weights and x need a contiguous last dimension")


def _gemm(a, w, s, c, al, rw, N, K, a_div, swiglu, block_n, cfg) -> None:
    fp8 = s is not None
    wv = w.view(torch.uint8) if fp8 else w
    sv = s if fp8 else rw  # an unused pointer without scales
    grid = (al.block_expert.numel(), triton.cdiv(N, block_n))
    _moe_gemm_kernel[grid](
        a,
        wv,
        sv,
        c,
        al.pairs,
        al.block_expert,
        rw,
        N,
        K,
        rw.numel(),
        a.stride(0),
        wv.stride(0),
        wv.stride(1),
        sv.stride(0) if fp8 else 0,
        sv.stride(1) if fp8 else 0,
        c.stride(0),
        A_DIV=a_div,
        SWIGLU=swiglu,
        MUL_WEIGHT=not swiglu,
        FP8=fp8,
        BLOCK_M=al.block_m,
        BLOCK_N=block_n,
        BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def fused_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    s1: torch.Tensor | None = None,
    s2: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum, fp32 [T, H] (module doc). `config`: moe_config's keys (benchmarks)."""
    _check(x, w1, w2, s1, s2)
    T, k = ids.shape
    E, N1, H = w1.shape
    inter = N1 // 2
    cfg = config or moe_config(T * k, E)
    al = moe_align(ids, E, cfg["BLOCK_M"])
    rw = weights.reshape(-1).float().contiguous()
    h = torch.empty(T * k, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(T * k, H, dtype=torch.float32, device=x.device)
    if T == 0:
        return y.view(T, H)
    _gemm(x, w1, s1, h, al, rw, inter, H, k, True, cfg["BLOCK_N1"], cfg)
    _gemm(h, w2, s2, y, al, rw, H, inter, 1, False, cfg["BLOCK_N2"], cfg)
    return y.view(T, k, H).sum(1)
