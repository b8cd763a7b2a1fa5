"""Linear methods: how each weight format is read from a checkpoint and multiplied.

`method_for` picks one per model: the checkpoint's own `quantization_config` (GPTQ, AWQ, FP8) or
QUANT_TYPE (weight-only int8/int4 or FP8, quantized at load from a bf16/fp16 checkpoint), else
dense. A method reads one projection (`read`), says how several fuse (`n_dim`, `fusable`) and runs
them (`apply`, through kernels/quant_gemm.py and kernels/fp8_gemm.py: Triton on CUDA, the torch
reference on CPU). A projection the checkpoint left unquantized (`modules_to_not_convert`, or an
FP8 checkpoint's bf16 layers) is read by the dense method whatever the model's method is.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from llmserve.config import Config, ConfigError
from llmserve.kernels.fp8_gemm import fp8_linear, fp8_path
from llmserve.kernels.gemv import gemv, gemv_ok
from llmserve.kernels.gemv4 import gemv4_operands
from llmserve.kernels.quant_gemm import w4a16_linear, w8a16_linear
from llmserve.kernels.skinny import skinny, skinny_ok
from llmserve.layers.linear import Linear
from llmserve.layers.quant import checkpoint_config, formats
from llmserve.layers.weights import Split, WeightReader

log = logging.getLogger(__name__)

GROUP = 128  # online int4: weights per scale and zero point along K
# Up to this many rows an int4 layer that the 4-bit GEMV cannot take runs PyTorch's tinygemm kernel (H100, 8B
# projections, in CUDA graphs: 2.1-2.2x faster than our tensor-core kernel at M = 1, 1.5-1.9x slower at M = 16;
# measurements/wo_library_h100.json)
TINYGEMM_MAX_M = 4

# A `Split` (layers/weights.py) is the part of a projection one rank holds (tensor parallelism, parallel.py):
# (0, lo, hi) its output rows lo..hi (column-parallel), (1, lo, hi) its input columns lo..hi (row-parallel),
# in W [N, K]'s terms.


class LinearMethod:
    """Dense weights in the model's dtype (no quantization)."""

    name = "none"
    n_dim: dict[str, int] = {"weight": 0}  # the output dimension of each canonical tensor

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.dense = self if type(self) is LinearMethod else LinearMethod(dtype)

    def read(self, r: WeightReader, p: str, split: Split | None = None) -> Linear:
        """The projection whose tensors are named `p` + "weight" etc. (of a split, that part only)."""
        return Linear(self.dense, {"weight": r.get(p + "weight", split)}, self._bias(r, p, split))

    def _bias(self, r: WeightReader, p: str, split: Split | None = None) -> torch.Tensor | None:
        """The bias (its rows under a column split; whole under a row split: load_linear keeps it on
        one rank only)."""
        if not r.has(p + "bias"):
            return None
        return r.get(p + "bias", split if split is not None and split[0] == 0 else None)

    def fusable(self, parts: list[dict[str, torch.Tensor]]) -> bool:
        return True

    def finish(self, linear: Linear) -> Linear:
        """A loaded (and fused) layer, ready to run: a method may add operands for its kernels."""
        return linear

    def decode_tensors(self, w: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The tensors a batch-1 product reads (Linear.nbytes, the decode floor's bytes)."""
        return list(w.values())

    def _read_checkpoint(self, r: WeightReader, p: str, split: Split | None) -> Linear:
        """A projection of a quantized checkpoint in its canonical form (checkpoint_config.to_canonical); one the
        tool left unquantized (no quantized tensors) is read by the dense method. Of a split, only its
        part of each tensor is read (checkpoint_config.checkpoint_slice), then converted."""
        names = {
            role: n for role, n in checkpoint_config.tensor_names(self.spec, p).items() if r.has(n) and role != "bias"
        }
        if set(names) == {"weight"}:
            return self.dense.read(r, p, split)
        t = {}
        for role, name in names.items():
            part = checkpoint_config.checkpoint_slice(self.spec, role, split, p) if split is not None else None
            t[role] = r.raw(name, part)
            if role == "g_idx" and part is not None:  # group numbers of the slice start at its first group
                t[role] = t[role] - split[1] // self.spec.group_size
        c = checkpoint_config.to_canonical(self.spec, t)
        w = {k: v for k, v in c.items() if k in self.n_dim or (k == "perm" and v is not None)}
        return Linear(self, w, self._bias(r, p, split))

    def apply(
        self, w: dict[str, torch.Tensor], x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
    ) -> torch.Tensor:
        W = w["weight"]
        if out_dtype == x.dtype or not x.is_cuda:
            return F.linear(x, W, bias).to(out_dtype)
        if (ops := self.gemv_operands(w, x, out_dtype)) is not None:  # batch-1 decode: kernels/gemv.py
            return gemv(x, *ops, bias, out_dtype)  # (5-27% faster than cuBLAS on the 8B's, H100)
        if (Ws := self.skinny_operands(w, x, out_dtype)) is not None:  # 2-16 rows (verification): kernels/skinny.py
            return skinny(x, Ws, bias, out_dtype)
        out = torch.mm(x, W.t(), out_dtype)  # cuBLAS writes fp32 (model.py: `wide`)
        return out if bias is None else out.add_(bias)

    def gemv_operands(self, w: dict[str, torch.Tensor], x: torch.Tensor, out_dtype: torch.dtype):
        """(weight, scale, block) where `apply` gives this product to kernels/gemv.py, else None (apply
        asks it too)."""
        if self is not self.dense:  # a format without a GEMV path
            return None
        W = w["weight"]
        return (W, None, 0) if x.is_cuda and out_dtype != x.dtype and gemv_ok(x, W) else None

    def skinny_operands(self, w: dict[str, torch.Tensor], x: torch.Tensor, out_dtype: torch.dtype):
        """The weight where `apply` gives this product to kernels/skinny.py, else None (apply asks it too)."""
        if self is not self.dense:
            return None
        W = w["weight"]
        return W if x.is_cuda and out_dtype != x.dtype and skinny_ok(x, W) else None


class W8(LinearMethod):
    """Weight-only int8, per output channel; quantized at load (QUANT_TYPE=weight_only_int8)."""

    name = "weight_only_int8"
    n_dim = {"qweight": 0, "scale": 0}

    def read(self, r: WeightReader, p: str, split: Split | None = None) -> Linear:
        qweight, scale = formats.quantize_w8(r.raw(p + "weight", split).float())
        return Linear(self, {"qweight": qweight, "scale": scale}, self._bias(r, p, split))

    def apply(self, w, x, bias, out_dtype):
        return w8a16_linear(x, w["qweight"], w["scale"], bias, out_dtype)

    def gemv_operands(self, w, x, out_dtype):
        return (w["qweight"], w["scale"], 0) if gemv_ok(x, w["qweight"]) else None


class W4(LinearMethod):
    """4-bit weights, group-wise with zero points along K, in GPTQ's packing (quant/__init__.py):
    quantized at load (QUANT_TYPE=weight_only_int4, group 128) or read from GPTQ / AWQ checkpoints."""

    name = "weight_only_int4"
    n_dim = {"qweight": 1, "scales": 1, "zeros": 1}

    def __init__(self, dtype: torch.dtype, group_size: int = GROUP, spec=None) -> None:
        super().__init__(dtype)
        self.group_size, self.spec = group_size, spec
        if spec is not None:
            self.name = spec.method

    def read(self, r: WeightReader, p: str, split: Split | None = None) -> Linear:
        if self.spec is None:
            W = r.raw(p + "weight", split).float()
            if W.shape[1] % self.group_size:
                of_rank = " on each rank (MP_NUM)" if split is not None and split[0] == 1 else ""
                raise ConfigError(
                    f"QUANT_TYPE=weight_only_int4: {p}weight has {W.shape[1]} inputs{of_rank}, not a multiple "
                    f"of the group size {self.group_size}; use weight_only_int8"
                )
            q, s, z = formats.quantize_w4(W, self.group_size)
            return Linear(self, {"qweight": q, "scales": s, "zeros": z}, self._bias(r, p, split))
        return self._read_checkpoint(r, p, split)

    def fusable(self, parts):
        perms = [p.get("perm") for p in parts]
        if all(q is None for q in perms):
            return True
        return all(q is not None and torch.equal(q, perms[0]) for q in perms)

    def finish(self, linear: Linear) -> Linear:
        """On CUDA, also the 4-bit GEMV's operands for products of 1-4 rows (kernels/gemv4.py); where it cannot take
        the layer (a group size or zero point it does not hold), PyTorch's tinygemm operands instead."""
        w = linear.w
        if not w["qweight"].is_cuda:
            return linear
        ops = gemv4_operands(w["qweight"], w["scales"], w["zeros"])
        if ops is not None:
            w["g4_weight"], w["g4_sz"] = ops
        elif hasattr(torch.ops.aten, "_weight_int4pack_mm"):
            G = w["qweight"].shape[0] * 8 // w["scales"].shape[0]
            try:
                w["tg_weight"], w["tg_scales_zeros"] = tinygemm_operands(w["qweight"], w["scales"], w["zeros"], G)
            except RuntimeError as e:  # a shape or build it does not take: our tensor-core kernel for every M
                log.info("int4 layer %s: no tinygemm operands (%s)", tuple(w["qweight"].shape), e)
        return linear

    def decode_tensors(self, w: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The small products' operands where the layer has them (and the act-order permutation)."""
        for keys in (("g4_weight", "g4_sz"), ("tg_weight", "tg_scales_zeros")):
            if keys[0] in w:
                return [w[k] for k in (*keys, "perm") if k in w]
        return super().decode_tensors(w)

    def apply(self, w, x, bias, out_dtype):
        if "g4_weight" in w and gemv_ok(x, w["g4_weight"]):  # 1-4 rows: the 4-bit GEMV
            return gemv(x, w["g4_weight"], w["g4_sz"], 0, bias, out_dtype)
        G = w["qweight"].shape[0] * 8 // w["scales"].shape[0]
        if "tg_weight" in w and x.shape[0] <= TINYGEMM_MAX_M and x.dtype == torch.bfloat16:
            out = torch.ops.aten._weight_int4pack_mm(x, w["tg_weight"], G, w["tg_scales_zeros"])
            out = out if bias is None else out + bias
            return out.to(out_dtype)
        return w4a16_linear(x, w["qweight"], w["scales"], w["zeros"], G, bias, out_dtype)

    def gemv_operands(self, w, x, out_dtype):
        if "g4_weight" not in w or x.shape[0] != 1 or not gemv_ok(x, w["g4_weight"]):
            return None
        return w["g4_weight"], w["g4_sz"], 0


class FP8(LinearMethod):
    """E4M3 weights with per-channel or 128 x 128 block scales: FP8 tensor-core GEMMs with per-token
    activation scales on sm_89+, a dequantizing weight-only GEMM on older GPUs, the reference on CPU."""

    name = "fp8"
    n_dim = {"weight": 0, "scale": 0}

    def __init__(self, dtype: torch.dtype, block: int | None = None, spec=None) -> None:
        super().__init__(dtype)
        self.block, self.spec = block, spec
        if spec is not None:
            self.name = spec.method

    def read(self, r: WeightReader, p: str, split: Split | None = None) -> Linear:
        if self.spec is not None:
            return self._read_checkpoint(r, p, split)
        weight, scale = formats.quantize_fp8_channel(r.raw(p + "weight", split).float())  # QUANT_TYPE=fp8
        return Linear(self, {"weight": weight, "scale": scale}, self._bias(r, p, split))

    def fusable(self, parts):  # a block of scales must not span two projections
        return not self.block or all(p["weight"].shape[0] % self.block == 0 for p in parts[:-1])

    def apply(self, w, x, bias, out_dtype):
        return fp8_linear(x, w["weight"], w["scale"], self.block, bias, out_dtype)

    def gemv_operands(self, w, x, out_dtype):
        block = self.block or 0
        if fp8_path(x.device) != "w8a8" or (block and (block < 16 or block & (block - 1))):
            return None  # fp8_linear's reference and weight-only paths
        return (w["weight"], w["scale"], block) if gemv_ok(x, w["weight"], block) else None


def tinygemm_operands(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, G: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical w4 (quant/__init__.py) as `aten._weight_int4pack_mm` takes it: the 4-bit weights
    [N, K] packed two a byte (even k in the high nibble) then tiled, and per group (scale, zero) in
    bf16 with w = (q - 8) * scale + zero: ours is w = (q - z) * s = (q - 8) * s + (8 - z) * s."""
    q = formats.unpack_int4_k(qweight).t().contiguous().to(torch.int32)  # [N, K] in 0..15
    packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    weight = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
    s = scales.float()
    scales_zeros = torch.stack([s, (8 - zeros.float()) * s], dim=-1).to(torch.bfloat16).contiguous()
    return weight, scales_zeros


def load_linear(
    method: LinearMethod, r: WeightReader, *projections: tuple[str, Split | None], bias: bool = True
) -> Linear:
    """One layer over the projections named by their prefixes (e.g. q_proj., k_proj., v_proj.), each
    read whole or its split only, fused along the output dimension where the method allows it.
    `bias=False` drops the bias (a row-parallel layer adds it on one rank only)."""
    prefixes = [p for p, _ in projections]
    parts = [method.read(r, p, split) for p, split in projections]
    if not bias:
        for part in parts:
            part.bias = None
    if len(parts) == 1:
        return parts[0].method.finish(parts[0])
    m = parts[0].method
    if all(p.method is m for p in parts) and m.fusable([p.w for p in parts]):
        w = {k: torch.cat([p.w[k] for p in parts], dim=m.n_dim[k]) for k in m.n_dim}
        if "perm" in parts[0].w:
            w["perm"] = parts[0].w["perm"]
        biases = [p.bias for p in parts]
        bias = None if all(b is None for b in biases) else torch.cat([b for b in biases if b is not None])
        if bias is not None and any(b is None for b in biases):
            raise ValueError(f"{prefixes}: some of these projections have a bias and some do not")
        return m.finish(Linear(m, w, bias))
    return Linear(m, {}, parts=[p.method.finish(p) for p in parts])


def method_for(model_dir: str | Path, config: Config, device: torch.device, dtype: torch.dtype) -> LinearMethod:
    """The model's linear method (module doc). ConfigError, naming the setting or the checkpoint's
    `quantization_config`, for a format this build cannot run."""
    cfg_file = Path(model_dir) / "config.json"
    raw = json.loads(cfg_file.read_text()).get("quantization_config") if cfg_file.is_file() else None
    spec = checkpoint_config.parse_quantization_config(raw)
    if spec is not None and config.quant_type:
        raise ConfigError(
            f"QUANT_TYPE={config.quant_type}: the checkpoint in {model_dir} is already quantized "
            f"({spec.method}, from its quantization_config); unset QUANT_TYPE to serve it as it is"
        )
    kind = config.quant_type or (spec.method if spec else "")
    if kind in ("fp8", "fp8_block", "fp8_channel"):
        path = fp8_path(device)
        if path == "weight_only":  # said once, at start: nothing falls back silently
            log.warning("FP8 weights on %s: FP8 tensor-core GEMMs need sm_89+; running the dequantizing GEMM", device)
        else:
            log.info("FP8 weights: %s GEMMs on %s", "FP8 tensor-core" if path == "w8a8" else "reference", device)
    if kind == "":
        return LinearMethod(dtype)
    if kind == "weight_only_int8":
        return W8(dtype)
    if kind == "weight_only_int4":
        return W4(dtype)
    if kind in ("gptq", "awq"):
        return W4(dtype, spec.group_size, spec)
    if kind == "fp8":
        return FP8(dtype)
    if kind == "fp8_block":
        return FP8(dtype, spec.weight_block_size[0], spec)
    return FP8(dtype, None, spec)  # fp8_channel
