"""Programmatic dependent launch (PDL, sm_90+): a decode kernel starts while the one before it ends.

A batch-1 decode step is a chain of ~290 small kernels, each waiting for the one before it: every launch pays
the grid's start and its first loads' latency while the GPU's memory idles. Launched with PDL, a kernel's
programs are scheduled once every program of the kernel before it has called `pdl_launch_next` (or ended), and
each waits (`pdl_wait`: griddepcontrol.wait) until that kernel has finished and its writes are visible. Before
its wait a program may only read what no kernel of the step writes: the 8/16-bit GEMV loads its first weight
tile there.

Where it runs (H100, 8B shape, batch-1 decode; docs/quantization.md, runs 127-131): the 8/16-bit GEMV, the
RMSNorm, paged attention and its merge; and the skinny products of a verification step (kernels/skinny.py), which
ask L2 for their first weight tiles before the wait, as their loads are copies the compiler pipelines
(docs/speculative.md, runs 138-140). The small kernels let the next one launch once they have waited, the
GEMV after its main loop (int8 3.43 ms a step, 3.59 without PDL, run 130; every kernel signalling after its wait,
or every one at its end, gained less in runs 127-129). Not the 4-bit GEMV: launched with PDL the step was 2-11%
slower. With int4 weights the other kernels are (attention and its merge, between the 4-bit GEMVs once the norms
rode in the GEMVs: 2.78 ms a step against 2.87, twice each on one H100, run 160; with the norm kernels still
between them it had been 3% faster to 11% slower from one H100 to the next, runs 128-131). Not with several ranks
(MP_NUM > 1; the runner turns it off): not measured there.

Safety: every kernel launched with PDL waits before it reads an activation or writes anything, so no write
races a reader of the kernel before, and each kernel ends after the one before it: a chain keeps stream order.
Each calls `pdl_launch_next` only after its own wait, so the next kernel's early part overlaps one kernel, never
two. A kernel launched without PDL (cuBLAS, torch's, the 4-bit GEMV) waits for everything before it as usual.
Both instructions are no-ops in a kernel launched without the attribute. CUDA graphs keep the edges.
"""

from __future__ import annotations

import functools

import torch

from llmserve.kernels import switches

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU wheel of torch ships without triton
    triton = None
try:  # a Triton that launches with PDL (`launch_pdl`) has these
    from triton.language.extra.cuda import gdc_wait  # noqa: F401

    HAS_PDL = True
except ImportError:  # pragma: no cover - depends on the Triton
    HAS_PDL = False


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_on(t: torch.Tensor) -> bool:
    """Whether a launch on `t`'s device uses PDL: the `pdl` switch on CUDA sm_90+ (not on the CPU or the interpreter)."""
    return switches.current.pdl and HAS_PDL and t.is_cuda and _hopper(t.device.index or 0)


def launch_args(on: bool) -> dict:
    """The launch's keyword for PDL: none when off (a Triton without PDL does not know `launch_pdl`)."""
    return {"launch_pdl": True} if on else {}


if triton is not None:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait for the kernel before to finish, its writes visible."""
        if PDL:
            tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def pdl_launch_next(PDL: tl.constexpr):
        """Let the next kernel launch (once every program has said so or ended)."""
        if PDL:
            tl.inline_asm_elementwise(
                "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
            )

    @triton.jit
    def l2_prefetch(ptrs):
        """Ask L2 for the 128-byte line of each pointer (no registers, no wait): before `pdl_wait`, for a kernel whose
        first loads are copies the compiler pipelines (kernels/skinny.py)."""
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )
