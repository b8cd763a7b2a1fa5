"""Weight-only quantized GEMMs (kernels/quant_gemm.py).

CPU (always): the pure-torch references against a float64 computation that builds W from the integer
weights themselves (the packing done here, with numpy, and checked by unpacking it back).
Interpreter (triton installed): the Triton kernels under TRITON_INTERPRET=1 on a CPU against the references,
in a subprocess (triton reads the variable at import; the rest of the session must not see it). bf16 is
left out there: the interpreter stores bf16 as raw uint16 and its casts and dots on it are wrong.
GPU: the kernels against the references over decode and prefill shapes, and under CUDA graph replay.
"""

from __future__ import annotations

import os
import textwrap

import numpy as np
import pytest
import torch
import triton_interpreter

from llmserve.kernels import HAS_TRITON
from llmserve.kernels.quant_dequant import DEQUANT_M
from llmserve.kernels.quant_gemm import (
    w4a16_linear,
    w4a16_linear_ref,
    w8a16_linear,
    w8a16_linear_ref,
)


def pack_w4(q: np.ndarray) -> torch.Tensor:
    """q [K, N] in 0..15 -> int32 [K // 8, N], nibble j of word r = q[8r + j] (GPTQ's packing)."""
    K, N = q.shape
    words = np.zeros((K // 8, N), dtype=np.uint32)
    for j in range(8):
        words |= q[j::8].astype(np.uint32) << np.uint32(4 * j)
    return torch.from_numpy(words.view(np.int32).copy())


def unpack_w4(words: torch.Tensor) -> np.ndarray:
    u = words.numpy().view(np.uint32)
    q = np.empty((u.shape[0] * 8, u.shape[1]), dtype=np.int64)
    for j in range(8):
        q[j::8] = (u >> np.uint32(4 * j)) & np.uint32(0xF)
    return q


def make_w8(gen: torch.Generator, N: int, K: int) -> dict[str, torch.Tensor]:
    q = torch.randint(-128, 128, (N, K), generator=gen, dtype=torch.int8)
    scale = torch.rand(N, generator=gen) * 0.02 + 0.001
    return {"qweight": q, "scale": scale}


def make_w4(gen: torch.Generator, N: int, K: int, G: int, sdtype: torch.dtype) -> dict:
    q = torch.randint(0, 16, (K, N), generator=gen).numpy()
    groups = K // G
    zeros = torch.randint(0, 16, (groups, N), generator=gen).float()
    scales = (torch.rand(groups, N, generator=gen) * 0.05 + 0.005).to(sdtype)
    words = pack_w4(q)
    assert (unpack_w4(words) == q).all()
    return {"q": q, "qweight": words, "scales": scales, "zeros": zeros, "G": G}


def w8_float64(x: torch.Tensor, w: dict, bias: torch.Tensor | None) -> torch.Tensor:
    W = w["qweight"].cpu().double() * w["scale"].cpu().double()[:, None]  # [N, K]
    y = x.cpu().double() @ W.T
    return y if bias is None else y + bias.cpu().double()


def w4_float64(x: torch.Tensor, w: dict, bias: torch.Tensor | None) -> torch.Tensor:
    K, N = w["q"].shape
    g = np.arange(K) // w["G"]  # the group of each input row
    z = w["zeros"].double().numpy()[g]
    s = w["scales"].double().numpy()[g]
    W = torch.from_numpy((w["q"] - z) * s)  # [K, N]
    y = x.cpu().double() @ W
    return y if bias is None else y + bias.cpu().double()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error relative to the output's magnitude."""
    ref = ref.double()
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


CPU_SHAPES = [(1, 48, 256), (5, 40, 192), (33, 200, 512), (70, 24, 1024)]  # M, N, K: odd M, N % 16 != 0


@pytest.mark.parametrize("M,N,K", CPU_SHAPES)
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_w8_reference(M, N, K, has_bias, out_dtype, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    x = torch.randn(M, K, generator=gen)
    w = make_w8(gen, N, K)
    bias = torch.randn(N, generator=gen) if has_bias else None
    y = w8a16_linear_ref(x, w["qweight"], w["scale"], bias, out_dtype)
    assert y.dtype == out_dtype and y.shape == (M, N)
    tol = 1e-5 if out_dtype == torch.float32 else 2**-8  # fp32 sums; bf16's rounding of the output
    assert rel_err(y, w8_float64(x, w, bias)) < tol, f"seed {fresh_seed}"
    if out_dtype == torch.float32:  # on a CPU tensor the op is the reference
        assert torch.equal(w8a16_linear(x, w["qweight"], w["scale"], bias, out_dtype), y)


@pytest.mark.parametrize("M,N,K", CPU_SHAPES)
@pytest.mark.parametrize("G", [32, 64, -1])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_w4_reference(M, N, K, G, has_bias, out_dtype, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    sdtype = [torch.float16, torch.bfloat16, torch.float32][fresh_seed % 3]
    w = make_w4(gen, N, K, K if G == -1 else G, sdtype)
    bias = torch.randn(N, generator=gen).to(torch.bfloat16) if has_bias else None
    y = w4a16_linear_ref(x, w["qweight"], w["scales"], w["zeros"], G, bias, out_dtype)
    assert y.dtype == out_dtype and y.shape == (M, N)
    tol = 1e-5 if out_dtype == torch.float32 else 2**-8
    assert rel_err(y, w4_float64(x, w, bias)) < tol, f"seed {fresh_seed}, scales {sdtype}"
    if out_dtype == torch.float32:
        y2 = w4a16_linear(x, w["qweight"], w["scales"], w["zeros"], G, bias, out_dtype)
        assert torch.equal(y2, y)


def test_w4_rejects_bad_k():
    w = make_w4(torch.Generator().manual_seed(0), 16, 64, 32, torch.float16)
    with pytest.raises(ValueError):
        w4a16_linear(torch.randn(2, 72), w["qweight"], w["scales"], w["zeros"], 32)  # K is not 8 * 8 rows


# ---- Triton interpreter (CPU) ----

INTERP_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    from test_quant_gemm import make_w4, make_w8, rel_err
    from llmserve.kernels import use_triton
    from llmserve.kernels import quant_gemm as qg
    from llmserve.kernels.gemv import GEMV_MAX_M

    gen = torch.Generator().manual_seed({seed})
    assert use_triton(torch.zeros(1)), "TRITON_INTERPRET=1 must route CPU tensors to the kernels"
    N = 48
    cases = [(M, 256, G, dt) for M in (1, 5, 33) for G in (128, 32) for dt in (torch.float16, torch.float32)]
    # split-K (K long enough for 2 slices); large M; G % 8 == 0 below the K tile; any G (240: no whole K tile)
    cases += [(3, 1024, 128, torch.float16), (70, 256, 128, torch.float16), (70, 240, 40, torch.float32)]
    cases += [(5, 240, 12, torch.float32)]
    split = 0
    for M, Kx, G, dt in cases:
        x = torch.randn(M, 2 * Kx, generator=gen).to(dt)[:, 1 : Kx + 1]  # rows strided, an odd start
        bias = torch.randn(N, generator=gen) if M % 2 else None
        out = torch.float32 if M != 33 else torch.bfloat16
        w8 = make_w8(gen, N, Kx)
        y = qg.w8a16_linear(x, w8["qweight"], w8["scale"], bias, out)
        ref = qg.w8a16_linear_ref(x, w8["qweight"], w8["scale"], bias, out)
        assert y.dtype == out and rel_err(y, ref) < (1e-5 if out == torch.float32 else 2**-7), ("w8", M, dt)
        w4 = make_w4(gen, N, Kx, G, torch.bfloat16 if M % 2 else torch.float16)
        y = qg.w4a16_linear(x, w4["qweight"], w4["scales"], w4["zeros"], G, bias, out)
        ref = qg.w4a16_linear_ref(x, w4["qweight"], w4["scales"], w4["zeros"], G, bias, out)
        # exact dequantization at small M with whole groups per K tile (G % 64 == 0); else the weights are
        # rounded to x's dtype (fp16: 2**-11)
        exact = (M <= qg.SMALL_M and G % 64 == 0) or dt == torch.float32
        tol = 1e-5 if exact else 2e-3
        tol = tol if out == torch.float32 else 2**-7
        assert y.dtype == out and rel_err(y, ref) < tol, ("w4", M, G, dt, rel_err(y, ref))
        split += qg._plan_w4(M, N, Kx, G, qg._num_sms(x.device))[1] > 1
        split += M > GEMV_MAX_M and qg._plan_w8(M, N, Kx, qg._num_sms(x.device))[1] > 1  # else kernels/gemv.py
    assert split >= 2, "too few cases took the split-K (atomic) path"
    print("ok", len(cases))
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernels_under_interpreter(fresh_seed):
    script = INTERP_SCRIPT.format(tests=os.path.dirname(__file__), seed=fresh_seed)
    triton_interpreter.run_script(script, fresh_seed)


# ---- GPU ----

GPU_M = [1, 3, 16, 64, 65, 300, 2048]
GPU_NK = [(4096, 4096), (6144, 4096), (1000, 1152)]  # the last: N and K not multiples of the tiles


@pytest.fixture
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the references run fp32 matmuls on the GPU
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def gpu_tol(exact: bool, xdtype: torch.dtype) -> float:
    """Error bound relative to max |y|: exact dequantization leaves only fp32 sums; weights rounded to x's
    dtype add about its half-ulp (bf16 2**-9, fp16 2**-11) per weight, mostly averaging out over K."""
    if exact:
        return 1e-4
    return 1e-2 if xdtype == torch.bfloat16 else 3e-3


@pytest.mark.gpu
@pytest.mark.parametrize("M", GPU_M)
@pytest.mark.parametrize("N,K", GPU_NK)
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16])
def test_w8_kernel_gpu(M, N, K, xdtype, fresh_seed, no_tf32):
    gen = torch.Generator().manual_seed(fresh_seed)
    x = torch.randn(M, K, generator=gen).to(xdtype).cuda()
    w = {k: v.cuda() for k, v in make_w8(gen, N, K).items()}
    bias = torch.randn(N, generator=gen).to(xdtype).cuda() if M % 2 else None
    for out_dtype in (torch.float32, xdtype):
        y = w8a16_linear(x, w["qweight"], w["scale"], bias, out_dtype)
        ref = w8a16_linear_ref(x, w["qweight"], w["scale"], bias, torch.float32)
        # prefill sizes round each weight to x's dtype (kernels/quant_dequant.py)
        tol = gpu_tol(M < DEQUANT_M, xdtype) if out_dtype == torch.float32 else 2**-7
        assert y.dtype == out_dtype and rel_err(y, ref) < tol, f"seed {fresh_seed}, out {out_dtype}"


@pytest.mark.gpu
@pytest.mark.parametrize("M", GPU_M)
@pytest.mark.parametrize("N,K", GPU_NK)
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16])
def test_w4_kernel_gpu(M, N, K, xdtype, fresh_seed, no_tf32):
    from llmserve.kernels.quant_gemm import SMALL_M

    gen = torch.Generator().manual_seed(fresh_seed)
    G = 128
    x = torch.randn(M, K, generator=gen).to(xdtype).cuda()
    w = make_w4(gen, N, K, G, xdtype)
    args = [w["qweight"].cuda(), w["scales"].cuda(), w["zeros"].cuda(), G]
    bias = torch.randn(N, generator=gen).to(xdtype).cuda() if M % 2 else None
    for out_dtype in (torch.float32, xdtype):
        y = w4a16_linear(x, *args, bias, out_dtype)
        ref = w4a16_linear_ref(x, *args, bias, torch.float32)
        tol = gpu_tol(M <= SMALL_M, xdtype) if out_dtype == torch.float32 else 2**-7
        assert y.dtype == out_dtype and rel_err(y, ref) < tol, f"seed {fresh_seed}, out {out_dtype}"


@pytest.mark.gpu
@pytest.mark.parametrize("G", [32, -1])
def test_w4_group_sizes_gpu(G, fresh_seed, no_tf32):
    """Groups smaller than the K tile (a scale row per word) and one group over K (G = -1)."""
    gen = torch.Generator().manual_seed(fresh_seed)
    N, K = 4096, 4096
    w = make_w4(gen, N, K, K if G == -1 else G, torch.float16)
    args = [w["qweight"].cuda(), w["scales"].cuda(), w["zeros"].cuda(), G]
    for M in (1, 40, 512):
        x = torch.randn(M, K, generator=gen).to(torch.float16).cuda()
        y = w4a16_linear(x, *args, None, torch.float32)
        ref = w4a16_linear_ref(x, *args, None, torch.float32)
        assert rel_err(y, ref) < gpu_tol(False, torch.float16), f"seed {fresh_seed}, M {M}"


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 300])
def test_kernels_in_cuda_graph(M, fresh_seed, no_tf32):
    """Captured once (after an eager warm-up that compiles), replayed on new inputs: the split-K path's
    zeroed fp32 output and the plain path's stores both live in the graph's memory."""
    gen = torch.Generator().manual_seed(fresh_seed)
    N, K, G = 6144, 4096, 128
    w8 = {k: v.cuda() for k, v in make_w8(gen, N, K).items()}
    w4 = make_w4(gen, N, K, G, torch.bfloat16)
    a4 = [w4["qweight"].cuda(), w4["scales"].cuda(), w4["zeros"].cuda(), G]
    bias = torch.randn(N, generator=gen).to(torch.bfloat16).cuda()
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16).cuda()

    def step():
        return (
            w8a16_linear(x, w8["qweight"], w8["scale"], bias, torch.float32),
            w4a16_linear(x, *a4, bias, torch.bfloat16),
        )

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y8, y4 = step()
    for _ in range(3):
        x.copy_(torch.randn(M, K, generator=gen).to(torch.bfloat16).cuda())
        g.replay()
        torch.cuda.synchronize()
        ref8 = w8a16_linear_ref(x, w8["qweight"], w8["scale"], bias, torch.float32)
        ref4 = w4a16_linear_ref(x, *a4, bias, torch.float32)
        assert rel_err(y8, ref8) < gpu_tol(True, torch.bfloat16), f"seed {fresh_seed}"
        assert rel_err(y4, ref4) < 2**-7, f"seed {fresh_seed}"
