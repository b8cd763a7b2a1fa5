"""MLA's absorbed decode kernel (kernels/mla_decode.py) and its use in layers/mla.py.

Interpreter (CPU, TRITON_INTERPRET=1 in a subprocess; skipped with the reason when the interpreter is broken):
the kernel against layers/mla.py's torch `latent_attention`, chunk by chunk, on fresh random inputs: block
tables of shuffled (non-contiguous) blocks, ragged contexts (1, lengths off the block size, 0 as a CUDA graph's
padding), 1 to 8 queries a chunk, one head block and several (a forced small BLOCK_H, heads not a multiple of
it), split-K off and on (several splits a chunk, splits past a short chunk's count). Then `paged_mla_attention`
with the kernel against its torch path on a mixed step (decode, verification-sized and long chunks).

Tolerances, on max |out - ref| over values ~N(0, 1):
- fp32 cache: the same products in another summation order: 1e-4.
- fp16 cache: the kernel rounds q_lat (the reference gets the rounded q too) and the softmax weights p to fp16
  (2^-11 relative each, fp32 accumulation), so |out - ref| <= sum_k |dp_k| |v_k| <= 2^-11 max |v|: 2^-10 max |v|.
- GPU, bf16 (2^-8 relative): the kernel with its rounding of p: 2^-7 max |v|; `paged_mla_attention` against the
  fp32 torch path, with q_lat, the output and the W_uk / W_uv products also rounded to bf16: 3e-2 relative to the
  output's max.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import triton_interpreter

from llmserve.kernels import switches
from llmserve.kernels.attention import AttnMeta
from llmserve.kernels.mla_decode import Launch, launch_shape
from llmserve.layers.mla import kernel_q_tile, latent_attention, paged_mla_attention

HERE = Path(__file__).resolve().parent
SCALE = 0.15


def make_step(g, heads, L, R, lens, q_lens, bs, dtype, device="cpu"):
    """q_lat [T, H, L + R] (float32, values of `dtype`), a cache of shuffled blocks and the step's AttnMeta."""
    per = [-(-n // bs) for n in lens]
    nb = sum(per) + 3
    cache = torch.randn(nb, 1, bs, L + R, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(len(lens), max(per + [1]) + 2, dtype=torch.int32)  # wider than needed, as the runner's
    at = 0
    for b, m in enumerate(per):
        bt[b, :m] = perm[at : at + m]
        at += m
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), heads, L + R, generator=g).to(dtype).float()
    meta = AttnMeta(cu, torch.tensor(lens, dtype=torch.int32), bt, None, None, 0)
    return q, cache, meta


def reference(q, cache, meta, L):
    """latent_attention chunk by chunk (float32); zeros for a chunk without context."""
    bs = cache.shape[2]
    out = torch.zeros(q.shape[0], q.shape[1], L)
    cu, lens = meta.cu_q.tolist(), meta.seq_lens.tolist()
    for b, n in enumerate(lens):
        q0, q1 = cu[b], cu[b + 1]
        if n and q1 > q0:
            pos = torch.arange(n)
            rows = cache[meta.block_tables[b, pos // bs].long(), 0, pos % bs].float()
            out[q0:q1] = latent_attention(q[q0:q1], rows, torch.arange(n - (q1 - q0), n), SCALE, L)
    return out.to(q.device)


CASES = [  # heads, L, R, contexts, queries a chunk, block size, launch (None: the kernel's), splits
    (4, 32, 16, [1, 37, 64, 5, 0], [1, 1, 1, 1, 1], 16, None, (1, 256)),
    (4, 32, 16, [1, 37, 64, 5, 0], [1, 1, 1, 1, 1], 16, None, (4, 16)),
    (16, 64, 16, [130, 3, 17], [1, 1, 1], 16, None, (3, 32)),
    (10, 32, 8, [70, 9, 1], [1, 1, 1], 8, Launch(4, 1, 16, 4, 1), (1, 256)),  # 3 head blocks, padded rope
    (10, 32, 8, [70, 9, 1], [1, 1, 1], 8, Launch(4, 1, 16, 4, 1), (4, 16)),
    (6, 32, 16, [9, 70, 4, 40], [8, 3, 4, 1], 16, None, (3, 16)),  # verification-sized chunks, causal
    (20, 32, 16, [33, 12], [5, 2], 16, None, (2, 16)),  # Q_TILE 8: block_h 8, 3 head blocks
]


def _interp_kernel(seed: int) -> None:
    from llmserve.kernels.mla_decode import mla_decode

    g = torch.Generator().manual_seed(seed)
    for i, (H, L, R, lens, q_lens, bs, shape, splits) in enumerate(CASES):
        for dtype in (torch.float32, torch.float16):
            q, cache, meta = make_step(g, H, L, R, lens, q_lens, bs, dtype)
            out = mla_decode(q, cache, meta, SCALE, L, max(q_lens), torch.float32, splits, shape)
            ref = reference(q, cache, meta, L)
            vmax = cache[..., :L].float().abs().max().item()
            tol = 1e-4 if dtype == torch.float32 else 2**-10 * vmax
            err = (out - ref).abs().max().item()
            assert err <= tol, (i, dtype, err, tol)


def _interp_layer(seed: int) -> None:
    """paged_mla_attention on the kernel against its torch path (the `ref` switch) on a mixed step."""
    g = torch.Generator().manual_seed(seed)
    H, nope, L, R, v = 4, 16, 32, 16, 12
    lens, q_lens = [5, 40, 23, 1, 30], [1, 1, 3, 1, 12]  # the last: longer than ABSORB_MAX_Q (expanded)
    _, cache, meta = make_step(g, H, L, R, lens, q_lens, 16, torch.float32)
    T = sum(q_lens)
    q_nope, q_rope = torch.randn(T, H, nope, generator=g), torch.randn(T, H, R, generator=g)
    w_uk, w_uv = torch.randn(H, nope, L, generator=g) * 0.3, torch.randn(H, v, L, generator=g) * 0.3
    for absorb in (8, 2, 0):
        got = paged_mla_attention(q_nope, q_rope, cache, meta, w_uk, w_uv, SCALE, absorb)
        switches.current.ref = True
        want = paged_mla_attention(q_nope, q_rope, cache, meta, w_uk, w_uv, SCALE, absorb)
        switches.current.ref = False
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item(), absorb


def _interp_store_rows(seed: int) -> None:
    """The latent cache's write (kernels/cache_rows.py) against its torch form: slots < 0 write nothing."""
    from llmserve.kernels.cache_rows import store_rows, store_rows_ref

    g = torch.Generator().manual_seed(seed)
    T, D, blocks, bs = 23, 40, 9, 4
    rows = torch.randn(T, D, generator=g)
    slots = torch.randperm(blocks * bs, generator=g)[:T].int()
    slots[torch.rand(T, generator=g) < 0.3] = -1
    for dtype in (torch.float32, torch.float16):
        base = torch.randn(blocks, 1, bs, D, generator=g).to(dtype)
        got, want = base.clone(), base.clone()
        store_rows(rows, slots, got)
        store_rows_ref(rows, slots, want)
        assert torch.equal(got, want), dtype


def _run_interpreted(name: str, seed: int) -> None:
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_mla_decode as t; t.{name}({seed}); print('ok')"
    triton_interpreter.run_script(code, seed)


def test_interpreted_kernel(fresh_seed):
    pytest.importorskip("triton")
    _run_interpreted("_interp_kernel", fresh_seed)


def test_interpreted_layer(fresh_seed):
    pytest.importorskip("triton")
    _run_interpreted("_interp_layer", fresh_seed)


def test_interpreted_store_rows(fresh_seed):
    pytest.importorskip("triton")
    _run_interpreted("_interp_store_rows", fresh_seed)


def test_launch_shapes():
    """At least 16 rows a program (tl.dot), at most 64; V3's 128 heads in two head blocks, V2-Lite's in one."""
    assert launch_shape(128, 1).block_h == 64 and launch_shape(16, 1).block_h == 16
    for heads in (1, 3, 16, 20, 128):
        for q in range(1, 9):
            s = launch_shape(heads, q)
            assert 16 <= s.block_h * s.q_tile <= 64 and s.q_tile >= q, (heads, q, s)


def test_q_tile_from_shapes_without_sync():
    """A decode step (one query a chunk) needs no look at cu_q; a step with a long chunk names it."""
    meta = AttnMeta(torch.tensor([0, 1, 2, 3]), torch.tensor([5, 6, 7]), torch.zeros(3, 1), None, None, 0)
    meta.cu_q = None  # would fail if read
    assert kernel_q_tile(3, meta, 8) == (1, [])
    meta.cu_q = torch.tensor([0, 1, 13, 16])
    assert kernel_q_tile(16, meta, 8) == (3, [1])


# ---- GPU ----


def _gpu_step(H, lens, q_lens, g):
    q, cache, meta = make_step(g, H, 512, 64, lens, q_lens, 64, torch.bfloat16)
    meta = AttnMeta(*(t.cuda() for t in (meta.cu_q, meta.seq_lens, meta.block_tables)), None, None, 0)
    return q.cuda().bfloat16(), cache.cuda(), meta


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_kernel_in_cuda_graph(heads, fresh_seed):
    """Captured once, replayed over new contexts and block tables written into the static inputs."""
    from llmserve.kernels.mla_decode import mla_decode

    g = torch.Generator().manual_seed(fresh_seed)
    q, cache, meta = _gpu_step(heads, [700, 1, 2000, 65] * 16, [1] * 64, g)
    run = lambda: mla_decode(q, cache, meta, SCALE, 512, 1, torch.float32)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    q2, cache2, meta2 = _gpu_step(heads, [3, 1500, 64, 0] * 16, [1] * 64, g)
    q.copy_(q2)
    cache[: cache2.shape[0]].copy_(cache2)
    meta.seq_lens.copy_(meta2.seq_lens)
    meta.block_tables.zero_()
    meta.block_tables[:, : meta2.block_tables.shape[1]].copy_(meta2.block_tables)
    graph.replay()
    ref = reference(q.float().cpu(), cache.cpu(), AttnMeta(*(t.cpu() for t in (meta.cu_q, meta.seq_lens, meta.block_tables)), None, None, 0), 512)  # fmt: skip
    vmax = cache.float().abs().max().item()
    assert (out.cpu() - ref).abs().max().item() <= 2**-7 * vmax


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_paged_mla_attention_decode_matches_torch_path(heads, fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    _, cache, meta = _gpu_step(heads, [900, 1, 64, 3000, 129], [1] * 5, g)
    q_nope = torch.randn(5, heads, 128, generator=g).cuda()
    q_rope = torch.randn(5, heads, 64, generator=g).cuda()
    w_uk = (torch.randn(heads, 128, 512, generator=g) * 0.05).cuda().bfloat16()
    w_uv = (torch.randn(heads, 128, 512, generator=g) * 0.05).cuda().bfloat16()
    got = paged_mla_attention(q_nope, q_rope, cache, meta, w_uk, w_uv, 192**-0.5)
    switches.current.ref = True
    want = paged_mla_attention(q_nope, q_rope, cache, meta, w_uk, w_uv, 192**-0.5)
    assert (got - want).abs().max().item() <= 3e-2 * want.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_paged_mla_attention_prefill_matches_torch_path(heads, fresh_seed):
    """Chunks longer than ABSORB_MAX_Q (prefill: torch's fused attention over the expanded keys, with and without
    a cached prefix) beside decode chunks (the kernel), against the einsum path."""
    g = torch.Generator().manual_seed(fresh_seed)
    q_lens = [40, 1, 300, 9, 1]
    _, cache, meta = _gpu_step(heads, [40, 900, 3000, 129, 64], q_lens, g)
    T = sum(q_lens)
    q_nope = torch.randn(T, heads, 128, generator=g).cuda()
    q_rope = torch.randn(T, heads, 64, generator=g).cuda()
    w_uk = (torch.randn(heads, 128, 512, generator=g) * 0.05).cuda().bfloat16()
    w_uv = (torch.randn(heads, 128, 512, generator=g) * 0.05).cuda().bfloat16()
    got = paged_mla_attention(q_nope, q_rope, cache, meta, w_uk, w_uv, 192**-0.5)
    switches.current.ref = True
    want = paged_mla_attention(q_nope, q_rope, cache, meta, w_uk, w_uv, 192**-0.5)
    assert (got - want).abs().max().item() <= 3e-2 * want.abs().max().item()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
