"""The demo model, the default when no model is given: a small Llama trained here on the Python
standard library (`llmserve train --preset demo`, docs/models.md), committed as a Hugging Face
checkpoint under demo_model/ and exported to a Paddle static graph on first use. It completes
Python code (a 1.8 M-parameter code-completion model, not a chat model). Its checkpoint also holds a
DeepSeek-V3-style MTP module (`model.layers.4.*`, `num_nextn_predict_layers: 1`) for
SPECULATE_METHOD=mtp, trained on the frozen trunk; the trunk's readers skip it.

`export_random_demo` writes the earlier demo: seeded random weights of a larger shape and a
tokenizer trained on text that ships with the package (tests that want a fresh model per seed).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from llmserve.layers.model_config import ModelConfig

DEMO_HF_DIR = Path(__file__).resolve().parent / "demo_model"
# sha256 of demo_model/model.safetensors: `llmserve train --preset demo --device cpu --seed 0` on the
# CI machine (2 threads, Python 3.11.7's stdlib, torch 2.x CPU) wrote the trunk (its file had sha256
# 9d7a8adb16f753b2...); `llmserve train --preset demo --device cpu --seed 0 --init-from DIR --mtp` then
# added an MTP module (model.layers.4.*) with the trunk frozen, and wrote these bytes (docs/models.md).
DEMO_SHA256 = "0ac4be5a2e18bb9c38470b011a1550128003c0a19d3985df8a87b2f7b3729898"
DEMO_VOCAB_SIZE = 2048  # of the random demo's tokenizer


def demo_weights_sha256() -> str:
    return hashlib.sha256((DEMO_HF_DIR / "model.safetensors").read_bytes()).hexdigest()


def export_demo(out_dir: str | Path) -> Path:
    """The trained demo as a Paddle static graph (with its tokenizer), after checking its weights."""
    from llmserve.models.export import export_hf

    got = demo_weights_sha256()
    if got != DEMO_SHA256:
        raise RuntimeError(
            f"{DEMO_HF_DIR}/model.safetensors is not the demo model's (sha256 {got}, expected {DEMO_SHA256})"
        )
    return export_hf(DEMO_HF_DIR, out_dir)


def demo_config(vocab_size: int, bos_token_id: int | None, eos_token_ids: tuple[int, ...]) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,  # GQA: 4 query heads share each KV head
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=8192,
        bos_token_id=bos_token_id,
        eos_token_ids=eos_token_ids,
    )


def export_random_demo(out_dir: str | Path, seed: int = 0) -> Path:
    """The random-weight demo directory (deterministic for a given seed)."""
    from llmserve.engine.tokenizer import load_tokenizer
    from llmserve.models.demo_tokenizer import train_demo_tokenizer
    from llmserve.models.export import export_random

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_demo_tokenizer(str(out), vocab_size=DEMO_VOCAB_SIZE)
    tok = load_tokenizer(str(out))
    cfg = demo_config(tok.vocab_size, tok.bos_token_id, tuple(sorted(tok.eos_token_ids)))
    export_random(cfg, str(out), seed=seed)
    return out
