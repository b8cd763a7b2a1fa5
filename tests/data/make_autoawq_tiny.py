"""Writes tests/data/autoawq_tiny/: a tiny random Llama quantized by AutoAWQ's own package (not by this project).

Run once by hand, in an environment with AutoAWQ (it is not a test dependency: see the README there):

    PYTHONPATH=<dir with autoawq 0.2.9 and its deps> python tests/data/make_autoawq_tiny.py

It writes the dense fp32 source model, lets AutoAWQ calibrate (its activation-aware scale search and
clipping) and pack it (GEMM version, 4-bit, zero point, group 64), and saves beside the checkpoint
AutoAWQ's own unpacking of every packed linear (awq.utils.packing_utils.dequantize_gemm with unit
scales: q - z): tests/test_autoawq_checkpoint.py loads the checkpoint with llmserve and compares.
AutoAWQ imports `datasets` at import time and uses it only to download calibration text; the
calibration here is token ids, so a module that only raises stands in for it (PYTHONPATH first).
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent / "autoawq_tiny"
GROUP = 64


def main() -> None:
    import awq
    from awq import AutoAWQForCausalLM
    from awq.utils.packing_utils import dequantize_gemm

    torch.manual_seed(20261207)
    src = Path(tempfile.mkdtemp()) / "src"
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-5,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(src, safe_serialization=True)
    model = AutoAWQForCausalLM.from_pretrained(str(src), device_map="cpu")
    rng = random.Random(7)
    calib = [[rng.randrange(256) for _ in range(64)] for _ in range(16)]  # token ids: no dataset download
    qcfg = {"zero_point": True, "q_group_size": GROUP, "w_bit": 4, "version": "GEMM"}
    model.quantize(None, quant_config=qcfg, calib_data=calib, max_calib_samples=16, max_calib_seq_len=64)
    shutil.rmtree(OUT, ignore_errors=True)
    model.save_quantized(str(OUT))
    ref = {}
    for f in OUT.glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            t = {n: h.get_tensor(n) for n in h.keys()}
        for n in t:
            if n.endswith(".qweight"):
                p = n[: -len("qweight")]
                # Unit scales: the tool's unpacking, order and zero points, q - z, as int8 [N, K] (a quarter of
                # fp32's bytes); the test multiplies by the scales, dequantize_gemm's last step, in fp32 (exact).
                w = dequantize_gemm(
                    t[n], t[p + "qzeros"], torch.ones_like(t[p + "scales"], dtype=torch.float32), 4, GROUP
                )
                ref[p + "weight"] = w.T.to(torch.int8).contiguous()
    save_file(ref, OUT.parent / "autoawq_tiny_q_minus_z.safetensors", metadata={"format": "pt"})  # not in the model dir
    versions = {"autoawq": awq.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
    (OUT / "provenance.json").write_text(json.dumps({"tool": "AutoAWQ", **versions, "python": sys.version}, indent=1))
    print(OUT, sorted(p.name for p in OUT.iterdir()))


if __name__ == "__main__":
    main()
