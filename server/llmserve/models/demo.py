"""The demo model, the default when no model is given: a small Llama trained here on the Python
standard library (`llmserve train --preset demo`, docs/models.md), committed as a Hugging Face
checkpoint under demo_model/ and exported to a Paddle static graph on first use. It completes
Python code (a 9.4 M-parameter code-completion model, bf16 weights, not a chat model); its
generation_config.json sets a repetition penalty of 1.2, the default of requests that set none.
Its checkpoint also holds a DeepSeek-V3-style MTP module (`model.layers.4.*`, `num_nextn_predict_layers: 1`) for
SPECULATE_METHOD=mtp, trained on the frozen trunk; the trunk's readers skip it.

Its Paddle export, and the earlier random-weight demo, are the Paddle runtime's: runners/paddle/demo.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

DEMO_HF_DIR = Path(__file__).resolve().parent / "demo_model"
# sha256 of demo_model/model.safetensors: `llmserve train --preset demo --seed 0 --tokenizer
# llmserve/models/demo_model --corpus STDLIB` on one H100 (run 2026-12-07: Python 3.11.7's stdlib .py files,
# torch 2.11, 2000 steps in 69 s) wrote the trunk; `--init-from TRUNK --mtp` then added the MTP module
# (model.layers.4.*, 800 steps, 24 s) with the trunk frozen, and wrote these bytes (docs/models.md).
# The preset was named demo-next then (train_metrics.json records that name).
DEMO_SHA256 = "52f152189ad84f83f96a33d090f65cf7fca1c17d177a70c24292e4886d5a17ed"
DEMO_VOCAB_SIZE = 2048  # of the random demo's tokenizer


def demo_weights_sha256() -> str:
    return hashlib.sha256((DEMO_HF_DIR / "model.safetensors").read_bytes()).hexdigest()
