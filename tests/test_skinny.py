"""Products of 2-16 rows over bf16/fp16 weights (kernels/skinny.py): the kernel under Triton's interpreter (CPU, in a
subprocess: triton reads TRITON_INTERPRET at import) and on a GPU against float64, and that the unquantized layers and
the LM head give it their 2-16-row products."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
import triton_interpreter
from pdl_chain import assert_same_bits_with_pdl

from llmserve.kernels import HAS_TRITON


def float64_product(x, w, bias):
    y = x.double() @ w.double().t()
    return y + bias.double() if bias is not None else y


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


INTERP_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    from test_skinny import float64_product, rel_err
    from llmserve.kernels import skinny as S

    gen = torch.Generator().manual_seed({seed})
    # ragged N and K (the last program's rows, masked K), whole tiles, 1 to 16 rows, bias. fp16 only: Triton
    # 3.6's interpreter multiplies bf16 tiles in tl.dot as garbage (its numpy has no bf16); the GPU tests take bf16.
    cases = [(2, 70, 300), (5, 64, 256), (16, 96, 160), (1, 40, 64), (9, 33, 100)]
    dt = torch.float16
    for M, N, K in cases:
        w = torch.randn(N, K, generator=gen).to(dt)
        x = torch.randn(M, K, generator=gen).to(dt)
        bias = torch.randn(N, generator=gen).to(dt)
        for out, b, config in [(torch.float32, None, (16, 64, 4, 2)), (dt, bias, (32, 32, 4, 1))]:
            y = S.skinny(x, w, b, out, config=config)
            tol = 1e-5 if out == torch.float32 else 2**-7
            assert y.shape == (M, N) and y.dtype == out, (M, N, K)
            assert rel_err(y, float64_product(x, w, b)) < tol, (M, N, K, out)
    # gate | up rows with the SwiGLU in the epilogue, and qkv rows with the rotary embedding and each row's cache
    # write in it: the bits of the product, then the separate kernels' arithmetic (kernels/gemv.py's epilogues)
    for M, N, K, config in [(5, 96, 256, (16, 64, 4, 2)), (3, 70, 100, (32, 32, 4, 1))]:
        w = torch.randn(N, K, generator=gen).to(dt)
        x = torch.randn(M, K, generator=gen).to(dt)
        g, u = S.skinny(x, w, None, torch.float32, config=config).chunk(2, dim=-1)
        got = S.skinny(x, w, None, dt, config=config, glu=True)
        g, u = g.double(), u.double()
        assert got.shape == (M, N // 2) and rel_err(got, g * torch.sigmoid(g) * u) < 2**-10, (M, N, K)
    import numpy as np
    from llmserve.kernels import rotary
    from llmserve.kernels.gemv import RopeCache
    H, KVH, D, bs, K = 4, 2, 16, 8, 64
    cs = rotary.rope_cos_sin(1.0 / 10000 ** (np.arange(0, D, 2) / D), 64, "cpu")
    w = torch.randn((H + 2 * KVH) * D, K, generator=gen).to(dt)
    for M, config in [(5, (16, 32, 4, 2)), (2, (32, 64, 4, 1))]:
        x = torch.randn(M, K, generator=gen).to(dt)
        pos = torch.randint(0, 64, (M,), generator=gen)
        slots = torch.randperm(32, generator=gen)[:M]
        slots[M // 2] = -1  # a padding row: no cache write
        caches = [torch.zeros(4, KVH, bs, D, dtype=dt) for _ in range(4)]
        got = S.skinny(x, w, None, torch.float32, config=config, rope=RopeCache(pos, slots, cs, caches[0], caches[1], H, KVH))
        want = S.skinny(x, w, None, torch.float32, config=config)
        rotary.rope_and_cache_ref(want, pos, slots, cs, caches[2], caches[3], H, KVH)
        assert rel_err(got, want.double()) < 1e-6, M
        for a, b in zip(caches[:2], caches[2:]):
            assert torch.allclose(a.float(), b.float(), rtol=2e-3, atol=1e-3), M
            assert (a != 0).any(dim=(1, 3)).sum() == M - 1, M  # one slot written per row but the padding one
    print("ok", len(cases))
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernel_under_interpreter(fresh_seed):
    script = INTERP_SCRIPT.format(tests=os.path.dirname(__file__), seed=fresh_seed)
    triton_interpreter.run_script(script, fresh_seed)


def test_which_products_it_takes(monkeypatch):
    """2-16 rows of a bf16/fp16 weight in x's dtype, K contiguous; not one row (the GEMV's), 17, fp32 or int8
    weights, a transposed weight, or CPU tensors (no Triton there)."""
    from llmserve.kernels import skinny as S
    from llmserve.kernels import switches

    w = torch.zeros(64, 32, dtype=torch.bfloat16)
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    assert not S.skinny_ok(x, w)  # CPU: the caller's torch product
    if not torch.cuda.is_available() or not HAS_TRITON:
        return
    w, x = w.cuda(), x.cuda()
    assert S.skinny_ok(x, w) and S.skinny_ok(x[:2], w) and S.skinny_ok(torch.zeros(16, 32, dtype=w.dtype).cuda(), w)
    assert not S.skinny_ok(x[:1], w) and not S.skinny_ok(torch.zeros(17, 32, dtype=w.dtype).cuda(), w)
    assert not S.skinny_ok(x.float(), w.float()) and not S.skinny_ok(x, w.half())
    assert not S.skinny_ok(x, torch.zeros(32, 64, dtype=w.dtype).cuda().t())
    monkeypatch.setattr(switches.current, "skinny", False)  # its baseline: cuBLAS
    assert not S.skinny_ok(x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [2, 5, 16])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 14336), (1000, 1160)])
def test_gpu_against_float64(M, N, K, fresh_seed):
    from llmserve.kernels.skinny import skinny

    gen = torch.Generator().manual_seed(fresh_seed)
    w = torch.randn(N, K, generator=gen).to(torch.bfloat16).cuda()
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16).cuda()
    bias = torch.randn(N, generator=gen).to(torch.bfloat16).cuda()
    ref = float64_product(x, w, bias)
    y = skinny(x, w, bias, torch.float32)
    tol = 1e-5 * (K / 1024) ** 0.5  # the MMA's fp32 sum runs along K tile after tile (1.5e-5 seen at K = 14336)
    assert rel_err(y, ref) < tol, f"seed {fresh_seed}"
    assert torch.equal(y, skinny(x, w, bias, torch.float32))  # no atomics: the same bits every run
    assert rel_err(skinny(x, w, bias, torch.bfloat16), ref) < 2**-7
    for config in [(16, 128, 4, 3), (64, 64, 4, 5)]:  # other launches: the same product
        assert rel_err(skinny(x, w, bias, torch.float32, config=config), ref) < tol, config


@pytest.mark.gpu
def test_gpu_layers_and_lm_head_take_it(fresh_seed):
    """The dense method and the LM head give their 2-16-row products to the kernel (its bits), one row to the GEMV."""
    from llmserve.kernels import skinny as S
    from llmserve.layers.linear import Linear
    from llmserve.layers.quant.methods import LinearMethod

    gen = torch.Generator().manual_seed(fresh_seed)
    w = torch.randn(768, 512, generator=gen).to(torch.bfloat16).cuda()
    bias = torch.randn(768, generator=gen).to(torch.bfloat16).cuda()
    layer = Linear(LinearMethod(torch.bfloat16), {"weight": w}, bias)
    for M in (2, 7, 16):
        x = torch.randn(M, 512, generator=gen).to(torch.bfloat16).cuda()
        assert torch.equal(layer(x, torch.float32), S.skinny(x, w, bias, torch.float32)), M
    x = torch.randn(17, 512, generator=gen).to(torch.bfloat16).cuda()
    assert rel_err(layer(x, torch.float32), float64_product(x, w, bias)) < 1e-5  # cuBLAS


@pytest.mark.gpu
@pytest.mark.parametrize("M", [2, 5, 16])
@pytest.mark.parametrize("H,KVH", [(32, 8), (8, 1)])
def test_gpu_epilogues_give_the_separate_kernels_bits(M, H, KVH, fresh_seed):
    """gate_up's SwiGLU and qkv's rotary + cache write in the product's epilogue (the verification step's layers)
    give the bits of the product followed by kernels/activation.py's and rotary.py's kernels, each row a token at
    its own position and slot (one of them padding)."""
    import numpy as np

    from llmserve.kernels import rotary
    from llmserve.kernels.activation import swiglu
    from llmserve.kernels.gemv import RopeCache
    from llmserve.kernels.skinny import skinny

    D, K, F, bs, f32, bf16 = 128, 4096, 14336, 64, torch.float32, torch.bfloat16
    gen = torch.Generator().manual_seed(fresh_seed)
    x = torch.randn(M, K, generator=gen).to(bf16).cuda()
    gate_up = (torch.randn(2 * F, K, generator=gen) * 0.02).to(bf16).cuda()
    want = swiglu(skinny(x, gate_up, None, f32), bf16)
    assert torch.equal(skinny(x, gate_up, None, bf16, glu=True), want), f"seed {fresh_seed}"
    qkv = (torch.randn((H + 2 * KVH) * D, K, generator=gen) * 0.02).to(bf16).cuda()
    cs = rotary.rope_cos_sin(1.0 / 500000 ** (np.arange(0, D, 2) / D), 4096, "cuda")
    pos = torch.randint(0, 4096, (M,), generator=gen).cuda()
    slot = torch.randperm(16 * bs, generator=gen)[:M].cuda()
    slot[M // 2] = -1
    caches = [torch.randn(16, KVH, bs, D, generator=gen).half().cuda() for _ in range(2)]
    mine = [c.clone() for c in caches]
    got = skinny(x, qkv, None, f32, rope=RopeCache(pos, slot, cs, mine[0], mine[1], H, KVH))
    want = skinny(x, qkv, None, f32)
    rotary.rope_and_cache(want, pos, slot, cs, caches[0], caches[1], H, KVH)
    assert torch.equal(got, want), f"seed {fresh_seed}"
    assert torch.equal(mine[0], caches[0]) and torch.equal(mine[1], caches[1]), f"seed {fresh_seed}"


@pytest.mark.gpu
def test_gpu_pdl_verification_chain_gives_the_same_bits(monkeypatch, fresh_seed):
    """A layer's chain at 5 rows (a k = 4 verification step: norm, skinny qkv with rotary + cache, q's cast in
    attention's place (torch's, launched without PDL), skinny o, norm, skinny gate_up with SwiGLU, skinny down), its
    kernels launched with PDL (kernels/pdl.py), eagerly and in a CUDA graph, gives the bits of the chain without
    PDL."""
    import numpy as np

    from llmserve.kernels import rotary
    from llmserve.kernels.gemv import RopeCache
    from llmserve.kernels.norm import rms_norm
    from llmserve.kernels.skinny import skinny

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90+")
    H, KVH, D, K, F, bs, f32, bf16 = 32, 8, 128, 4096, 4096, 64, torch.float32, torch.bfloat16
    gen = torch.Generator().manual_seed(fresh_seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(bf16).cuda()

    qkv, o, gate_up, down = rand((H + 2 * KVH) * D, K), rand(K, H * D), rand(2 * F, K), rand(K, F)
    norms = [(1 + 0.1 * torch.randn(K, generator=gen)).to(bf16).cuda() for _ in range(2)]
    cs = rotary.rope_cos_sin(1.0 / 500000 ** (np.arange(0, D, 2) / D), 4096, "cuda")
    pos = torch.arange(1230, 1235, device="cuda")
    slot = torch.tensor([700, 701, 702, -1, 777], device="cuda")
    h0, res0 = torch.randn(5, K, generator=gen).cuda(), torch.randn(5, K, generator=gen).cuda()

    def chain(h, residual, kc, vc):
        for _ in range(3):
            rc = RopeCache(pos, slot, cs, kc, vc, H, KVH)
            q = skinny(rms_norm(h, norms[0], 1e-5, residual), qkv, None, f32, rope=rc)
            h = skinny(q[:, : H * D].to(bf16), o, None, f32)
            h = skinny(skinny(rms_norm(h, norms[1], 1e-5, residual), gate_up, None, bf16, glu=True), down, None, f32)
        return h

    def state():
        return h0.clone(), res0.clone(), *(torch.zeros(16, KVH, bs, D, device="cuda", dtype=torch.float16) for _ in range(2))  # fmt: skip

    assert_same_bits_with_pdl(monkeypatch, chain, state, f"seed {fresh_seed}")
