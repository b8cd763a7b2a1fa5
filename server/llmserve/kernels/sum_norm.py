"""The ranks' sum of a row-parallel projection, the residual add and the RMSNorm after it, in one kernel.

A decode step of a tensor-parallel model sums two partial outputs a layer over the ranks (o and down)
and normalizes each sum at once (`residual += sum; x = RMSNorm(residual)`). Through NCCL or torch's
one-shot all-reduce that is two kernels a sum, 64 at 32 layers, and at batch 1 their launches and
ramps cost as much as the bytes they move. Here one kernel does all of it, one program a row:

1. write this rank's partial row into its slot of every rank's symmetric-memory buffer (every rank of
   the node maps every other rank's buffer: NVLink peer-to-peer stores, which need no reply, no
   multicast), each fp32 value in an 8-byte word whose other half is the row's call count (an epoch,
   kept per row on the device, so CUDA graphs replay it). An aligned 8-byte store is seen whole or not
   at all, so a word that carries this call's epoch carries this call's value: no flag, and no fence
   to order a flag after the data (the flag-and-fence version cost 8.75 us a sum against 7.9, H100 x2);
2. wait, with volatile loads of its own buffer, until every rank's words for the row carry the epoch;
3. sum the ranks' rows in rank order (so every rank computes the same bits and samples the same
   tokens), add the residual (fp32), take the norm, write the residual and the normed row.

A row's slots alternate between two halves of the buffer by its epoch: a rank that has read every
rank's words of a row's call i+1 knows every other rank has finished reading its call i (each rank
starts call i+1 after its own call i), so its call i+2 may overwrite those slots. The words of a half
carry the epoch of two calls before, never equal to this one's (32 bits of it; the buffer starts at
0, the first epoch is 1).
Only for ranks of one node, and rows that fit the buffer; `TensorParallel.sum_norm` chooses.

Step 1 can be done by the product before: a batch-1 row-parallel projection that runs on kernels/gemv.py
writes its row as these words straight into every rank's buffer from all of its programs (`push`), and
the kernel then only waits, sums and normalizes (`Pushed`). The peers' words then arrive as their GEMVs
end, not after their sum kernels start and read the row back; the halves' argument holds as it is (a
rank's GEMV of call i+2 runs after its sum kernel of call i+1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.kernels import next_pow2

try:
    import triton
    import triton.language as tl

    from llmserve.kernels.push_words import push_words
except ImportError:  # pragma: no cover
    triton = None


@dataclass(frozen=True)
class Pushed:
    """A row-parallel product's partial rows, written by its GEMV into every rank's buffer (FusedSumNorm.push)
    instead of returned: what `FusedSumNorm` sums next."""

    rows: int
    cols: int


if triton is not None:

    @triton.jit
    def _sum_norm_kernel(
        x_ptr,  # [T, n] fp32: this rank's partial (PUSHED: unused, its GEMV pushed it)
        bases_ptr,  # [WORLD] int64: every rank's buffer address
        epochs_ptr,  # [max_rows] int64: calls so far, per row (this rank's own memory)
        res_ptr,  # [T, n] fp32 residual, updated in place
        w_ptr,  # [n] norm weight
        out_ptr,  # [T, n] normed output (the weight's dtype)
        n,
        eps,
        slot,  # 8-byte words of one (half, sending rank) slot
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        BLOCK: tl.constexpr,
        PUSHED: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < n
        epoch = tl.load(epochs_ptr + row) + 1
        tl.store(epochs_ptr + row, epoch)
        half = epoch % 2  # this row's calls alternate between the halves
        tag = epoch & 0xFFFFFFFF  # the high half of every word this call writes
        if not PUSHED:
            x = tl.load(x_ptr + row * n + cols, mask=m, other=0.0)
            push_words(x, row * n + cols, m, bases_ptr, epoch, slot, RANK, WORLD)
        local = tl.load(bases_ptr + RANK).to(tl.pointer_type(tl.int64))
        acc = tl.zeros((BLOCK,), tl.float32)
        for r in tl.static_range(WORLD):  # in rank order: the same bits on every rank
            p = local + (half * WORLD + r) * slot + row * n + cols
            v = tl.load(p, mask=m, other=tag << 32, volatile=True)  # volatile: past L1, to the peer's stores
            while tl.sum((((v >> 32) & 0xFFFFFFFF) != tag).to(tl.int32), axis=0) > 0:
                v = tl.load(p, mask=m, other=tag << 32, volatile=True)
            acc += (v & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        s = acc + tl.load(res_ptr + row * n + cols, mask=m, other=0.0)
        tl.store(res_ptr + row * n + cols, s, mask=m)
        rstd = tl.rsqrt(tl.sum(s * s, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n + cols, (s * rstd * w).to(out_ptr.dtype.element_ty), mask=m)


class FusedSumNorm:
    """`(partial, weight, eps, residual) -> RMSNorm(residual += sum over ranks of partial)`, for rows of
    at most `max_bytes` of fp32 with an fp32 residual (`fits`). Built collectively: every rank of `group` at once."""

    def __init__(self, group, rank: int, world: int, max_bytes: int, max_rows: int = 256, push: bool = True) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.world, self.max_bytes, self.max_rows = rank, world, max_bytes, max_rows
        self.take_pushes = push  # the `tp_gemv_push` switch (kernels/switches.py)
        # Two halves of one slot per sending rank, each value an 8-byte word (below).
        size = 2 * world * (max_bytes // 4) * 8
        self.buf = symm_mem.empty(size, dtype=torch.uint8, device="cuda")
        self.buf.zero_()
        handle = symm_mem.rendezvous(self.buf, group.group_name)
        self.bases = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device="cuda")
        self.epochs = torch.zeros(max_rows, dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()
        torch.distributed.barrier(group=group)  # every rank's words are zero before anyone writes

    def fits(self, x: torch.Tensor | Pushed, residual: torch.Tensor) -> bool:
        if isinstance(x, Pushed):
            return residual.shape == (x.rows, x.cols) and residual.dtype == torch.float32 and residual.is_contiguous()
        small = x.shape[0] <= self.max_rows and x.numel() * 4 <= self.max_bytes
        return small and x.dtype == residual.dtype == torch.float32 and residual.is_contiguous()

    def push(self, linear, x: torch.Tensor, out_dtype: torch.dtype) -> Pushed | None:
        """`linear(x, out_dtype)`'s partial row written by kernels/gemv.py straight into every rank's buffer,
        for this object's next call; None (nothing run) where that product would not run on the GEMV."""
        if not self.take_pushes or out_dtype != torch.float32 or x.dim() != 2 or x.shape[0] != 1:
            return None
        operands = linear.gemv_operands(x, out_dtype)
        if operands is None or operands[0].shape[0] * 4 > self.max_bytes:
            return None
        from llmserve.kernels.gemv import gemv

        weight, scale, block = operands
        gemv(x, weight, scale, block, None, out_dtype, push=(self.bases, self.epochs, self.rank, self.world, self.slot))
        return Pushed(1, weight.shape[0])

    @property
    def slot(self) -> int:
        """8-byte words of one (half, sending rank) slot."""
        return self.max_bytes // 4

    def __call__(self, x: torch.Tensor | Pushed, w: torch.Tensor, eps: float, residual: torch.Tensor) -> torch.Tensor:
        pushed = isinstance(x, Pushed)
        T, n = (x.rows, x.cols) if pushed else x.shape
        x = residual if pushed else x if x.is_contiguous() else x.contiguous()  # (pushed: x unread)
        out = torch.empty((T, n), dtype=w.dtype, device=residual.device)
        block = next_pow2(n)
        _sum_norm_kernel[(T,)](
            x, self.bases, self.epochs, residual, w, out, n, eps, self.slot,
            RANK=self.rank, WORLD=self.world, BLOCK=block, PUSHED=pushed, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
        return out
