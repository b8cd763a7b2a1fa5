"""The decode GEMVs over int8 / FP8 / bf16 weights (kernels/gemv.py, one row) and 4-bit weights (kernels/gemv4.py,
1-4 rows): their references against float64, the kernels under Triton's interpreter (CPU, in a subprocess: triton
reads TRITON_INTERPRET at import) and on a GPU, and that w8a16_linear, fp8_linear, the unquantized layers and the
int4 layers give them their small products."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
import triton_interpreter
from pdl_chain import assert_same_bits_with_pdl

from llmserve.kernels import HAS_TRITON
from llmserve.kernels.gemv import gemv_ref
from llmserve.kernels.gemv4 import gemv4_dequantize, gemv4_operands
from llmserve.layers.quant import formats


def rand_weight(gen: torch.Generator, N: int, K: int, fmt: str, block: int, device: str = "cpu"):
    """(weight, scale): int8 codes or FP8 values over their whole range, per-row or block scales; int4: a random
    matrix quantized to canonical w4 (groups of `block` or 128), as the 4-bit GEMV's operands."""
    if fmt == "bf16":  # unquantized: no scale
        return torch.randn(N, K, generator=gen).to(torch.bfloat16).to(device), None
    if fmt == "int4":
        w, sz = gemv4_operands(*formats.quantize_w4(torch.randn(N, K, generator=gen), block or 128))
        return w.to(device), sz.to(device)
    if fmt == "int8":
        w = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8)
    else:
        w = (torch.randn(N, K, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    shape = (-(-N // block), -(-K // block)) if block else (N,)
    scale = torch.rand(shape, generator=gen) * 0.01 + 1e-4
    return w.to(device), scale.to(device)


def float64_product(x, w, scale, block, bias):
    W = w.double() if w.dtype != torch.int32 else gemv4_dequantize(w, scale).double()
    if w.dtype == torch.int32:
        s = torch.ones(1, 1, dtype=torch.float64, device=w.device)
    elif scale is None:
        s = torch.ones(1, 1, dtype=torch.float64, device=w.device)
    elif block:
        s = scale.double().repeat_interleave(block, 0)[: w.shape[0]].repeat_interleave(block, 1)[:, : w.shape[1]]
    else:
        s = scale.double()[:, None]
    y = x.double() @ (W * s).t()
    return y + bias.double() if bias is not None else y


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("fmt,block", [("int8", 0), ("fp8", 0), ("fp8", 128), ("int8", 64)])
def test_reference_against_float64(fmt, block, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    N, K = 70, 300
    w, s = rand_weight(gen, N, K, fmt, block)
    x = torch.randn(1, K, generator=gen)
    bias = torch.randn(N, generator=gen)
    y = gemv_ref(x, w, s, block, bias, torch.float32)
    assert y.shape == (1, N) and y.dtype == torch.float32
    assert rel_err(y, float64_product(x, w, s, block, bias)) < 1e-5, f"seed {fresh_seed}"


@pytest.mark.parametrize("N,K,G", [(70, 256, 128), (33, 512, 64), (8, 1024, 256)])
def test_int4_operands_hold_the_canonical_weights(N, K, G, fresh_seed):
    """gemv4's operands (words transposed and scattered, scale and zero in one word) dequantize to the canonical
    w4's weights, up to the scale's 18 kept mantissa bits; zero points it cannot hold get no operands."""
    gen = torch.Generator().manual_seed(fresh_seed)
    q, s, z = formats.quantize_w4(torch.randn(N, K, generator=gen), G)
    w, sz = gemv4_operands(q, s, z)
    assert w.shape == (N, K // 8) and w.dtype == torch.int32 and sz.shape == (N, K // G)
    want = formats.dequantize_w4(q, s, z, G).double()
    assert rel_err(gemv4_dequantize(w, sz), want) < 2**-17, f"seed {fresh_seed}"
    assert gemv4_operands(q, s, z + 32) is None and gemv4_operands(q, s, z + 0.5) is None
    assert gemv4_operands(q, s * 0, z) is None  # no positive normal scale


INTERP_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    from test_gemv import float64_product, rand_weight, rel_err
    from llmserve.kernels import fp8_gemm, gemv as G, quant_gemm

    gen = torch.Generator().manual_seed({seed})
    # ragged N and K (masks), whole tiles (no masks), block scales, each conversion of int8
    cases = [(70, 300, "int8", 0, 1), (64, 1024, "int8", 0, 0), (96, 512, "int8", 0, 1), (40, 256, "fp8", 0, 0)]
    cases += [(130, 384, "fp8", 128, 0), (72, 200, "int8", 64, 1)]
    for N, K, fmt, block, conv in cases:
        w, s = rand_weight(gen, N, K, fmt, block)
        for xdt, out, config in [(torch.bfloat16, torch.float32, (8, 256, 4, 0)), (torch.float32, torch.bfloat16, (16, 128, 2, 1))]:
            x = torch.randn(1, K, generator=gen).to(xdt)
            bias = torch.randn(N, generator=gen).to(xdt) if out == torch.bfloat16 else None
            y = G.gemv(x, w, s, block, bias, out, config=config, conv=conv if fmt == "int8" else 0)
            tol = 1e-5 if out == torch.float32 else 2**-7
            assert y.dtype == out and rel_err(y, float64_product(x, w, s, block, bias)) < tol, (N, K, fmt, block, conv)
    # the one-row products of the layers' entry points run here, bit for bit; two rows do not
    x = torch.randn(1, 512, generator=gen).to(torch.bfloat16)
    w, s = rand_weight(gen, 96, 512, "int8", 0)
    assert torch.equal(quant_gemm.w8a16_linear(x, w, s, None, torch.float32), G.gemv(x, w, s, 0, None, torch.float32))
    assert not G.gemv_ok(torch.cat([x, x]), w) and not G.gemv_ok(x[:0], w)  # two rows, none
    for block in (None, 128):
        w, s = rand_weight(gen, 96, 512, "fp8", block or 0)
        got = fp8_gemm.fp8_linear(x, w, s, block, None, torch.float32)
        assert torch.equal(got, G.gemv(x, w, s, block or 0, None, torch.float32)), block
    # gate | up rows with the SwiGLU in the epilogue: silu(gate) * up of the product's own fp32 rows
    for N, K, fmt, config in [(96, 512, "int8", None), (70, 300, "bf16", None), (48, 256, "fp8", (8, 128, 2, 0))]:
        w, s = rand_weight(gen, N, K, fmt, 0)
        x = torch.randn(1, K, generator=gen).to(torch.bfloat16)
        rows = G.gemv(x, w, s, 0, None, torch.float32, config=config)
        got = G.gemv(x, w, s, 0, None, torch.bfloat16, config=config, glu=True)
        g, u = rows.double().chunk(2, dim=-1)
        assert got.shape == (1, N // 2) and rel_err(got, g * torch.sigmoid(g) * u) < 2**-7, (N, K, fmt)
        g, u = float64_product(x, w, s, 0, None).chunk(2, dim=-1)
        assert rel_err(got, g * torch.sigmoid(g) * u) < 2**-7, (N, K, fmt)
    # qkv rows with the rotary embedding and the cache write in the epilogue, as rope_and_cache does them
    import numpy as np
    from llmserve.kernels import rotary
    H, KVH, D, bs, K = 4, 2, 16, 8, 64
    cs = rotary.rope_cos_sin(1.0 / 10000 ** (np.arange(0, D, 2) / D), 64, "cpu")
    for fmt, slot in [("int8", 19), ("bf16", 5), ("fp8", -1)]:
        w, s = rand_weight(gen, (H + 2 * KVH) * D, K, fmt, 0)
        x = torch.randn(1, K, generator=gen).to(torch.bfloat16)
        pos, slots = torch.tensor([13]), torch.tensor([slot])
        caches = [torch.zeros(4, KVH, bs, D, dtype=torch.float16) for _ in range(4)]
        rc = G.RopeCache(pos, slots, cs, caches[0], caches[1], H, KVH)
        got = G.gemv(x, w, s, 0, None, torch.float32, config=(4, 32, 2, 0), rope=rc)
        want = G.gemv(x, w, s, 0, None, torch.float32, config=(4, 32, 2, 0))
        rotary.rope_and_cache_ref(want, pos, slots, cs, caches[2], caches[3], H, KVH)
        assert rel_err(got, want.double()) < 1e-6, fmt
        for a, b in zip(caches[:2], caches[2:]):
            assert torch.allclose(a.float(), b.float(), rtol=2e-3, atol=1e-3), fmt
            assert (a != 0).any() == (slot >= 0), fmt  # a padding slot (-1) writes nothing
    # 4-bit weights: 1-4 rows, ragged N, groups of 64 and 128, bias, each output dtype, the epilogues at one row
    from llmserve.layers.quant import formats
    from llmserve.layers.quant.methods import W4
    for N, K, G_, rows, out in [(40, 512, 128, 1, torch.float32), (37, 256, 64, 3, torch.bfloat16), (48, 1024, 128, 4, torch.float32), (32, 384, 128, 2, torch.float32)]:
        w, s = rand_weight(gen, N, K, "int4", G_)
        x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
        bias = torch.randn(N, generator=gen).to(torch.bfloat16) if rows % 2 else None
        y = G.gemv(x, w, s, 0, bias, out)
        assert y.shape == (rows, N) and y.dtype == out, (N, K, rows)
        # (the 4-bit GEMV keeps ~13 bits of each q x, gemv4.py: 1e-4, as the GPU test allows)
        assert rel_err(y, float64_product(x, w, s, 0, bias)) < (1e-4 if out == torch.float32 else 2**-7), (N, K, rows)
        assert torch.equal(y[rows - 1 :], G.gemv(x[rows - 1 :], w, s, 0, bias, out))  # a row is its own product
        if N % 2 == 0:  # as gate | up rows: the SwiGLU in the epilogue
            rows_ = G.gemv(x[:1], w, s, 0, None, torch.float32)
            g, u = rows_.double().chunk(2, dim=-1)
            got = G.gemv(x[:1], w, s, 0, None, torch.bfloat16, glu=True)
            assert rel_err(got, g * torch.sigmoid(g) * u) < 2**-7, (N, K)
    # a product added into a row (the residual) that leaves the RMSNorm of the sum pending, and the next product of
    # that norm's output (model.py `Normed`); ragged N (the parts' masks), each format on each side
    for (fmt, N, K, G1), (fmt2, M, G2) in [(("int8", 256, 300, 0), ("int4", 40, 128)), (("int4", 128, 512, 128), ("bf16", 70, 0)), (("bf16", 200, 64, 0), ("int8", 48, 0))]:
        w1, s1 = rand_weight(gen, N, K, fmt, G1)
        w2, s2 = rand_weight(gen, M, N, fmt2, G2)
        res, nw = torch.randn(1, N, generator=gen) * 3, (1 + 0.1 * torch.randn(N, generator=gen)).to(torch.bfloat16)
        xb = torch.randn(1, K, generator=gen).to(torch.bfloat16)
        want = res + G.gemv(xb, w1, s1, 0, None, torch.float32)
        torch.testing.assert_close(G.gemv(xb, w1, s1, 0, None, torch.float32, into=res.clone()), want, rtol=1e-6, atol=1e-5)
        row = G.gemv(xb, w1, s1, 0, None, torch.float32, into=res, then_norm=(nw, 1e-5))
        torch.testing.assert_close(res, want, rtol=1e-6, atol=1e-5)  # u: within an ulp (the interpreter rounds to bf16 its own way)
        torch.testing.assert_close(row.u, (res * nw.float()).to(torch.bfloat16), rtol=2**-7, atol=0)
        assert abs(row.parts.sum().item() / res.pow(2).sum().item() - 1) < 1e-5, fmt
        got = G.gemv(row.u, w2, s2, 0, None, torch.float32, norm=row)
        inv_rms = torch.rsqrt(res.double().pow(2).mean() + 1e-5)
        tol = 1e-4 if fmt2 == "int4" else 1e-5
        assert rel_err(got, float64_product(row.u.double() * inv_rms, w2, s2, 0, None)) < tol, (fmt, fmt2)
        exact = float64_product(want.double() * inv_rms * nw.double(), w2, s2, 0, None)
        assert rel_err(got, exact) < 2**-7, (fmt, fmt2)  # u's one rounding to bf16, as the norm's kernel rounds
    k = w.shape[1] * 8  # the last case's weight: up to 4 rows of x
    assert G.gemv_ok(torch.randn(4, k), w) and not G.gemv_ok(torch.randn(5, k), w)
    w, s = rand_weight(gen, (H + 2 * KVH) * D, 128, "int4", 64)
    x = torch.randn(1, 128, generator=gen).to(torch.bfloat16)
    caches = [torch.zeros(4, KVH, bs, D, dtype=torch.float16) for _ in range(4)]
    pos, slots = torch.tensor([7]), torch.tensor([9])
    got = G.gemv(x, w, s, 0, None, torch.float32, rope=G.RopeCache(pos, slots, cs, caches[0], caches[1], H, KVH))
    want = G.gemv(x, w, s, 0, None, torch.float32)
    rotary.rope_and_cache_ref(want, pos, slots, cs, caches[2], caches[3], H, KVH)
    assert rel_err(got, want.double()) < 1e-6
    for a, b in zip(caches[:2], caches[2:]):
        assert torch.allclose(a.float(), b.float(), rtol=2e-3, atol=1e-3)
    # an int4 layer's 1-4-row products are this kernel's, bit for bit
    q, sc, z = formats.quantize_w4(torch.randn(64, 256, generator=gen), 128)
    g4 = dict(zip(("g4_weight", "g4_sz"), rand_weight(gen, 64, 256, "int4", 128)))
    canon = dict(qweight=q, scales=sc, zeros=z, **g4)
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16)
    assert torch.equal(W4(torch.bfloat16).apply(canon, x, None, torch.float32), G.gemv(x, g4["g4_weight"], g4["g4_sz"], 0, None, torch.float32))
    from llmserve.kernels import switches
    switches.current.gemv = False  # off: the tensor-core kernels, a different summation order
    assert not G.gemv_ok(x[:1], w) and not G.gemv_ok(x[:1], g4["g4_weight"])
    print("ok", len(cases))
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_under_interpreter(fresh_seed):
    script = INTERP_SCRIPT.format(tests=os.path.dirname(__file__), seed=fresh_seed)
    triton_interpreter.run_script(script, fresh_seed)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,block", [("int8", 0), ("fp8", 0), ("fp8", 128), ("bf16", 0), ("int4", 0)])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 14336), (1000, 1152)])
def test_gpu_against_float64(fmt, block, N, K, fresh_seed):
    from llmserve.kernels.gemv import gemv

    if fmt == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 conversions need sm_89+")
    gen = torch.Generator().manual_seed(fresh_seed)
    w, s = rand_weight(gen, N, K, fmt, block, "cuda")
    x = torch.randn(1, K, generator=gen).to(torch.bfloat16).cuda()
    bias = torch.randn(N, generator=gen).to(torch.bfloat16).cuda()
    ref = float64_product(x, w, s, block, bias)
    y = gemv(x, w, s, block, bias, torch.float32)
    assert rel_err(y, ref) < 1e-5, f"seed {fresh_seed}"
    assert torch.equal(y, gemv(x, w, s, block, bias, torch.float32))  # no atomics: the same bits every run
    if fmt == "int4":  # 2-4 rows in one launch, each row its own product's bits
        xs = torch.randn(4, K, generator=gen).to(torch.bfloat16).cuda()
        ys = gemv(xs, w, s, 0, bias, torch.float32)
        assert rel_err(ys, float64_product(xs, w, s, 0, bias)) < 1e-5, f"seed {fresh_seed}"
        assert all(torch.equal(ys[i : i + 1], gemv(xs[i : i + 1], w, s, 0, bias, torch.float32)) for i in range(4))
    assert rel_err(gemv(x, w, s, block, bias, torch.bfloat16), ref) < 2**-7
    if block == 0 and N % 2 == 0:  # as gate | up rows: the SwiGLU in the epilogue gives the separate kernel's bits
        from llmserve.kernels.activation import swiglu

        want = swiglu(gemv(x, w, s, 0, None, torch.float32), torch.bfloat16)
        assert torch.equal(gemv(x, w, s, 0, None, torch.bfloat16, glu=True), want), f"seed {fresh_seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8", "bf16", "int4"])
@pytest.mark.parametrize("H,KVH", [(32, 8), (16, 4), (8, 1)])
def test_gpu_rope_epilogue_gives_rope_and_cache_bits(fmt, H, KVH, fresh_seed):
    import numpy as np

    from llmserve.kernels import rotary
    from llmserve.kernels.gemv import RopeCache, gemv

    if fmt == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 conversions need sm_89+")
    D, K, bs, f32 = 128, 4096, 64, torch.float32
    gen = torch.Generator().manual_seed(fresh_seed)
    w, s = rand_weight(gen, (H + 2 * KVH) * D, K, fmt, 0, "cuda")
    cs = rotary.rope_cos_sin(1.0 / 500000 ** (np.arange(0, D, 2) / D), 4096, "cuda")
    for pos, slot in [(0, 0), (1234, 777), (4095, -1)]:
        x = torch.randn(1, K, generator=gen).to(torch.bfloat16).cuda()
        p, sl = torch.tensor([pos], device="cuda"), torch.tensor([slot], device="cuda")
        caches = [torch.randn(16, KVH, bs, D, generator=gen).half().cuda() for _ in range(2)]
        mine = [c.clone() for c in caches]
        got = gemv(x, w, s, 0, None, f32, rope=RopeCache(p, sl, cs, mine[0], mine[1], H, KVH))
        want = gemv(x, w, s, 0, None, f32)
        rotary.rope_and_cache(want, p, sl, cs, caches[0], caches[1], H, KVH)
        assert torch.equal(got, want), f"seed {fresh_seed}"
        assert torch.equal(mine[0], caches[0]) and torch.equal(mine[1], caches[1]), f"seed {fresh_seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8", "bf16", "int4"])
def test_gpu_rows_added_in_and_the_norm_left_pending(fmt, fresh_seed):
    """`into`: the row added into the residual in place; `then_norm`: the RMSNorm of the
    sum left pending, which the next product (`norm`) takes, against float64, with each epilogue (SwiGLU's and
    rotary's as the separate kernels give them from the product's rows)."""
    import numpy as np

    from llmserve.kernels import rotary
    from llmserve.kernels.activation import swiglu
    from llmserve.kernels.gemv import RopeCache, gemv

    if fmt == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 conversions need sm_89+")
    H, KVH, D, K, f32 = 32, 8, 128, 4096, torch.float32
    gen = torch.Generator().manual_seed(fresh_seed)
    o, qkv = rand_weight(gen, K, H * D, fmt, 0, "cuda"), rand_weight(gen, (H + 2 * KVH) * D, K, fmt, 0, "cuda")
    res = (torch.randn(1, K, generator=gen) * 4).cuda()
    nw = (1 + 0.1 * torch.randn(K, generator=gen)).to(torch.bfloat16).cuda()
    x = torch.randn(1, H * D, generator=gen).to(torch.bfloat16).cuda()
    want = res + gemv(x, *o, 0, None, f32)  # (the kernel may fuse its scale and the add into one fma)
    torch.testing.assert_close(gemv(x, *o, 0, None, f32, into=res.clone()), want, rtol=1e-6, atol=1e-5)
    row = gemv(x, *o, 0, None, f32, into=res, then_norm=(nw, 1e-6))
    torch.testing.assert_close(res, want, rtol=1e-6, atol=1e-5)
    assert torch.equal(row.u, (res * nw.float()).to(torch.bfloat16)), f"seed {fresh_seed}"
    assert abs(row.parts.double().sum().item() / res.double().pow(2).sum().item() - 1) < 1e-6
    rows = gemv(row.u, *qkv, 0, None, f32, norm=row)
    inv_rms = torch.rsqrt(res.double().pow(2).mean() + 1e-6)
    tol = 1e-4 if fmt == "int4" else 1e-5  # (the 4-bit GEMV keeps ~13 bits of each q x, gemv4.py)
    assert rel_err(rows, float64_product(row.u.double() * inv_rms, *qkv, 0, None)) < tol, f"seed {fresh_seed}"
    assert torch.equal(gemv(row.u, *qkv, 0, None, torch.bfloat16, glu=True, norm=row), swiglu(rows, torch.bfloat16))
    cs = rotary.rope_cos_sin(1.0 / 500000 ** (np.arange(0, D, 2) / D), 4096, "cuda")
    p, sl = torch.tensor([1234], device="cuda"), torch.tensor([77], device="cuda")
    caches = [torch.zeros(16, KVH, 64, D, device="cuda", dtype=torch.float16) for _ in range(4)]
    got = gemv(row.u, *qkv, 0, None, f32, rope=RopeCache(p, sl, cs, caches[0], caches[1], H, KVH), norm=row)
    rotary.rope_and_cache(rows, p, sl, cs, caches[2], caches[3], H, KVH)
    assert torch.equal(got, rows) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_pdl_switch_and_where_it_applies():
    from llmserve.config import Config, ConfigError
    from llmserve.kernels import switches
    from llmserve.kernels.pdl import pdl_on

    for bad in ("pdl=2", "pdl=maybe"):
        with pytest.raises(ConfigError, match="LLMSERVE_KERNEL_SWITCHES='pdl="):
            Config.from_env({"LLMSERVE_KERNEL_SWITCHES": bad})
    assert switches.Switches().pdl and switches.parse("pdl=0").pdl is False
    assert not pdl_on(torch.zeros(1))  # off on the CPU (and under the interpreter: CPU tensors)


@pytest.mark.gpu
@pytest.mark.parametrize("norms", ["kernels", "in_products"])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "bf16", "int4"])
def test_gpu_pdl_chain_gives_the_same_bits(fmt, norms, monkeypatch, fresh_seed):
    """A layer's batch-1 chain (norm, qkv + rotary + cache, o, norm, gate_up + SwiGLU, down; or with the norms in
    qkv's and gate_up's products and o's and down's rows added into the residual: model.py's `Normed`) launched with
    PDL (kernels/pdl.py), eagerly and in a CUDA graph, gives the bits of the chain launched without it."""
    import numpy as np

    from llmserve.kernels import rotary
    from llmserve.kernels.gemv import RopeCache, gemv
    from llmserve.kernels.norm import rms_norm

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90+")
    H, KVH, D, K, F, bs, f32, bf16 = 32, 8, 128, 4096, 4096, 64, torch.float32, torch.bfloat16
    gen = torch.Generator().manual_seed(fresh_seed)
    qkv, o = rand_weight(gen, (H + 2 * KVH) * D, K, fmt, 0, "cuda"), rand_weight(gen, K, H * D, fmt, 0, "cuda")
    gate_up, down = rand_weight(gen, 2 * F, K, fmt, 0, "cuda"), rand_weight(gen, K, F, fmt, 0, "cuda")
    norms_w = [(1 + 0.1 * torch.randn(K, generator=gen)).to(bf16).cuda() for _ in range(2)]
    cs = rotary.rope_cos_sin(1.0 / 500000 ** (np.arange(0, D, 2) / D), 4096, "cuda")
    pos, slot = torch.tensor([1234], device="cuda"), torch.tensor([777], device="cuda")
    h0 = torch.randn(1, K, generator=gen).cuda()
    res0 = torch.randn(1, K, generator=gen).cuda()

    def chain(h, residual, kc, vc):
        if norms == "in_products":
            row = gemv(h.to(bf16), *o, 0, None, f32, into=residual, then_norm=(norms_w[0], 1e-5))
            for _ in range(3):
                rc = RopeCache(pos, slot, cs, kc, vc, H, KVH)
                q = gemv(row.u, *qkv, 0, None, f32, rope=rc, norm=row)
                row = gemv(q[:, : H * D].to(bf16), *o, 0, None, f32, into=residual, then_norm=(norms_w[1], 1e-5))
                g = gemv(row.u, *gate_up, 0, None, bf16, glu=True, norm=row)
                row = gemv(g, *down, 0, None, f32, into=residual, then_norm=(norms_w[0], 1e-5))
            return row.u
        for _ in range(3):
            x = rms_norm(h, norms_w[0], 1e-5, residual)
            q = gemv(x, *qkv, 0, None, f32, rope=RopeCache(pos, slot, cs, kc, vc, H, KVH))
            h = gemv(q[:, : H * D], *o, 0, None, f32)
            x = rms_norm(h, norms_w[1], 1e-5, residual)
            h = gemv(gemv(x, *gate_up, 0, None, bf16, glu=True), *down, 0, None, f32)
        return h

    def state():
        return h0.clone(), res0.clone(), torch.zeros(16, KVH, bs, D, device="cuda", dtype=torch.float16), torch.zeros(16, KVH, bs, D, device="cuda", dtype=torch.float16)  # fmt: skip

    assert_same_bits_with_pdl(monkeypatch, chain, state, f"seed {fresh_seed}")
