"""Kernel experiment switches (LLMSERVE_KERNEL_SWITCHES=gemv=0,pdl=0: a lab setting, scripts/lab and docs/gpu.md, not
one for users): each turns one of our kernel paths off, to measure it against its baseline. Kernels and models read
them where they are used (`switches.current.gemv`), never copied at import. The torch runner applies its config's
(`apply`); without one (offline tools, kernel tests) they are the defaults. Tests flip one with
monkeypatch.setattr(switches.current, "gemv", False)."""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.config import Config, parse_kernel_switches


@dataclass
class Switches:
    gemv: bool = True  # one-row products on kernels/gemv.py, 1-4-row int4 ones on gemv4.py (off: cuBLAS, the GEMMs)
    skinny: bool = True  # 2-16-row products of bf16/fp16 weights on kernels/skinny.py (off: cuBLAS)
    gemv_fuse: bool = True  # the 1-16-row gate_up and qkv products do the SwiGLU and the rotary + cache write
    gemv_norm: bool = True  # one-rank batch-1 decode: the RMSNorms ride in the GEMVs (models/llama.py `Normed`)
    pdl: bool = True  # sm_90+: programmatic dependent launch (kernels/pdl.py; the runner turns it off at MP_NUM > 1)
    tp_fused_norm: bool = True  # MP_NUM > 1 on one node: a small step's sums over the ranks fused with the RMSNorm
    tp_gemv_push: bool = True  # with those: a batch-1 row-parallel GEMV writes its row into every rank's buffer
    ref: bool = False  # the torch reference ops instead of the Triton kernels (debugging)


def parse(raw: str) -> Switches:
    """LLMSERVE_KERNEL_SWITCHES's value (checked by config.parse_kernel_switches), the others at their defaults."""
    return Switches(**parse_kernel_switches(raw))


current = Switches()  # the process's; changed in place only, so that every reader sees the same object


def apply(config: Config) -> Switches:
    """Make `config`'s switches the process's (every one it does not name at its default); returns `current`."""
    vars(current).update(vars(parse(config.kernel_switches)))
    return current
