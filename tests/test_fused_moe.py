"""The fused routed experts (kernels/fused_moe.py, kernels/moe_align.py, layers/moe.py's stacking and dispatch).

CPU: moe_align (plain torch, graph-safe) against a Python loop over the experts, exactly.

Interpreter (TRITON_INTERPRET=1, in a subprocess): fused_moe against an independent token-by-token loop in
float64 over the same weights, fp32 activations (the interpreter's tl.dot on bf16 is not bf16 arithmetic: see
test_fp8_gemm.py), T in (1, 3, 40) at E=8 top-2 and E=16 top-4, some experts chosen by no token; dense fp32
weights and E4M3 with 128 x 128 block scales against their exact dequantization. Tolerance 1e-5 of max|ref|:
everything is fp32 (the E4M3 values decode exactly; the block scale multiplies an fp32 partial product), so
only the summation order differs from the float64 reference (K <= 384 terms: ~1e-7 relative each).
Then MoE itself: stacked experts are views of one tensor, nbytes unchanged, __call__ (fused under the
interpreter) equal to its expert-by-expert loop.

GPU (`gpu` marker): MoE.__call__'s fused path inside a CUDA graph capture, replayed on new inputs, against the
loop (`ref` switch): bf16 within 2e-2 of max|ref| (both round h = silu(gate) * up to bf16, and tie-breaking
of those roundings differs where the fp32 sums differ in their last bits: 2^-8 relative on a few elements of
h, through the down projection and a sum of k terms); FP8 blocks within 2e-2 against the loop over the
dequantized bf16 weights (our kernel keeps the activations bf16, the loop's cuBLAS the same).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import triton_interpreter

from llmserve.kernels.fp8_gemm import fp8_dequant_ref
from llmserve.kernels.moe_align import moe_align, moe_align_ref
from llmserve.layers.deepseek_config import MoEConfig
from llmserve.layers.linear import Linear
from llmserve.layers.moe import MLP, MoE, route, stack_experts
from llmserve.layers.quant.methods import FP8, LinearMethod

HERE = Path(__file__).resolve().parent
FP8_DT = torch.float8_e4m3fn


def rand_ids(T: int, E: int, k: int, g: torch.Generator, unused: int = 0) -> torch.Tensor:
    """[T, k] distinct experts per token, drawn from the first E - unused experts (the rest: chosen by none)."""
    pool = E - unused
    return torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k).long()


@pytest.mark.parametrize("E,k", [(8, 2), (16, 4), (256, 8)])
@pytest.mark.parametrize("T", [0, 1, 3, 40, 300])
@pytest.mark.parametrize("block_m", [16, 64])
def test_align_matches_reference(fresh_seed, E, k, T, block_m):
    g = torch.Generator().manual_seed(fresh_seed)
    ids = rand_ids(T, E, k, g, unused=E // 4)
    got, want = moe_align(ids, E, block_m), moe_align_ref(ids, E, block_m)
    assert torch.equal(got.pairs, want.pairs) and torch.equal(got.block_expert, want.block_expert)
    real = got.pairs[got.pairs < T * k]
    assert torch.equal(real.sort().values, torch.arange(T * k, dtype=torch.int32))  # every pair once


# ---- weights and the float64 reference ----


def rand_weights(E: int, H: int, inter: int, fp8: bool, g: torch.Generator):
    """(w1 [E, 2I, H], w2 [E, H, I], s1, s2, w1 dense, w2 dense): gaussian, FP8 with random block scales."""
    w1 = torch.randn(E, 2 * inter, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter**0.5
    if not fp8:
        return w1, w2, None, None, w1, w2
    out = []
    for w in (w1, w2):
        s = torch.rand(E, w.shape[1] // 128, w.shape[2] // 128, generator=g) * 2e-3 + 1e-3
        q = (w / s.repeat_interleave(128, 1).repeat_interleave(128, 2)).clamp(-448, 448).to(FP8_DT)
        out.append((q, s))
    (q1, s1), (q2, s2) = out
    deq = [torch.stack([fp8_dequant_ref(q[e], s[e], 128) for e in range(E)]) for q, s in out]
    return q1, q2, s1, s2, *deq


def reference(x, weights, ids, w1, w2) -> torch.Tensor:
    """Token by token, slot by slot, in float64."""
    x, w1, w2 = x.double(), w1.double(), w2.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            gu = w1[e] @ x[t]
            out[t] += float(weights[t, s]) * (w2[e] @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ---- under the interpreter ----


WIDE = dict(BLOCK_M=64, BLOCK_N1=64, BLOCK_N2=128, BLOCK_K=64, num_warps=4, num_stages=2)  # prefill's shape


def _interp_kernel(seed: int) -> None:
    from llmserve.kernels.fused_moe import fused_moe

    g = torch.Generator().manual_seed(seed)
    H, inter = 384, 128
    for fp8 in (False, True):
        for E, k in ((8, 2), (16, 4)):
            w1, w2, s1, s2, d1, d2 = rand_weights(E, H, inter, fp8, g)
            for T in (1, 3, 40):
                x = torch.randn(T, H, generator=g)
                ids = rand_ids(T, E, k, g, unused=2)
                weights = torch.rand(T, k, generator=g) + 0.1
                ref = reference(x, weights, ids, d1, d2)
                for cfg in [None] if T < 40 else [None, WIDE]:
                    y = fused_moe(x, weights, ids, w1, w2, s1, s2, cfg)
                    assert y.dtype == torch.float32 and y.shape == (T, H)
                    assert rel_err(y, ref) <= 1e-5, (fp8, E, k, T, cfg, rel_err(y, ref))


def make_moe(E: int, k: int, H: int, inter: int, fp8: bool, g: torch.Generator, device="cpu") -> tuple[MoE, MoE]:
    """(the MoE, the same over dense float32 copies of its experts' weights: FP8 dequantized)."""
    cfg = MoEConfig(E, 0, k, inter, "sigmoid", "noaux_tc", 1, 1, True, 2.5, 0)
    w1, w2, s1, s2, d1, d2 = rand_weights(E, H, inter, fp8, g)
    dense = LinearMethod(torch.float32)
    method = FP8(torch.float32, 128) if fp8 else dense

    def lin(m, w, s):
        return Linear(m, {"weight": w.to(device)} | ({"scale": s.to(device)} if s is not None else {}))

    experts = [
        MLP(lin(method, w1[e], s1[e] if fp8 else None), lin(method, w2[e], s2[e] if fp8 else None)) for e in range(E)
    ]
    plain = [MLP(lin(dense, d1[e], None), lin(dense, d2[e], None)) for e in range(E)]
    gate = torch.randn(E, H, generator=g).to(device)
    bias = (torch.randn(E, generator=g) * 0.1).to(device)
    return MoE(cfg, gate, bias, experts, None, None), MoE(cfg, gate, bias, plain, None, None)


def _interp_layer(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for fp8 in (False, True):
        moe, plain = make_moe(8, 2, 256, 128, fp8, g)
        before = moe.nbytes
        moe.stacked = stack_experts(moe.experts)
        assert moe.stacked is not None and moe.nbytes == before
        for e, m in enumerate(moe.experts):  # views of the stack: one copy in memory
            assert m.gate_up.w["weight"].data_ptr() == moe.stacked.w1[e].data_ptr()
            assert m.down.w["weight"].data_ptr() == moe.stacked.w2[e].data_ptr()
        for T in (1, 40):
            x = torch.randn(T, 256, generator=g)
            weights, ids = route(x.float() @ moe.gate.T, moe.cfg, moe.bias)
            y = moe(x, torch.float32)  # fused: use_triton holds under the interpreter
            ref = plain._routed_loop(x, weights, ids)
            assert rel_err(y, ref.double()) <= 1e-5, (fp8, T, rel_err(y, ref.double()))


def _run(name: str, seed: int) -> None:
    script = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_fused_moe as t; t.{name}({seed}); print('ok')"
    triton_interpreter.run_script(script, seed)


needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (the interpreter runs the kernels on a CPU)"
)


@needs_triton
def test_interpreted_fused_moe(fresh_seed):
    _run("_interp_kernel", fresh_seed)


@needs_triton
def test_interpreted_moe_layer(fresh_seed):
    _run("_interp_layer", fresh_seed)


def test_unstackable_format_keeps_the_loop():
    g = torch.Generator().manual_seed(0)
    moe, _ = make_moe(4, 2, 128, 128, False, g)
    moe.experts[1].down.bias = torch.zeros(128)  # one expert unlike the rest
    assert stack_experts(moe.experts) is None


# ---- GPU: the fused path inside a CUDA graph ----


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_fused_in_cuda_graph(fresh_seed, fp8):
    from llmserve.kernels import switches

    g = torch.Generator().manual_seed(fresh_seed)
    E, k, H, inter, T = 16, 4, 512, 256, 40
    moe, plain = make_moe(E, k, H, inter, fp8, g, "cuda")
    if not fp8:  # the model's dtype: bf16 weights
        for m in moe.experts:
            for lin in (m.gate_up, m.down):
                lin.w["weight"] = lin.w["weight"].bfloat16()
    for m in plain.experts:
        for lin in (m.gate_up, m.down):
            lin.w["weight"] = lin.w["weight"].bfloat16()
    moe.stacked = stack_experts(moe.experts)
    assert moe.stacked is not None
    x = torch.randn(T, H, generator=g).bfloat16().cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compiles) outside the capture
        moe(x, torch.float32)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe(x, torch.float32)
    for _ in range(2):
        x.copy_(torch.randn(T, H, generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        switches.current.ref = True  # the loop
        ref = (plain if fp8 else moe)(x, torch.float32)
        switches.current.ref = False
        assert rel_err(y, ref.double()) <= 2e-2, rel_err(y, ref.double())
