"""A checkpoint's `quantization_config` -> QuantSpec: which method, and which tensors each linear has.

config.json names the tool's layout; we accept only the layouts formats.py converts and refuse
everything else at startup with one ConfigError naming quant_method and what is supported, rather
than failing later on a missing tensor name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from llmserve.config import ConfigError

SUPPORTED = (
    "gptq (4-bit, checkpoint_format gptq or gptq_v2), awq (4-bit, version gemm, zero_point), "
    "fp8 (weight_block_size [128, 128], dynamic activations), fbgemm_fp8, and compressed-tensors "
    "FP8-dynamic (float 8-bit weights, channel strategy)"
)


@dataclass(frozen=True)
class QuantSpec:
    """What a quantized checkpoint holds. method: "gptq", "awq", "fp8_block" or "fp8_channel"."""

    method: str
    bits: int = 8
    group_size: int = -1  # 4-bit methods: inputs per group; -1: one group over K
    desc_act: bool = False
    sym: bool = True
    zero_point: bool = False
    v2: bool = False  # GPTQ checkpoint_format "gptq_v2": zeros stored without GPTQ v1's -1
    weight_block_size: tuple[int, int] | None = None
    not_converted: tuple[str, ...] = ()  # HF modules_to_not_convert: substring of the module name
    ignore: tuple[str, ...] = ()  # compressed-tensors ignore: exact name, or "re:" + regex (re.match)
    only: tuple[str, ...] | None = None  # optimum modules_in_block_to_quantize: name suffixes

    def quantized(self, module: str) -> bool:
        """Whether linear `module` (e.g. "model.layers.0.self_attn.q_proj") is stored quantized."""
        module = module.rstrip(".")
        if module == "lm_head" or module.endswith(".lm_head"):
            return False
        if any(s in module for s in self.not_converted):
            return False
        for pat in self.ignore:
            if re.match(pat[3:], module) if pat.startswith("re:") else pat == module:
                return False
        return self.only is None or any(module.endswith("." + s) or module == s for s in self.only)


def _refuse(method: object, why: str) -> ConfigError:
    return ConfigError(f"unsupported quantization_config: quant_method={method!r}: {why}; supported: {SUPPORTED}")


def _gptq(c: dict) -> QuantSpec:
    bits = c.get("bits", 4)
    if bits != 4:
        raise _refuse("gptq", f"bits={bits!r} (only 4)")
    fmt = c.get("checkpoint_format", c.get("format", "gptq"))
    if c.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", f"checkpoint_format={'marlin' if c.get('is_marlin_format') else fmt!r}")
    if c.get("lm_head"):
        raise _refuse("gptq", "lm_head=True (a quantized lm_head)")
    if c.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise _refuse("gptq", f"pack_dtype={c['pack_dtype']!r} (only int32)")
    blocks = c.get("modules_in_block_to_quantize")
    only = tuple(m for group in blocks for m in group) if blocks else None
    return QuantSpec(
        method="gptq",
        bits=4,
        group_size=int(c.get("group_size", 128)),
        desc_act=bool(c.get("desc_act", False)),
        sym=bool(c.get("sym", True)),
        zero_point=True,
        v2=fmt == "gptq_v2",
        not_converted=tuple(c.get("modules_to_not_convert") or ()),
        only=only,
    )


def _awq(c: dict) -> QuantSpec:
    bits = c.get("bits", c.get("w_bit", 4))
    version = str(c.get("version", "gemm")).lower()
    if bits != 4:
        raise _refuse("awq", f"bits={bits!r} (only 4)")
    if version != "gemm":
        raise _refuse("awq", f"version={c.get('version')!r} (only gemm)")
    if not c.get("zero_point", True):
        raise _refuse("awq", "zero_point=False")
    if c.get("backend", "autoawq") != "autoawq":
        raise _refuse("awq", f"backend={c['backend']!r} (only autoawq)")
    return QuantSpec(
        method="awq",
        bits=4,
        group_size=int(c.get("group_size", c.get("q_group_size", 128))),
        sym=False,
        zero_point=True,
        not_converted=tuple(c.get("modules_to_not_convert") or ()),
    )


def _fp8(c: dict) -> QuantSpec:
    block = c.get("weight_block_size")
    if c.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse("fp8", f"activation_scheme={c['activation_scheme']!r} (only dynamic)")
    if c.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fp8", f"fmt={c['fmt']!r} (only e4m3)")
    if block is None or list(block) != [128, 128]:
        raise _refuse("fp8", f"weight_block_size={block!r} (only [128, 128])")
    not_conv = tuple(c.get("modules_to_not_convert") or ())
    return QuantSpec(method="fp8_block", weight_block_size=(128, 128), not_converted=not_conv)


def _compressed(c: dict) -> QuantSpec:
    m = "compressed-tensors"
    fmt = c.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(m, f"format={fmt!r} (only float-quantized FP8)")
    if (c.get("sparsity_config") or {}).get("format", "dense") != "dense":
        raise _refuse(m, "a sparsity_config")
    if c.get("kv_cache_scheme"):
        raise _refuse(m, "a kv_cache_scheme")
    groups = c.get("config_groups") or {}
    if not groups:
        raise _refuse(m, "no config_groups")
    for name, g in groups.items():
        w, a = g.get("weights") or {}, g.get("input_activations")
        desc = f"config_groups.{name}.weights type={w.get('type')!r} num_bits={w.get('num_bits')!r} strategy={w.get('strategy')!r}"
        if (w.get("type"), w.get("num_bits"), w.get("strategy")) != ("float", 8, "channel"):
            raise _refuse(m, desc + " (only float, 8, channel)")
        if w.get("dynamic") or not w.get("symmetric", True):
            raise _refuse(m, f"config_groups.{name}.weights dynamic or asymmetric (only static symmetric)")
        if a and not a.get("dynamic"):
            raise _refuse(m, f"config_groups.{name}.input_activations static (only dynamic)")
        if g.get("output_activations"):
            raise _refuse(m, f"config_groups.{name}.output_activations")
    return QuantSpec(method="fp8_channel", ignore=tuple(c.get("ignore") or ()))


def _fbgemm(c: dict) -> QuantSpec:
    return QuantSpec(method="fp8_channel", not_converted=tuple(c.get("modules_to_not_convert") or ()))


_PARSERS = {"gptq": _gptq, "awq": _awq, "fp8": _fp8, "fbgemm_fp8": _fbgemm, "compressed-tensors": _compressed}


def parse_quantization_config(cfg: dict | None) -> QuantSpec | None:
    """The QuantSpec of a checkpoint's config.json (the whole config or its quantization_config);
    None when the checkpoint is not quantized. Raises ConfigError for layouts we do not read,
    including a quantization_config without quant_method."""
    if not cfg:
        return None
    if "quantization_config" in cfg:
        qc = cfg["quantization_config"]
    elif "quant_method" in cfg or not {"model_type", "architectures"} & cfg.keys():
        qc = cfg  # a quantization_config itself
    else:
        return None  # a model config without one
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in _PARSERS:
        raise _refuse(qc.get("quant_method"), "not a supported method")
    return _PARSERS[method](qc)


def tensor_names(spec: QuantSpec | None, prefix: str) -> dict[str, str]:
    """Checkpoint tensor names of one linear under `prefix` (e.g. "model.layers.0.self_attn.q_proj."),
    by role. "bias" (and GPTQ's "g_idx") may be absent from a checkpoint; the rest are required."""
    p = prefix if prefix.endswith(".") else prefix + "."
    if spec is None or not spec.quantized(p):
        roles: tuple[str, ...] = ("weight",)
    elif spec.method == "gptq":
        roles = ("qweight", "qzeros", "scales", "g_idx")
    elif spec.method == "awq":
        roles = ("qweight", "qzeros", "scales")
    elif spec.method == "fp8_block":
        roles = ("weight", "weight_scale_inv")
    else:
        roles = ("weight", "weight_scale")
    return {r: p + r for r in (*roles, "bias")}


def checkpoint_slice(spec: QuantSpec, role: str, split: tuple[int, int, int], p: str) -> tuple | None:
    """The part of checkpoint tensor `role` that holds the rows (split[0] == 0) or input columns (1)
    lo..hi of W [N, K] (tensor parallelism): (tensor dim, lo, hi) to read, or None to read it whole.
    ConfigError where the part is not whole groups / blocks of the format."""
    from llmserve.config import ConfigError

    dim, lo, hi = split
    G = spec.group_size if spec.group_size > 0 else 1 << 62  # one group over K: never split along K
    B = (spec.weight_block_size or (1, 1))[0]
    where = {  # role -> {W dim: (tensor dim, W rows / columns per entry)}
        "gptq": {"qweight": {0: (1, 1), 1: (0, 8)}, "qzeros": {0: (1, 8), 1: (0, G)},
                 "scales": {0: (1, 1), 1: (0, G)}, "g_idx": {1: (0, 1)}},
        "awq": {"qweight": {0: (1, 8), 1: (0, 1)}, "qzeros": {0: (1, 8), 1: (0, G)}, "scales": {0: (1, 1), 1: (0, G)}},
        "fp8_block": {"weight": {0: (0, 1), 1: (1, 1)}, "weight_scale_inv": {0: (0, B), 1: (1, B)}},
        "fp8_channel": {"weight": {0: (0, 1), 1: (1, 1)}, "weight_scale": {0: (0, 1)}},
    }[spec.method]  # fmt: skip
    if spec.method == "gptq" and spec.desc_act and dim == 1:
        raise ConfigError(
            f"MP_NUM > 1: {p} is a GPTQ desc_act (act-order) projection split along its inputs "
            "(row-parallel), which this build cannot shard; use a desc_act=false checkpoint"
        )
    got = where.get(role, {}).get(dim)
    if got is None:
        return None
    axis, per = got
    if lo % per or hi % per:
        what = "groups" if per in (G, 8) else "blocks"
        raise ConfigError(f"MP_NUM > 1: {p}{role} cannot be split at {lo}..{hi}: its {spec.method} {what} hold {per}")
    return axis, lo // per, hi // per


def to_canonical(spec: QuantSpec | None, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """One linear's checkpoint tensors, by tensor_names' roles, -> its canonical form:
    dense {"weight"}; gptq/awq {"qweight", "scales", "zeros", "perm"}; fp8 {"weight", "scale"};
    each with "bias" (None when absent)."""
    from llmserve.layers.quant import formats  # the tensor half of the formats

    bias = t.get("bias")
    if spec is None or not {"qweight", "weight_scale", "weight_scale_inv"} & t.keys():
        return {"weight": t["weight"], "bias": bias}
    if spec.method == "gptq":
        args = (t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), spec.group_size, spec.desc_act, spec.sym)
        qw, scales, zeros, perm = formats.gptq_to_canonical(*args, v2=spec.v2)
    elif spec.method == "awq":
        qw, scales, zeros = formats.awq_to_canonical(t["qweight"], t["qzeros"], t["scales"], spec.group_size)
        perm = None
    elif spec.method == "fp8_block":
        return {"weight": t["weight"], "scale": t["weight_scale_inv"].float(), "bias": bias}
    else:
        return {"weight": t["weight"], "scale": t["weight_scale"].float().reshape(-1), "bias": bias}
    return {"qweight": qw, "scales": scales, "zeros": zeros, "perm": perm, "bias": bias}
