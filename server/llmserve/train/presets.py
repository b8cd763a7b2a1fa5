"""Model shapes and training settings of the reference models (docs/models.md).

Llama decoders (GQA, RoPE, RMSNorm, SwiGLU), and DeepSeek-V3 ones (`deepseek`: MLA and experts), over one
tokenizer. A preset trains for
`max_steps` steps (a reproducible schedule) or, when it has none, for as many steps as fit in
`max_seconds` (measured on the first steps); `max_seconds` also caps a step-count run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeepSeekShape:
    """A DeepSeek-V3 decoder's attention (MLA) and experts (deepseek_config.py reads the same fields)."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # DeepSeek-V3's auxiliary-loss-free balancing: after each step every expert's score-correction bias moves by
    # this much towards the mean load (down when the expert took more than its share, up when less).
    bias_update_speed: float = 1e-3

    def attention_params(self, h: int, heads: int) -> int:
        qk, r = self.qk_nope_head_dim + self.qk_rope_head_dim, self.kv_lora_rank
        q = h * heads * qk if self.q_lora_rank is None else h * self.q_lora_rank + self.q_lora_rank * (1 + heads * qk)
        kv = h * (r + self.qk_rope_head_dim) + r + r * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * h

    def moe_params(self, h: int) -> int:
        experts = (self.n_routed_experts + self.n_shared_experts) * 3 * h * self.moe_intermediate_size
        return experts + self.n_routed_experts * h  # + the router


@dataclass(frozen=True)
class Preset:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool
    seq_len: int  # tokens per training window
    batch_size: int  # windows per step
    lr: float
    warmup_steps: int
    max_steps: int | None
    max_seconds: float | None
    eval_windows: int  # held-out windows of seq_len tokens for the perplexity
    vocab_size: int = 8192  # of the tokenizer trained when none is given
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.1
    mtp_loss_weight: float = 0.3  # DeepSeek-V3's lambda for the first 10T tokens
    mtp_steps: int | None = None  # steps of an MTP module trained alone on a frozen trunk (--init-from)
    mtp_copies: bool = True  # --init-from writes the MTP layer's copies of the embedding and LM head
    save_dtype: str = "float32"  # of model.safetensors (bfloat16: half the bytes; readers widen it)
    chat_every: int = 0  # every Nth training file also as a ChatML exchange (corpus.py); 0: none
    # Written into generation_config.json: the decoding default where a request sets none (None: no default).
    repetition_penalty: float | None = None
    deepseek: DeepSeekShape | None = None  # a DeepSeek-V3 model (MLA + experts) instead of Llama

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def layer_params(self, i: int = 0) -> int:
        """Layer i's parameters (DeepSeek: dense MLPs before first_k_dense_replace, experts after)."""
        h, ds = self.hidden_size, self.deepseek
        if ds is None:
            kv = self.num_key_value_heads * self.head_dim
            attn = 2 * h * h + 2 * h * kv  # q, o; k, v
            return attn + 3 * h * self.intermediate_size + 2 * h  # + gate, up, down + two norms
        mlp = 3 * h * self.intermediate_size if i < ds.first_k_dense_replace else ds.moe_params(h)
        return ds.attention_params(h, self.num_attention_heads) + mlp + 2 * h

    def num_params(self, vocab_size: int | None = None) -> int:
        """Parameters of the model (without an MTP module)."""
        v = vocab_size or self.vocab_size
        embeddings = v * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + sum(self.layer_params(i) for i in range(self.num_hidden_layers)) + self.hidden_size

    def mtp_params(self) -> int:
        """An MTP module's own parameters: enorm, hnorm, eh_proj, one layer (layer N's), shared_head.norm."""
        h = self.hidden_size
        return 3 * h + 2 * h * h + self.layer_params(self.num_hidden_layers)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # Tests: a few seconds on one CPU core.
        Preset("tiny", 64, 128, 2, 4, 2, True, seq_len=64, batch_size=8, lr=3e-3, warmup_steps=5,
               max_steps=30, max_seconds=None, eval_windows=16, vocab_size=384, max_position_embeddings=512),
        # The first demo (until issue 45), reproducible on the CI machine: 640 steps in about 8 minutes on
        # 2 CPU cores (0.7 s a step); float32 weights 7 MiB. Its MTP module alone on the frozen trunk
        # (--init-from): 480 steps, ~0.5 s a step, written without the copies of embedding and head.
        Preset("demo-cpu", 128, 384, 4, 4, 2, True, seq_len=256, batch_size=16, lr=3e-3, warmup_steps=50,
               max_steps=640, max_seconds=None, eval_windows=256, max_position_embeddings=8192, mtp_steps=480,
               mtp_copies=False),
        # The demo (the default model, docs/models.md): the draft's shape, 2000 steps (~70 s on one H100),
        # ChatML exchanges in the corpus, a bf16 file (18.9 MB + its MTP module 3.7 MB, 800 steps on the
        # frozen trunk, without copies of embedding and head: +12.6 MB), and a repetition penalty of 1.2 as
        # its decoding default: greedy without it, 8 of the 12 everyday prompts loop (train/samples.py).
        Preset("demo", 384, 1024, 4, 6, 2, True, seq_len=1024, batch_size=32, lr=2e-3, warmup_steps=100,
               max_steps=2000, max_seconds=None, eval_windows=256, max_position_embeddings=8192, mtp_steps=800,
               mtp_copies=False, save_dtype="bfloat16", chat_every=8, repetition_penalty=1.2),
        # Speculative decoding's draft for the target: same tokenizer, <= 1/8 of its parameters.
        Preset("draft", 384, 1024, 4, 6, 2, True, seq_len=1024, batch_size=32, lr=2e-3, warmup_steps=100,
               max_steps=None, max_seconds=120, eval_windows=256),
        # The target: the largest model that trains in 4 minutes on one H100 / H200.
        Preset("target", 768, 2048, 12, 12, 4, False, seq_len=1024, batch_size=32, lr=1e-3, warmup_steps=100,
               max_steps=None, max_seconds=240, eval_windows=256),
        # DeepSeek-V3's family in miniature (tests: seconds on one CPU core): q LoRA, MLA, a dense first layer,
        # then 8 experts top-2 in 2 groups + a shared one; with --mtp its MTP layer is a MoE layer too.
        Preset("tiny-deepseek", 64, 128, 2, 4, 4, True, seq_len=64, batch_size=8, lr=3e-3, warmup_steps=5,
               max_steps=30, max_seconds=None, eval_windows=16, vocab_size=384, max_position_embeddings=512,
               deepseek=DeepSeekShape(32, 48, 16, 8, 16, 8, 1, 2, 32, n_group=2, topk_group=1,
                                      routed_scaling_factor=2.5, bias_update_speed=1e-2)),
        # Its reference model on the GPU, the target's budget: 12 layers of MLA (kv_lora 256) and 32 experts
        # top-4 + 1 shared (4 groups, 2 kept), layer 0 dense.
        Preset("target-deepseek", 768, 2048, 12, 12, 12, False, seq_len=1024, batch_size=32, lr=1e-3,
               warmup_steps=100, max_steps=None, max_seconds=240, eval_windows=256,
               deepseek=DeepSeekShape(256, 384, 64, 32, 64, 32, 1, 4, 384, n_group=4, topk_group=2,
                                      routed_scaling_factor=2.5)),
    )
}  # fmt: skip
