"""The demo model, the default when no model is given: a small Llama trained here on the Python
standard library (`llmserve train --preset demo`, docs/models.md), committed as a Hugging Face
checkpoint under demo_model/ and exported to a Paddle static graph on first use. It completes
Python code (a 1.8 M-parameter code-completion model, not a chat model). Its checkpoint also holds a
DeepSeek-V3-style MTP module (`model.layers.4.*`, `num_nextn_predict_layers: 1`) for
SPECULATE_METHOD=mtp, trained on the frozen trunk; the trunk's readers skip it.

Its Paddle export, and the earlier random-weight demo, are the Paddle runtime's: runners/paddle/demo.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

DEMO_HF_DIR = Path(__file__).resolve().parent / "demo_model"
# sha256 of demo_model/model.safetensors: `llmserve train --preset demo --device cpu --seed 0` on the
# CI machine (2 threads, Python 3.11.7's stdlib, torch 2.x CPU) wrote the trunk (its file had sha256
# 9d7a8adb16f753b2...); `llmserve train --preset demo --device cpu --seed 0 --init-from DIR --mtp` then
# added an MTP module (model.layers.4.*) with the trunk frozen, and wrote these bytes (docs/models.md).
DEMO_SHA256 = "0ac4be5a2e18bb9c38470b011a1550128003c0a19d3985df8a87b2f7b3729898"
DEMO_VOCAB_SIZE = 2048  # of the random demo's tokenizer


def demo_weights_sha256() -> str:
    return hashlib.sha256((DEMO_HF_DIR / "model.safetensors").read_bytes()).hexdigest()
