"""A checkpoint written by the real AutoAWQ, not by tests/quant_checkpoints.py: llmserve reads its packing.

tests/data/autoawq_tiny/ is a tiny random Llama (2 layers, hidden 128) that AutoAWQ 0.2.9's own package
calibrated and quantized on this machine's CPU (4-bit GEMM, zero point, group 64), made by
tests/data/make_autoawq_tiny.py (provenance.json there names the versions). AutoAWQ is not a test dependency:
it pins nothing that installs beside this project's torch, so the file is committed, with AutoAWQ's own
unpacking of each linear (q - z, int8) beside it. The tests: llmserve's dequantized weights are AutoAWQ's,
bit for bit, and the torch runner over the checkpoint gives HF's logits over those weights dense.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve.layers.quant import formats
from llmserve.layers.quant.checkpoint_config import parse_quantization_config, tensor_names, to_canonical

CKPT = Path(__file__).resolve().parent / "data" / "autoawq_tiny"
Q_MINUS_Z = CKPT.parent / "autoawq_tiny_q_minus_z.safetensors"  # outside the model's directory: not a shard
GROUP = 64


def _dequantized_by_autoawq() -> dict[str, torch.Tensor]:
    """{"...proj.weight": W [N, K] fp32}: AutoAWQ's q - z times the checkpoint's fp16 scales (exact in fp32:
    a 5-bit integer times an 11-bit significand), as awq.utils.packing_utils.dequantize_gemm multiplies them."""
    t = load_file(CKPT / "model.safetensors")
    out = {}
    for name, qz in load_file(Q_MINUS_Z).items():
        scales = t[name[: -len("weight")] + "scales"].float()  # [K // G, N]
        out[name] = qz.float() * scales.repeat_interleave(GROUP, dim=0).t()
    return out


def test_the_checkpoint_is_autoawqs():
    cfg = json.loads((CKPT / "config.json").read_text())
    assert json.loads((CKPT / "provenance.json").read_text())["tool"] == "AutoAWQ"
    spec = parse_quantization_config(cfg)
    assert (spec.method, spec.bits, spec.group_size) == ("awq", 4, GROUP)
    t = load_file(CKPT / "model.safetensors")
    assert sum(n.endswith(".qweight") for n in t) == 2 * 7  # every q/k/v/o/gate/up/down of both layers
    assert not any(n.endswith("proj.weight") for n in t)


def test_llmserve_dequantizes_autoawqs_weights_bit_for_bit():
    spec = parse_quantization_config(json.loads((CKPT / "config.json").read_text()))
    t = load_file(CKPT / "model.safetensors")
    want = _dequantized_by_autoawq()
    assert len(want) == 14
    for name, w in want.items():
        prefix = name[: -len("weight")]
        parts = {role: t[n] for role, n in tensor_names(spec, prefix).items() if n in t}
        c = to_canonical(spec, parts)
        got = formats.dequantize_w4(c["qweight"], c["scales"], c["zeros"], spec.group_size)
        assert got.shape == w.shape and torch.equal(got, w), name
        assert w.abs().max() > 0 and (w != 0).float().mean() > 0.5, name  # a real weight, not zeros


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp32 parity on the CPU; the GPU kernels have their own tests")
def test_runner_over_the_autoawq_checkpoint_matches_the_dense_model(tmp_path, fresh_seed):
    """Both compute in fp32 over the same weights: they differ by summation order only, so the bound is
    test_quant_model's fp32 parity bound (1e-4 of the logits' norm)."""
    from tests.test_quant_model import check_close, hf_logits, our_logits

    ref = tmp_path / "dense"  # the checkpoint with each packed linear replaced by its dequantized weight, in fp32
    ref.mkdir()
    cfg = json.loads((CKPT / "config.json").read_text())
    del cfg["quantization_config"]
    (ref / "config.json").write_text(json.dumps(cfg))
    t = load_file(CKPT / "model.safetensors")
    dense = {n: v.float() for n, v in t.items() if not n.endswith((".qweight", ".qzeros", ".scales"))}
    save_file({**dense, **_dequantized_by_autoawq()}, ref / "model.safetensors", metadata={"format": "pt"})
    rng = np.random.default_rng(fresh_seed)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (3, 17, 40)]
    check_close(our_logits(CKPT, prompts), hf_logits(ref, "llama", prompts), 1e-4)
