"""Quantized copies of a dense HF Llama / Qwen2 checkpoint, laid out exactly as the real tools write them.

Tests need GPTQ, AWQ and FP8 checkpoints without running AutoGPTQ, AutoAWQ or llm-compressor (and
without downloading real ones). Each writer quantizes the decoder layers' q/k/v/o/gate/up/down
projections by round-to-nearest (the tools' calibration changes values, not layout), packs them with
the tools' own packing (re-implemented here independently of llmserve's formats.py, so tests
cross-check the two), and writes the tool's tensor names, dtypes, shapes and config.json
`quantization_config`. Embeddings, norms and lm_head are copied unchanged in the source dtype
(AutoGPTQ / AutoAWQ would cast them to fp16; we keep them exact); GPTQ and AWQ biases become fp16
as those tools store them. The source's sharding is kept and its index rewritten; every other file
(tokenizer, generation config) is copied. Each writer returns {original "...proj.weight" name: the dequantized fp32 weight [N, K]}
so a test can build the equivalent dense model.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

LINEAR = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight$")
# DeepSeek-V3's FP8 checkpoints quantize every projection of MLA and of every expert (not the routers)
DEEPSEEK_LINEAR = re.compile(
    r"^(model\.layers\.\d+\.)(self_attn\.(?:q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(?:experts\.\d+\.|shared_experts\.)?(?:gate|up|down)_proj)\.weight$"
)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
FP8_MAX = 448.0
# Linears that read the same activations share GPTQ's act-order (it comes from their input's Hessian).
_SHARED_INPUT = {
    "self_attn.q_proj": "attn",
    "self_attn.k_proj": "attn",
    "self_attn.v_proj": "attn",
    "self_attn.o_proj": "o",
    "mlp.gate_proj": "mlp",
    "mlp.up_proj": "mlp",
    "mlp.down_proj": "down",
}

Quantizer = Callable[[str, str, torch.Tensor], dict[str, torch.Tensor]]


def _rewrite(
    src: str | Path,
    dst: str | Path,
    qcfg: dict,
    quantize: Quantizer,
    extra_files: dict | None = None,
    bias_dtype: torch.dtype | None = None,
    linear: re.Pattern = LINEAR,
) -> None:
    """Copy src to dst, replacing each decoder projection weight by quantize(layer prefix,
    projection, W)'s tensors named under the projection's prefix (its bias cast to bias_dtype if
    given); config.json gets qcfg, and extra_files {name: dict} are written as JSON."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for name, content in (extra_files or {}).items():
        (dst / name).write_text(json.dumps(content, indent=2))

    weight_map, total = {}, 0
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as h:
            tensors = {n: h.get_tensor(n) for n in h.keys()}
        out = {}
        for name, t in tensors.items():
            m = linear.match(name)
            if m:
                for role, q in quantize(m.group(1), m.group(2), t).items():
                    out[name[: -len("weight")] + role] = q.contiguous()
            elif bias_dtype is not None and name.endswith(".bias") and LINEAR.match(name[: -len("bias")] + "weight"):
                out[name] = t.to(bias_dtype)
            else:
                out[name] = t
        save_file(out, dst / shard.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, shard.name))
        total += sum(t.numel() * t.element_size() for t in out.values())
    if (src / "model.safetensors.index.json").exists():
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# ---- GPTQ (AutoGPTQ / optimum; GPTQModel for v2) ----


def _pack_rows(intweight: np.ndarray) -> np.ndarray:
    """AutoGPTQ's qweight packing: [K, N] -> [K/8, N], row r holds rows 8r..8r+7, low nibble first."""
    intweight = intweight.astype(np.uint32)
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= intweight[8 * row + j] << np.uint32(4 * j)
    return qweight.astype(np.int32)


def _pack_cols(values: np.ndarray, order: list[int]) -> np.ndarray:
    """Packing along N ([R, N] -> [R, N/8]): nibble i of word c holds column 8c + order[i]."""
    values = values.astype(np.uint32)
    packed = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= values[:, 8 * col + order[i]] << np.uint32(4 * i)
    return packed.astype(np.int32)


def write_gptq(
    src: str | Path,
    dst: str | Path,
    group_size: int = 128,
    desc_act: bool = False,
    sym: bool = True,
    v2: bool = False,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A 4-bit GPTQ copy: qweight int32 [K/8, N], qzeros int32 [K/G, N/8] (v1: zero_point - 1),
    scales fp16 [K/G, N], g_idx int32 [K], bias fp16. With desc_act, a random act-order per input
    (shared by q/k/v and by gate/up, as GPTQ's shared Hessian gives). Asymmetric v1 zero points
    are kept >= 1: AutoGPTQ's `zeros -= 1` would corrupt the packed word for a zero point of 0."""
    gen = torch.Generator().manual_seed(seed)
    orders: dict[tuple[str, str], torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}

    def quantize(layer: str, proj: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        W = w.float()
        N, K = W.shape
        G = K if group_size == -1 else group_size
        assert K % G == 0 and N % 8 == 0, (K, N, G)
        key = (layer, _SHARED_INPUT[proj])
        if key not in orders:
            orders[key] = torch.randperm(K, generator=gen) if desc_act else torch.arange(K)
        perm = orders[key]
        g_idx = torch.empty(K, dtype=torch.int64)
        g_idx[perm] = torch.arange(K) // G  # act-order: column perm[i] is quantized i-th
        # Per group and output: GPTQ's Quantizer.find_params (range widened to include 0).
        scales = torch.empty(K // G, N)
        zeros = torch.empty(K // G, N)
        for g in range(K // G):
            x = W[:, g_idx == g]
            xmin, xmax = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
            if sym:
                xmax = torch.maximum(xmin.abs(), xmax)
                xmin = torch.where(xmin < 0, -xmax, xmin)
            both0 = (xmin == 0) & (xmax == 0)
            xmin, xmax = torch.where(both0, -1.0, xmin), torch.where(both0, 1.0, xmax)
            scales[g] = (xmax - xmin) / 15
            zeros[g] = 8.0 if sym else torch.round(-xmin / scales[g]).clamp(0 if v2 else 1, 15)
        scales16 = scales.half()
        s, z = scales16.float()[g_idx], zeros[g_idx]  # [K, N]
        q = (torch.round(W.t() / s) + z).clamp(0, 15)
        deq[layer + proj + ".weight"] = ((q - z) * s).t().contiguous()
        stored_zeros = zeros if v2 else zeros - 1
        return {
            "qweight": torch.from_numpy(_pack_rows(q.to(torch.int64).numpy())),
            "qzeros": torch.from_numpy(_pack_cols(stored_zeros.to(torch.int64).numpy(), list(range(8)))),
            "scales": scales16,
            "g_idx": g_idx.to(torch.int32),
        }

    qcfg = {
        "bits": 4,
        "group_size": group_size,
        "damp_percent": 0.01,
        "desc_act": desc_act,
        "static_groups": False,
        "sym": sym,
        "true_sequential": True,
        "model_name_or_path": None,
        "model_file_base_name": "model",
        "quant_method": "gptq",
        "checkpoint_format": "gptq_v2" if v2 else "gptq",
    }
    # AutoGPTQ also writes quantize_config.json; both store a quantized linear's bias in fp16.
    _rewrite(src, dst, qcfg, quantize, extra_files={"quantize_config.json": qcfg}, bias_dtype=torch.float16)
    return deq


# ---- AWQ (AutoAWQ, version "gemm") ----


def write_awq(src: str | Path, dst: str | Path, group_size: int = 128) -> dict[str, torch.Tensor]:
    """A 4-bit AutoAWQ GEMM copy: qweight int32 [K, N/8] and qzeros int32 [K/G, N/8] packed along N
    in AWQ order, scales fp16 [K/G, N], bias fp16; AutoAWQ's pseudo_quantize_tensor (zero point)."""
    deq: dict[str, torch.Tensor] = {}

    def quantize(layer: str, proj: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        W = w.float()
        N, K = W.shape
        G = K if group_size == -1 else group_size
        wg = W.reshape(N, K // G, G)
        mx, mn = wg.amax(-1), wg.amin(-1)
        scales = ((mx - mn).clamp(min=1e-5) / 15).half()  # [N, K/G]
        zeros = (-torch.round(mn / scales.float())).clamp(0, 15)
        s, z = scales.float()[..., None], zeros[..., None]
        q = (torch.round(wg / s) + z).clamp(0, 15)
        deq[layer + proj + ".weight"] = ((q - z) * s).reshape(N, K)
        intweight = q.reshape(N, K).t().to(torch.int64).numpy()  # [K, N]
        return {
            "qweight": torch.from_numpy(_pack_cols(intweight, AWQ_ORDER)),
            "qzeros": torch.from_numpy(_pack_cols(zeros.t().to(torch.int64).numpy(), AWQ_ORDER)),
            "scales": scales.t().contiguous(),
        }

    qcfg = {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": group_size,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    _rewrite(src, dst, qcfg, quantize, bias_dtype=torch.float16)
    return deq


# ---- FP8 ----


def write_fp8_block(src: str | Path, dst: str | Path, linear: re.Pattern = LINEAR) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 / HF FineGrainedFP8 layout: weight float8_e4m3fn [N, K] and weight_scale_inv fp32
    [ceil(N/128), ceil(K/128)], W = weight * weight_scale_inv per 128 x 128 block."""
    deq: dict[str, torch.Tensor] = {}
    B = 128

    def quantize(layer: str, proj: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        W = w.float()
        N, K = W.shape
        q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
        sinv = torch.empty(-(-N // B), -(-K // B))
        for i in range(sinv.shape[0]):
            for j in range(sinv.shape[1]):
                blk = W[i * B : (i + 1) * B, j * B : (j + 1) * B]
                amax = float(blk.abs().max())
                sinv[i, j] = amax / FP8_MAX if amax > 0 else 1.0
                q[i * B : (i + 1) * B, j * B : (j + 1) * B] = (blk / sinv[i, j]).clamp(-FP8_MAX, FP8_MAX).to(q.dtype)
        full = sinv.repeat_interleave(B, 0).repeat_interleave(B, 1)[:N, :K]
        deq[layer + proj + ".weight"] = q.float() * full
        return {"weight": q, "weight_scale_inv": sinv}

    qcfg = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [B, B]}
    _rewrite(src, dst, qcfg, quantize, linear=linear)
    return deq


def write_fp8_channel(src: str | Path, dst: str | Path) -> dict[str, torch.Tensor]:
    """llm-compressor's FP8_DYNAMIC scheme (compressed-tensors "float-quantized"): weight
    float8_e4m3fn [N, K], weight_scale [N, 1] in the weight's own dtype, no input scales."""
    deq: dict[str, torch.Tensor] = {}

    def quantize(layer: str, proj: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = (w.float().abs().amax(1, keepdim=True) / FP8_MAX).to(w.dtype)  # [N, 1]
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (w.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        deq[layer + proj + ".weight"] = q.float() * scale.float()
        return {"weight": q, "weight_scale": scale}

    args = {"actorder": None, "block_structure": None, "group_size": None, "num_bits": 8, "symmetric": True}
    args.update(observer_kwargs={}, type="float")
    qcfg = {
        "config_groups": {
            "group_0": {
                "input_activations": {**args, "dynamic": True, "observer": None, "strategy": "token"},
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {**args, "dynamic": False, "observer": "minmax", "strategy": "channel"},
            }
        },
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }
    _rewrite(src, dst, qcfg, quantize)
    return deq
