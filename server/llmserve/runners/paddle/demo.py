"""The demo model as the Paddle runtime serves it: the trained demo (models/demo.py) exported to a static
graph, and `export_random_demo`, the earlier demo: seeded random weights of a larger shape and a tokenizer
trained on text that ships with the package (tests that want a fresh model per seed)."""

from __future__ import annotations

from pathlib import Path

from llmserve.engine.tokenizer import load_tokenizer
from llmserve.layers.model_config import ModelConfig
from llmserve.models.demo import DEMO_HF_DIR, DEMO_SHA256, DEMO_VOCAB_SIZE, demo_weights_sha256
from llmserve.models.demo_tokenizer import train_demo_tokenizer
from llmserve.runners.paddle.export import export_hf, export_random


def export_demo(out_dir: str | Path) -> Path:
    """The trained demo as a Paddle static graph (with its tokenizer), after checking its weights."""
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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_demo_tokenizer(str(out), vocab_size=DEMO_VOCAB_SIZE)
    tok = load_tokenizer(str(out))
    cfg = demo_config(tok.vocab_size, tok.bos_token_id, tuple(sorted(tok.eos_token_ids)))
    export_random(cfg, str(out), seed=seed)
    return out
