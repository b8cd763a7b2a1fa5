"""The demo model: a small Llama-family decoder with seeded random weights and a
byte-level BPE tokenizer trained at build time on text that ships with the package.

It produces gibberish, but exercises every part of the stack for real, and it
is the default model when none is given.
"""

from __future__ import annotations

from pathlib import Path

from llmserve.models.config import ModelConfig

DEMO_VOCAB_SIZE = 2048


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


def export_demo(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the complete demo model directory (deterministic for a given seed)."""
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
