"""Quantization formats (CPU): online quantization bounds, 4-bit packing, GPTQ / AWQ / FP8 layouts
converted to the canonical forms, quantization_config parsing, and the test checkpoint writers.

The GPTQ and AWQ layouts are packed here by plain loops written from the tools' own packing
(AutoGPTQ's pack: rows along K low nibble first, `zeros -= 1` in v1; AutoAWQ's GEMM pack: along N in
order [0, 2, 4, 6, 1, 3, 5, 7]), independently of formats.py. Error bounds: round-to-nearest int8 /
int4 is within scale / 2 of each element; E4M3 (3 mantissa bits) rounds a scaled value x to within
2^-4 |x| (normals) or 2^-10 (subnormals), so |W - deq| <= 2^-4 |W| + 2^-10 scale, which is at most
2^-4 of the channel's or block's max (plus 2^-10 / 448 of it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import quant_checkpoints
import torch
from safetensors import safe_open

from llmserve.config import ConfigError
from llmserve.layers.quant import formats as F
from llmserve.layers.quant.checkpoint_config import (
    QuantSpec,
    parse_quantization_config,
    tensor_names,
    to_canonical,
)

EPS = 1e-6  # fp32 slack on a bound


# ---- online quantization ----


def test_w8_round_trip(fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    w = torch.randn(48, 96, generator=g) * torch.rand(48, 1, generator=g) * 3
    w[5] = 0.0
    q, scale = F.quantize_w8(w)
    assert q.dtype == torch.int8 and q.shape == (48, 96) and scale.dtype == torch.float32 and scale.shape == (48,)
    err = (w - F.dequantize_w8(q, scale)).abs()
    assert (err <= scale[:, None] / 2 * (1 + EPS) + 1e-12).all()
    assert (q[5] == 0).all() and torch.isfinite(scale).all()


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_w4_round_trip(fresh_seed, group_size):
    g = torch.Generator().manual_seed(fresh_seed)
    N, K = 40, 256
    w = torch.randn(N, K, generator=g) + torch.randn(N, 1, generator=g)
    w[3] = 0.0
    w[7, :32] = w[7, :32].abs() + 0.5  # an all-positive group
    qw, scales, zeros = F.quantize_w4(w, group_size)
    G = K if group_size == -1 else group_size
    assert qw.dtype == torch.int32 and qw.shape == (K // 8, N)
    assert scales.shape == zeros.shape == (K // G, N) and zeros.dtype == torch.float32
    assert torch.equal(zeros, zeros.round()) and zeros.min() >= 0 and zeros.max() <= 15
    deq = F.dequantize_w4(qw, scales, zeros, group_size)
    bound = scales.repeat_interleave(G, dim=0).t() / 2
    assert ((w - deq).abs() <= bound * (1 + EPS) + 1e-6).all()
    assert (deq[3] == 0).all()


def _np_pack_k(q: np.ndarray) -> np.ndarray:
    words = np.zeros((q.shape[0] // 8, q.shape[1]), dtype=np.uint64)
    for r in range(words.shape[0]):
        for j in range(8):
            words[r] += q[8 * r + j].astype(np.uint64) << np.uint64(4 * j)
    return words.astype(np.uint32).view(np.int32)


def test_pack_unpack_int4(fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    q = torch.randint(0, 16, (64, 24), generator=g)
    q[7::8, :4] = 15  # nibble 7 holds bit 31: negative words
    qw = F.pack_int4_k(q)
    assert qw.dtype == torch.int32 and (qw < 0).any()
    assert torch.equal(qw, torch.from_numpy(_np_pack_k(q.numpy())))
    assert torch.equal(F.unpack_int4_k(qw).long(), q)
    words = torch.randint(-(2**31), 2**31, (8, 16), generator=g, dtype=torch.int64).to(torch.int32)
    words[0, 0], words[0, 1] = -(2**31), -1
    assert torch.equal(F.pack_int4_k(F.unpack_int4_k(words)), words)


# ---- GPTQ and AWQ layouts, packed as the tools pack them ----


def _np_pack_n(v: np.ndarray, order: list[int]) -> np.ndarray:
    """[R, N] -> [R, N/8]: nibble i of word c = column 8c + order[i]."""
    words = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint64)
    for c in range(words.shape[1]):
        for i in range(8):
            words[:, c] += v[:, 8 * c + order[i]].astype(np.uint64) << np.uint64(4 * i)
    return words.astype(np.uint32).view(np.int32)


def _random_w4(g: torch.Generator, K: int, N: int, groups: int, zmin: int = 0):
    q = torch.randint(0, 16, (K, N), generator=g)
    z = torch.randint(zmin, 16, (groups, N), generator=g)
    s = (torch.rand(groups, N, generator=g) * 0.1 + 0.01).half()
    return q, z, s


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("group_size", [32, -1])
def test_gptq_to_canonical(fresh_seed, v2, desc_act, group_size):
    g = torch.Generator().manual_seed(fresh_seed)
    K, N = 128, 48
    G = K if group_size == -1 else group_size
    q, z, s = _random_w4(g, K, N, K // G, zmin=0 if v2 else 1)  # v1 stores z - 1: z >= 1
    if desc_act:
        inv = torch.argsort(torch.randperm(K, generator=g))
        g_idx = inv // G  # act-order: the i-th quantized row (perm[i]) is in group i // G
    else:
        g_idx = torch.arange(K) // G
    W = ((q - z[g_idx]) * s.float()[g_idx]).t()  # [N, K]
    qweight = torch.from_numpy(_np_pack_k(q.numpy()))
    qzeros = torch.from_numpy(_np_pack_n((z if v2 else z - 1).numpy(), list(range(8))))
    cq, cs, cz, perm = F.gptq_to_canonical(qweight, qzeros, s, g_idx.int(), group_size, desc_act, True, v2=v2)
    assert cq.shape == (K // 8, N) and cs.dtype == torch.float16 and cz.dtype == torch.float32
    Wc = F.dequantize_w4(cq, cs, cz, group_size)
    if desc_act and group_size != -1:
        assert perm is not None and perm.dtype == torch.int64 and torch.equal(torch.sort(perm).values, torch.arange(K))
        assert torch.equal(Wc, W[:, perm])
        x = torch.randn(5, K, generator=g, dtype=torch.float64)
        torch.testing.assert_close(x[:, perm] @ Wc.double().t(), x @ W.double().t())
    else:
        assert perm is None and torch.equal(Wc, W)


def test_gptq_v1_symmetric_zeros_are_8():
    """A symmetric 4-bit GPTQ v1 checkpoint stores 0x77777777 in every qzeros word: zero point 8."""
    qzeros = torch.full((2, 4), 0x77777777, dtype=torch.int32)
    qweight = torch.zeros(8, 32, dtype=torch.int32)
    _, _, zeros, _ = F.gptq_to_canonical(qweight, qzeros, torch.ones(2, 32).half(), None, 32, False, True)
    assert (zeros == 8).all()
    _, _, zeros, _ = F.gptq_to_canonical(qweight, qzeros, torch.ones(2, 32).half(), None, 32, False, True, v2=True)
    assert (zeros == 7).all()


def test_gptq_uneven_g_idx_refused():
    g_idx = torch.zeros(64, dtype=torch.int32)
    g_idx[-1] = 1
    with pytest.raises(ValueError, match="g_idx"):
        F.gptq_to_canonical(torch.zeros(8, 8, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32),
                            torch.ones(2, 8).half(), g_idx, 32, True, True)  # fmt: skip


@pytest.mark.parametrize("group_size", [32, -1])
def test_awq_to_canonical(fresh_seed, group_size):
    g = torch.Generator().manual_seed(fresh_seed)
    K, N = 96, 64
    G = K if group_size == -1 else group_size
    q, z, s = _random_w4(g, K, N, K // G)
    gi = torch.arange(K) // G
    W = ((q - z[gi]) * s.float()[gi]).t()
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    qweight = torch.from_numpy(_np_pack_n(q.numpy(), order))
    qzeros = torch.from_numpy(_np_pack_n(z.numpy(), order))
    assert qweight.shape == (K, N // 8)
    cq, cs, cz = F.awq_to_canonical(qweight, qzeros, s, group_size)
    assert cq.shape == (K // 8, N)
    assert torch.equal(F.dequantize_w4(cq, cs, cz, group_size), W)


def test_awq_order_anchor():
    """Columns 0..7 holding 0..7 pack (AutoAWQ) into 0x75316420: nibble i holds column order[i]."""
    word = torch.tensor([[0x75316420]], dtype=torch.int32)
    cq, _, cz = F.awq_to_canonical(word.expand(8, 1).contiguous(), word, torch.ones(1, 8).half(), -1)
    assert torch.equal(F.unpack_int4_k(cq)[0].long(), torch.arange(8))
    assert torch.equal(cz[0], torch.arange(8.0))


# ---- FP8 ----


def test_fp8_channel_round_trip(fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    w = torch.randn(40, 200, generator=g) * torch.rand(40, 1, generator=g) * 5
    w[2] = 0.0
    w[3, 7] = 1e-6  # a subnormal after scaling
    q, scale = F.quantize_fp8_channel(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.shape == (40,)
    for sc in (scale, scale[:, None]):  # [N] or compressed-tensors' [N, 1]
        deq = F.dequantize_fp8(q, sc)
        bound = 2**-4 * w.abs() + 2**-10 * scale[:, None]
        assert ((w - deq).abs() <= bound * (1 + EPS)).all()
    assert ((w - deq).abs().amax(1) <= 2**-4 * w.abs().amax(1) * (1 + 2**-6 / 448) + 1e-12).all()
    assert torch.equal(deq[2], torch.zeros(200))


def test_fp8_block_round_trip(fresh_seed):
    g = torch.Generator().manual_seed(fresh_seed)
    N, K = 200, 300  # not multiples of 128: edge blocks
    w = torch.randn(N, K, generator=g) * (torch.rand(N, 1, generator=g) * 4 + 0.1)
    w[130:, 260:] = 0.0  # one all-zero block
    q, sinv = F.quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (N, K) and sinv.shape == (2, 3)
    assert sinv.dtype == torch.float32
    deq = F.dequantize_fp8(q, sinv, block=128)
    full = F.expand_block_scale(sinv, (N, K))
    assert ((w - deq).abs() <= (2**-4 * w.abs() + 2**-10 * full) * (1 + EPS)).all()
    blk_max = w[:128, :128].abs().max()
    torch.testing.assert_close(sinv[0, 0], blk_max / 448)  # the block max maps onto 448
    assert torch.equal(deq[130:, 260:], torch.zeros(N - 130, K - 260))


# ---- quantization_config ----

GPTQ = {"bits": 4, "group_size": 128, "desc_act": True, "sym": True, "quant_method": "gptq", "damp_percent": 0.01}
AWQ = {"quant_method": "awq", "zero_point": True, "group_size": 64, "bits": 4, "version": "gemm"}
FP8_BLOCK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
FBGEMM = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}


def _ct(weights: dict, inputs: dict | None = None, fmt: str = "float-quantized") -> dict:
    w = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False, **weights}
    inputs = inputs if inputs is not None else {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": inputs}},
        "ignore": ["lm_head", "re:.*mlp\\.down_proj$"],
        "kv_cache_scheme": None,
    }


@pytest.mark.parametrize(
    "qc, expect",
    [
        (GPTQ, dict(method="gptq", bits=4, group_size=128, desc_act=True, sym=True, v2=False)),
        ({**GPTQ, "checkpoint_format": "gptq_v2", "group_size": -1}, dict(method="gptq", v2=True, group_size=-1)),
        (AWQ, dict(method="awq", bits=4, group_size=64, zero_point=True, sym=False)),
        (FP8_BLOCK, dict(method="fp8_block", weight_block_size=(128, 128))),
        (FBGEMM, dict(method="fp8_channel", not_converted=("lm_head",))),
        (_ct({}), dict(method="fp8_channel")),
        (_ct({}, inputs={}), dict(method="fp8_channel")),  # weight-only FP8
    ],
)
def test_parse_recognised(qc, expect):
    spec = parse_quantization_config({"model_type": "llama", "quantization_config": qc})
    for k, v in expect.items():
        assert getattr(spec, k) == v, k
    assert parse_quantization_config(qc) == spec  # the quantization_config alone also works


@pytest.mark.parametrize(
    "qc, named",
    [
        ({**GPTQ, "bits": 8}, "bits=8"),
        ({**GPTQ, "bits": 3}, "bits=3"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "marlin"),
        ({**GPTQ, "is_marlin_format": True}, "marlin"),
        ({**GPTQ, "lm_head": True}, "lm_head"),
        ({**AWQ, "version": "gemv"}, "gemv"),
        ({**AWQ, "zero_point": False}, "zero_point"),
        ({**AWQ, "bits": 8}, "bits=8"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size=None"),
        ({**FP8_BLOCK, "weight_block_size": [64, 64]}, "[64, 64]"),
        ({**FP8_BLOCK, "activation_scheme": "static"}, "static"),
        (_ct({"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}, fmt="pack-quantized"), "pack-quantized"),
        (_ct({"strategy": "tensor"}), "strategy='tensor'"),
        (_ct({}, inputs={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}), "static"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "exl2"}, "'exl2'"),
    ],
)  # fmt: skip
def test_parse_refused(qc, named):
    with pytest.raises(ConfigError) as e:
        parse_quantization_config({"quantization_config": qc})
    msg = str(e.value)
    assert named in msg and "quant_method=" in msg and "supported:" in msg


def test_parse_unquantized_and_module_filters():
    assert parse_quantization_config(None) is None and parse_quantization_config({"model_type": "llama"}) is None
    assert parse_quantization_config({"model_type": "llama", "quantization_config": None}) is None
    with pytest.raises(ConfigError, match="quant_method=None"):
        parse_quantization_config({"load_in_4bit": True})
    ct = parse_quantization_config(_ct({}))
    assert ct.quantized("model.layers.0.mlp.up_proj") and not ct.quantized("model.layers.0.mlp.down_proj")
    assert not ct.quantized("lm_head")
    awq = parse_quantization_config({**AWQ, "modules_to_not_convert": ["mlp.gate_proj"]})
    assert not awq.quantized("model.layers.3.mlp.gate_proj.") and awq.quantized("model.layers.3.mlp.up_proj.")
    blocks = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.down_proj"]]
    gptq = parse_quantization_config({**GPTQ, "modules_in_block_to_quantize": blocks})
    assert gptq.quantized("model.layers.0.self_attn.k_proj") and not gptq.quantized("model.layers.0.self_attn.o_proj")


def test_tensor_names():
    p = "model.layers.0.self_attn.q_proj."
    roles = {
        None: {"weight"},
        QuantSpec("gptq", bits=4): {"qweight", "qzeros", "scales", "g_idx"},
        QuantSpec("awq", bits=4): {"qweight", "qzeros", "scales"},
        QuantSpec("fp8_block", weight_block_size=(128, 128)): {"weight", "weight_scale_inv"},
        QuantSpec("fp8_channel"): {"weight", "weight_scale"},
    }
    for spec, want in roles.items():
        names = tensor_names(spec, p)
        assert names == {r: p + r for r in want | {"bias"}}
    assert tensor_names(QuantSpec("gptq", bits=4), "lm_head.") == {"weight": "lm_head.weight", "bias": "lm_head.bias"}


# ---- the checkpoint writers ----


def _hf_checkpoint(path: Path, arch: str, dtype: torch.dtype) -> Path:
    """A tiny random HF checkpoint (as test_torch_runner.tiny_checkpoint builds, with 128-wide inputs)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, eos_token_id=None, bos_token_id=None, pad_token_id=None)  # fmt: skip
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    (path / "tokenizer_config.json").write_text("{}")
    return path


@pytest.fixture(params=["llama-fp32", "qwen2-bf16", "sharded"])
def source(request, tmp_path):
    if request.param == "sharded":  # random_model's sharded checkpoint with index and tokenizer
        return request.getfixturevalue("tiny_hf_dir")
    arch, dtype = request.param.split("-")
    return _hf_checkpoint(tmp_path / "src", arch, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])


def _read_all(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            out.update({n: h.get_tensor(n) for n in h.keys()})
    return out


WRITERS = {
    "gptq": lambda s, d: quant_checkpoints.write_gptq(s, d, group_size=64),
    "gptq-act-order-asym": lambda s, d: quant_checkpoints.write_gptq(s, d, group_size=32, desc_act=True, sym=False),
    "gptq-v2-g-1": lambda s, d: quant_checkpoints.write_gptq(s, d, group_size=-1, sym=False, v2=True),
    "awq": lambda s, d: quant_checkpoints.write_awq(s, d, group_size=64),
    "fp8-block": quant_checkpoints.write_fp8_block,
    "fp8-channel": quant_checkpoints.write_fp8_channel,
}


@pytest.mark.parametrize("kind", list(WRITERS))
def test_checkpoint_writer(source, tmp_path, kind):
    dst = tmp_path / "dst"
    deq = WRITERS[kind](source, dst)
    src_t, dst_t = _read_all(source), _read_all(dst)
    # Every other file copied; the index (if any) names each written tensor's shard.
    others = {f.name for f in source.iterdir() if f.is_file() and not f.name.endswith(".safetensors")}
    assert others <= {f.name for f in dst.iterdir()}
    index = dst / "model.safetensors.index.json"
    if index.exists():
        wm = json.loads(index.read_text())["weight_map"]
        assert set(wm) == set(dst_t)
        for name, shard in wm.items():
            with safe_open(dst / shard, framework="pt") as h:
                assert name in h.keys()
    spec = parse_quantization_config(json.loads((dst / "config.json").read_text()))
    assert spec is not None
    linears = [n for n in src_t if quant_checkpoints.LINEAR.match(n)]
    assert set(deq) == set(linears) and len(linears) == 14
    for name, t in src_t.items():
        if name not in deq and not name.endswith("proj.bias"):
            assert torch.equal(dst_t[name], t), name  # copied unchanged
    for name in linears:
        W = src_t[name].float()
        N, K = W.shape
        prefix = name[: -len("weight")]
        names = tensor_names(spec, prefix)
        t = {r: dst_t[n] for r, n in names.items() if n in dst_t}
        if prefix + "bias" in src_t:
            want = torch.float16 if spec.method in ("gptq", "awq") else src_t[prefix + "bias"].dtype
            assert t["bias"].dtype == want
            torch.testing.assert_close(t["bias"].float(), src_t[prefix + "bias"].float(), rtol=1e-3, atol=1e-3)
        _check_layout(spec, t, N, K, src_t[name].dtype)
        c = to_canonical(spec, t)
        if spec.method in ("gptq", "awq"):
            Wc = F.dequantize_w4(c["qweight"], c["scales"], c["zeros"], spec.group_size)
            perm = c["perm"]
            if perm is not None:
                Wc = Wc[:, torch.argsort(perm)]  # back to the checkpoint's row order
        else:
            Wc = F.dequantize_fp8(c["weight"], c["scale"], 128 if spec.method == "fp8_block" else None)
        torch.testing.assert_close(Wc, deq[name], rtol=1e-6, atol=1e-7)
        # Quantized, not garbage: 4-bit RTN of a Gaussian is ~10% off in norm, E4M3 ~3%.
        assert (deq[name] - W).norm() <= (0.2 if spec.bits == 4 else 0.05) * W.norm(), name
    if kind == "gptq-act-order-asym":
        for layer in ("model.layers.0.", "model.layers.1."):
            gi = {p: dst_t[f"{layer}{p}.g_idx"] for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}
            assert torch.equal(gi["self_attn.q_proj"], gi["self_attn.k_proj"])
            assert torch.equal(gi["self_attn.q_proj"], gi["self_attn.v_proj"])
            assert torch.equal(dst_t[layer + "mlp.gate_proj.g_idx"], dst_t[layer + "mlp.up_proj.g_idx"])
            q_gi = gi["self_attn.q_proj"].long()
            assert not torch.equal(q_gi, torch.arange(q_gi.numel()) // 32)
            assert not torch.equal(q_gi, dst_t[layer + "self_attn.o_proj.g_idx"].long())


def _check_layout(spec: QuantSpec, t: dict[str, torch.Tensor], N: int, K: int, dtype: torch.dtype) -> None:
    """Names, dtypes and shapes as the real tools write them."""
    shapes = {k: (v.dtype, tuple(v.shape)) for k, v in t.items() if k != "bias"}
    G = K if spec.group_size == -1 else spec.group_size
    if spec.method == "gptq":
        want = {
            "qweight": (torch.int32, (K // 8, N)),
            "qzeros": (torch.int32, (K // G, N // 8)),
            "scales": (torch.float16, (K // G, N)),
            "g_idx": (torch.int32, (K,)),
        }
    elif spec.method == "awq":
        want = {
            "qweight": (torch.int32, (K, N // 8)),
            "qzeros": (torch.int32, (K // G, N // 8)),
            "scales": (torch.float16, (K // G, N)),
        }
    elif spec.method == "fp8_block":
        want = {
            "weight": (torch.float8_e4m3fn, (N, K)),
            "weight_scale_inv": (torch.float32, (-(-N // 128), -(-K // 128))),
        }
    else:
        want = {"weight": (torch.float8_e4m3fn, (N, K)), "weight_scale": (dtype, (N, 1))}
    assert shapes == want
