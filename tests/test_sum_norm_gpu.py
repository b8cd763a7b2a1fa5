"""The fused sum over ranks + residual + RMSNorm (kernels/sum_norm.py) on two real GPUs over NCCL.

Each rank gets fresh random partials; the reference is the float64 sum of every rank's partial (gathered
by NCCL), added to the residual, normalized in float64. Checked eagerly over rows of 1 to 64 (both
halves of the buffer, the epochs of rows that skip calls) and replayed in a CUDA graph with new data,
and every rank must get the same bits. Then batch-1 row-parallel GEMVs (bf16, int8 and int4 weights) that push
their rows into the fused sum themselves (TensorParallel.row_parallel): the same bits as the GEMV's row
read back by the sum kernel, eagerly and in a CUDA graph. Needs two CUDA devices (skipped otherwise; CI
has none).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

N = 4096


def _reference(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor, eps: float, group) -> tuple:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    s = res.double() + sum(p.double() for p in parts)
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return s, y


def _rank(rank: int, world: int, port: int, q) -> None:
    import torch.distributed as dist

    from llmserve.layers.parallel import TensorParallel, with_one_shot

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    tp = with_one_shot(TensorParallel(rank, world, dist.group.WORLD))
    out: dict = {"rank": rank, "fused": tp.fused_norm is not None, "errors": [], "same": [], "pushed": [], "equal": []}
    if tp.fused_norm is not None:
        gen = torch.Generator("cuda").manual_seed(100 + rank)
        w = torch.rand(N, device="cuda", generator=torch.Generator("cuda").manual_seed(7)).to(torch.bfloat16)
        res_gen = torch.Generator("cuda").manual_seed(5)  # the residual is the same on every rank

        def check(got, got_res, x, res0):
            s, y = _reference(x, res0, w, 1e-5, dist.group.WORLD)
            out["errors"].append(
                ((got_res.double() - s).abs().max().item(), (got.double() - y).abs().max().item(), y.abs().max().item())
            )
            mine = torch.cat([got.float(), got_res], 1)
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine, group=dist.group.WORLD)
            out["same"].append(all(torch.equal(e, mine) for e in every))

        for rows in (1, 2, 64, 5, 1, 33, 64, 1):
            x = torch.randn(rows, N, device="cuda", generator=gen)
            res0 = torch.randn(rows, N, device="cuda", generator=res_gen)
            got_res = res0.clone()
            got = tp.sum_norm(x, w, 1e-5, got_res)
            check(got, got_res, x, res0)
        # A CUDA graph of two sums in a row (as a layer has), replayed on new data.
        rows = 8
        sx, sres = torch.zeros(rows, N, device="cuda"), torch.zeros(rows, N, device="cuda")
        sy = torch.zeros(rows, N, device="cuda")
        tp.sum_norm(sx, w, 1e-5, sres.clone())  # warm-up outside the capture (compiles the kernel)
        g = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            a = tp.sum_norm(sx, w, 1e-5, sres)
            b = tp.sum_norm(sy, w, 1e-5, sres)
        for _ in range(3):
            x1 = torch.randn(rows, N, device="cuda", generator=gen)
            x2 = torch.randn(rows, N, device="cuda", generator=gen)
            res0 = torch.randn(rows, N, device="cuda", generator=res_gen)
            sx.copy_(x1)
            sy.copy_(x2)
            sres.copy_(res0)
            g.replay()
            torch.cuda.synchronize()
            s1, y1 = _reference(x1, res0, w, 1e-5, dist.group.WORLD)
            s2, y2 = _reference(x2, s1.float(), w, 1e-5, dist.group.WORLD)
            out["errors"].append((0.0, (a.double() - y1).abs().max().item(), y1.abs().max().item()))
            out["errors"].append(
                ((sres.double() - s2).abs().max().item(), (b.double() - y2).abs().max().item(), y2.abs().max().item())
            )
        _pushed(tp, w, gen, res_gen, check, out)
    q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def _pushed(tp, w, gen, res_gen, check, out) -> None:
    from llmserve.kernels.sum_norm import Pushed
    from llmserve.layers.linear import Linear
    from llmserve.layers.quant import formats
    from llmserve.layers.quant.methods import W4, W8, LinearMethod

    K, f32 = 1024, torch.float32
    weight = (torch.randn(N, K, device="cuda", generator=gen) / 32).to(torch.bfloat16)
    qweight, scale = formats.quantize_w8(weight)
    q4, s4, z4 = formats.quantize_w4(weight.float(), 128)
    m4 = W4(torch.bfloat16)
    w4 = m4.finish(Linear(m4, {"qweight": q4, "scales": s4, "zeros": z4}))
    assert "g4_weight" in w4.w  # the 4-bit GEMV's operands: its push epilogue (kernels/gemv4.py)
    layers = [Linear(LinearMethod(torch.bfloat16), {"weight": weight}), Linear(W8(torch.bfloat16), {"qweight": qweight, "scale": scale}), w4]  # fmt: skip
    for lin in layers * 2:
        x = torch.randn(1, K, device="cuda", generator=gen).to(torch.bfloat16)
        res0 = torch.randn(1, N, device="cuda", generator=res_gen)
        pushed = tp.row_parallel(lin, x, f32)
        out["pushed"].append(isinstance(pushed, Pushed))
        got_res, want_res = res0.clone(), res0.clone()
        got = tp.sum_norm(pushed, w, 1e-5, got_res)
        h = lin(x, f32)
        want = tp.sum_norm(h, w, 1e-5, want_res)  # the row read back by the sum kernel
        out["equal"].append(torch.equal(got, want) and torch.equal(got_res, want_res))
        check(got, got_res, h, res0)
    # A layer's two pushed sums in a CUDA graph (o, then down), replayed on new data.
    sx, sres = torch.zeros(1, K, device="cuda", dtype=torch.bfloat16), torch.zeros(1, N, device="cuda")
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        a = tp.sum_norm(tp.row_parallel(layers[0], sx, f32), w, 1e-5, sres)
        b = tp.sum_norm(tp.row_parallel(layers[1], sx, f32), w, 1e-5, sres)
        c = tp.sum_norm(tp.row_parallel(layers[2], sx, f32), w, 1e-5, sres)
    for _ in range(3):
        x = torch.randn(1, K, device="cuda", generator=gen).to(torch.bfloat16)
        res0 = torch.randn(1, N, device="cuda", generator=res_gen)
        sx.copy_(x)
        sres.copy_(res0)
        g.replay()
        torch.cuda.synchronize()
        want_res = res0.clone()
        want_a = tp.sum_norm(layers[0](x, f32), w, 1e-5, want_res)
        want_b = tp.sum_norm(layers[1](x, f32), w, 1e-5, want_res)
        want_c = tp.sum_norm(layers[2](x, f32), w, 1e-5, want_res)
        same = torch.equal(a, want_a) and torch.equal(b, want_b) and torch.equal(c, want_c)
        out["equal"].append(same and torch.equal(sres, want_res))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fused_sum_norm_matches_the_float64_reference_on_two_gpus():
    import torch.multiprocessing as mp

    from llmserve.serving.testing import free_ports

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_ports(1)[0]
    procs = [ctx.Process(target=_rank, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for r in results:
        assert r["fused"], "the fused kernel failed its start-up check"
        assert all(r["same"]), "ranks got different bits"
        assert len(r["pushed"]) == 6 and all(r["pushed"]), "a batch-1 GEMV did not push its row"
        assert len(r["equal"]) == 9 and all(r["equal"]), "a pushed row summed to other bits than the row read back"
        for res_err, y_err, scale in r["errors"]:
            assert res_err < 1e-4  # fp32 sums of O(1) values
            assert y_err < 2e-2 * max(1.0, scale)  # bf16 output
