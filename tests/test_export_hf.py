"""HF checkpoint -> Paddle static graph: the exported graph reproduces transformers' logits.

The test writes tiny random checkpoints with transformers itself (float32 single file,
float32 sharded with an index, bfloat16), exports them with numpy-only safetensors
reading, and runs the export through PaddleRunner over a chunked prefill plus decode
steps. Reference: transformers in float32 (for bf16 checkpoints, the same bf16 weights
widened to float32, which is exact), eager attention. Tolerance rtol 1e-4: float32 with
different summation orders (fused vs separate q/k/v and gate/up GEMMs, paged attention).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from llmserve.config import Config
from llmserve.engine.request import Request
from llmserve.engine.runner_contract import SeqChunk
from llmserve.engine.sampling_params import SamplingParams
from llmserve.layers.model_config import ModelConfig
from llmserve.runners.paddle.export import SafetensorsReader, export_hf, hf_weight_files
from llmserve.runners.paddle.runner import PaddleRunner

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=300, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
)  # fmt: skip


class Greedy:
    def sample(self, logits, requests):
        return [int(i) for i in logits.argmax(-1)], None

    def drop(self, req_ids):
        pass


# Llama 3.1's rope scaling, with a short original context so all three frequency bands occur.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}


def write_checkpoint(path, arch: str, dtype, shard: bool, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**{**COMMON, "rope_theta": 500000.0, **overrides})
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**{**COMMON, "rope_theta": 1000000.0, **overrides})
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # spread the weights (biases and norms too) so every tensor matters
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path, max_shard_size="40KB" if shard else "1GB", safe_serialization=True)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))


def hf_logits(path, tokens: list[int]) -> np.ndarray:
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0].numpy()


def paged_logits(model_dir, tokens: list[int], prompt_len: int) -> np.ndarray:
    """Prefill `prompt_len` tokens in chunks of 5, then feed the rest one token per step; logits of every step."""
    runner = PaddleRunner(str(model_dir), Config(block_size=8, max_seq_len=128, block_bs=2), Greedy())
    req = Request("r", tokens, SamplingParams())
    req.block_table = [13, 2, 9, 4, 30, 1]
    steps = [(s, min(5, prompt_len - s)) for s in range(0, prompt_len, 5)] + [
        (p, 1) for p in range(prompt_len, len(tokens))
    ]
    rows = [runner.forward([SeqChunk(req, start, n, True)])[0][0] for start, n in steps]
    assert len(rows) == len(steps)
    return np.stack(rows), [start + n - 1 for start, n in steps]


@pytest.mark.parametrize(
    "arch,dtype,shard,extra",
    [
        ("llama", "float32", False, {}),
        ("llama", "float32", True, {"tie_word_embeddings": True, "num_key_value_heads": 1}),
        ("qwen2", "float32", True, {}),
        ("qwen2", "bfloat16", False, {"tie_word_embeddings": True}),
        ("llama", "float32", False, {"rope_scaling": LLAMA3_ROPE}),
    ],
    ids=["llama", "llama-tied-sharded", "qwen2-sharded", "qwen2-bf16-tied", "llama3-rope-scaling"],
)
def test_exported_graph_matches_transformers(tmp_path, arch, dtype, shard, extra, fresh_seed):
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    write_checkpoint(hf_dir, arch, getattr(torch, dtype), shard, seed=fresh_seed, **extra)
    assert (hf_dir / "model.safetensors.index.json").is_file() == shard
    export_hf(hf_dir, out)

    tokens = [int(t) for t in np.random.default_rng(fresh_seed).integers(0, 300, 30)]
    want = hf_logits(hf_dir, tokens)
    got, positions = paged_logits(out, tokens, prompt_len=17)
    np.testing.assert_allclose(got, want[positions], rtol=1e-4, atol=1e-4)
    assert np.abs(want).max() > 1.0  # the comparison is not between near-zero logits

    cfg = ModelConfig.from_file(out / "config.json")
    assert (
        cfg.architecture == arch
        and cfg.dtype == "float32"
        and cfg.tie_word_embeddings == bool(extra.get("tie_word_embeddings"))
    )
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"model_max_length": 128}
    assert not list(out.glob("*.safetensors")) and not (out / "model.safetensors.index.json").exists()
    runner = PaddleRunner(str(out), Config(block_size=8, max_seq_len=4096, block_bs=1), Greedy())
    assert runner.eos_token_ids == {1, 7} and runner.max_model_len == 128


def test_bf16_reader_widens_exactly(tmp_path):
    write_checkpoint(tmp_path, "qwen2", torch.bfloat16, shard=True)
    reader = SafetensorsReader(hf_weight_files(tmp_path))
    from safetensors.torch import load_file

    expected = {}
    for f in hf_weight_files(tmp_path):
        expected.update(load_file(f))
    assert sorted(reader.names()) == sorted(expected)
    for name, tensor in expected.items():
        assert tensor.dtype == torch.bfloat16
        np.testing.assert_array_equal(reader.get(name), tensor.float().numpy())


def test_unsupported_config_is_rejected(tmp_path):
    write_checkpoint(tmp_path, "llama", torch.float32, shard=False, mlp_bias=True)
    with pytest.raises(ValueError, match="mlp_bias"):
        export_hf(tmp_path, tmp_path / "out")
