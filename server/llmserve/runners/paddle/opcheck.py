"""Check, before building a predictor, that every op of a saved graph has a kernel here.

PaddleNLP's exported graphs use fused GPU-only ops (`block_multihead_attention`, ...).
On a CPU build, `paddle.inference` fails late and cryptically on those; this names them all.
"""

from __future__ import annotations

import json
from pathlib import Path

import paddle
from paddle.base import core

# PIR dialect ids of model.json op names ("1.scatter_" is pd_op.scatter_).
_DIALECTS = {"0": "builtin", "1": "pd_op", "2": "cf", "3": "custom_op", "4": "dist"}
_BUILTIN_SHORT = {"p", "c", "s", "g"}  # builtin.parameter / combine / set_parameter / get_parameter
# Run by the executor itself, without a phi kernel.
_NO_KERNEL = {
    "if", "while", "pylayer", "select_input", "select_output", "print", "assign_out_", "shadow_feeds",
    "conditional_block", "write_to_array", "read_from_array", "feed", "fetch", "data",
}  # fmt: skip
_DEVICE_BACKENDS = {"cpu": ("CPU", "ONEDNN"), "gpu": ("GPU", "GPUDNN", "CPU")}


class MissingKernelsError(RuntimeError):
    pass


def _walk_ops(node, out: list[str]) -> None:
    if isinstance(node, dict):
        if "#" in node and "O" in node:  # an op (regions and blocks have no "O")
            out.append(node["#"])
        for v in node.values():
            _walk_ops(v, out)
    elif isinstance(node, list):
        for v in node:
            _walk_ops(v, out)


def program_ops(program: str | Path) -> list[str]:
    """Op names of a saved program, "dialect.op" for model.json, legacy op types for .pdmodel."""
    path = Path(program)
    if path.suffix == ".json":
        names: list[str] = []
        _walk_ops(json.loads(path.read_text()), names)
        full = []
        for n in names:
            if n in _BUILTIN_SHORT:
                continue
            dialect, _, op = n.partition(".")
            full.append(f"{_DIALECTS.get(dialect, dialect)}.{op}")
        return sorted(set(full))
    from paddle.base.proto import framework_pb2

    desc = framework_pb2.ProgramDesc.FromString(path.read_bytes())
    return sorted({op.type for block in desc.blocks for op in block.ops})


def _has_kernel(op: str, backends: tuple[str, ...], kernels: dict[str, list[str]]) -> bool:
    if op in _NO_KERNEL or op.rstrip("_") in _NO_KERNEL:
        return True
    for name in (op, op.rstrip("_"), core._get_phi_kernel_name(op), core._get_phi_kernel_name(op.rstrip("_"))):
        if any(k.lstrip("(").split(",")[0] in backends for k in kernels.get(name, ())):
            return True
    return False


def missing_kernels(program: str | Path, device: str = "cpu") -> list[str]:
    """Ops of `program` with no kernel for `device` ("cpu" | "gpu") in this Paddle build."""
    kernels = core._get_registered_phi_kernels("all")
    backends = _DEVICE_BACKENDS[device]
    missing = []
    for name in program_ops(program):
        dialect, dot, op = name.partition(".")
        if not dot:  # legacy ProgramDesc op type
            dialect, op = "pd_op", name
        if dialect in ("builtin", "cf"):
            continue
        if not _has_kernel(op, backends, kernels):
            missing.append(op)
    return missing


def check_kernels(program: str | Path, device: str = "cpu") -> None:
    missing = missing_kernels(program, device)
    if missing:
        raise MissingKernelsError(
            f"{program} uses {len(missing)} op(s) with no {device.upper()} kernel in this Paddle build "
            f"({paddle.__version__}, CUDA {'on' if core.is_compiled_with_cuda() else 'off'}): {', '.join(missing)}. "
            "Graphs exported by PaddleNLP for GPU (fused attention ops) need a paddlepaddle-gpu build; "
            "here, serve the HF checkpoint instead, or re-export it with llmserve.runners.paddle.export.export_hf."
        )
