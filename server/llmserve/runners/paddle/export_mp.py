"""Tensor-parallel export (`llmserve export --mp N`): one static graph per rank, Megatron style.

Rank r of N holds (docs/model_format.md, "Sharded export"):
- q/k/v and gate/up column-parallel: query heads [r H/N, (r+1) H/N) and their KV heads (with
  fewer KV heads than ranks, KV head r // (N / KVH), replicated), intermediate [r I/N, (r+1) I/N);
- o and down row-parallel (their input rows split), each followed by an all-reduce;
- embedding and LM head split along the vocabulary (padded with zeros to a multiple of N): the
  embedding is `c_embedding` (zero outside the rank's range) plus an all-reduce, the logits an
  all-gather sliced back to the real vocabulary.
The collectives are Paddle's ops on communicator ring 0 (`mp_allreduce_sum`, as PaddleNLP's exports,
and `all_gather`). paddle.inference creates that communicator (NCCL) from `rank_mapping.csv` on GPU
builds only; on CPU the graphs run under `paddle.distributed` with gloo (tests/test_export_mp.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import paddle

from llmserve.layers.model_config import ModelConfig
from llmserve.runners.paddle.graph import LlamaPaddle

RING_ID = 0  # the model-parallel group: every rank (rank_mapping.csv)


def check_mp(cfg: ModelConfig, mp: int) -> None:
    """Raise ValueError naming every setting that N ranks cannot split evenly."""
    if mp < 1:
        raise ValueError(f"--mp {mp}: the number of ranks must be at least 1")
    if mp == 1:
        return
    h, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    problems = []
    if h % mp:
        problems.append(f"num_attention_heads={h} is not a multiple of {mp}")
    if kv % mp and mp % kv:
        problems.append(f"num_key_value_heads={kv} neither is a multiple of {mp} nor divides it")
    if inter % mp:
        problems.append(f"intermediate_size={inter} is not a multiple of {mp}")
    if problems:
        raise ValueError(f"--mp {mp}: cannot shard this model over {mp} ranks: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class RankShard:
    """What rank `rank` of `world` holds of the model `cfg` (index ranges are [start, end))."""

    cfg: ModelConfig
    rank: int
    world: int

    @property
    def vocab_padded(self) -> int:
        return -(-self.cfg.vocab_size // self.world) * self.world

    def _range(self, total: int) -> tuple[int, int]:
        n = total // self.world
        return self.rank * n, (self.rank + 1) * n

    @property
    def heads(self) -> tuple[int, int]:
        return self._range(self.cfg.num_attention_heads)

    @property
    def kv_heads(self) -> tuple[int, int]:
        kv = self.cfg.num_key_value_heads
        if kv >= self.world:
            return self._range(kv)
        j = self.rank // (self.world // kv)  # replicated: the KV head of this rank's query heads
        return j, j + 1

    @property
    def intermediate(self) -> tuple[int, int]:
        return self._range(self.cfg.intermediate_size)

    @property
    def vocab(self) -> tuple[int, int]:
        return self._range(self.vocab_padded)

    def local_config(self) -> ModelConfig:
        """The shapes of this rank's graph (its caches hold only its KV heads)."""
        (h0, h1), (k0, k1), (i0, i1), (v0, v1) = self.heads, self.kv_heads, self.intermediate, self.vocab
        return dataclasses.replace(
            self.cfg,
            num_attention_heads=h1 - h0,
            num_key_value_heads=k1 - k0,
            intermediate_size=i1 - i0,
            vocab_size=v1 - v0,
        )

    def model(self):
        """The graph builder for `build_paged_program`: the decoder with this rank's collectives."""
        return functools.partial(LlamaPaddleTP, shard=self)

    def shard_weights(self, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This rank's slices of full weights in `param_shapes` layout ([in, out], q/k/v and gate/up fused)."""
        cfg, d = self.cfg, self.cfg.head_dim
        q_dim, kv_dim, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
        (h0, h1), (k0, k1), (i0, i1), (v0, v1) = self.heads, self.kv_heads, self.intermediate, self.vocab
        q_cols = np.arange(h0 * d, h1 * d)
        kv_cols = np.arange(k0 * d, k1 * d)
        qkv_cols = np.concatenate([q_cols, q_dim + kv_cols, q_dim + kv_dim + kv_cols])
        gate_up_cols = np.concatenate([np.arange(i0, i1), inter + np.arange(i0, i1)])
        pad = self.vocab_padded - cfg.vocab_size
        out = {}
        for name, x in w.items():
            if name.endswith("qkv_proj.weight"):
                x = x[:, qkv_cols]
            elif name.endswith("qkv_proj.bias"):
                x = x[qkv_cols]
            elif name.endswith("o_proj.weight"):
                x = x[h0 * d : h1 * d]
            elif name.endswith("gate_up_proj.weight"):
                x = x[:, gate_up_cols]
            elif name.endswith("down_proj.weight"):
                x = x[i0:i1]
            elif name == "embed_tokens.weight":
                x = np.pad(x, ((0, pad), (0, 0)))[v0:v1]
            elif name == "lm_head.weight":
                x = np.pad(x, ((0, 0), (0, pad)))[:, v0:v1]
            # else replicated: rope.inv_freq, the norms, o_proj.bias (added once, after the all-reduce)
            out[name] = np.ascontiguousarray(x, np.float32)
        return out

    def describe(self) -> dict:
        """tp.json: this rank's shard and where its collectives sit."""
        (h0, h1), (k0, k1), (i0, i1), (v0, v1) = self.heads, self.kv_heads, self.intermediate, self.vocab
        d = self.cfg.head_dim
        replicated = self.cfg.num_key_value_heads < self.world
        return {
            "rank": self.rank,
            "world_size": self.world,
            "ring_id": RING_ID,
            "vocab_size": self.cfg.vocab_size,
            "vocab_size_padded": self.vocab_padded,
            "attention_heads": [h0, h1],
            "key_value_heads": [k0, k1],
            "key_value_heads_replicated": replicated,
            "intermediate": [i0, i1],
            "vocab": [v0, v1],
            "shards": {
                "embed_tokens.weight": f"rows [{v0}, {v1}) of the padded vocabulary; c_embedding, then all-reduce",
                "self_attn.qkv_proj": f"columns: q heads [{h0}, {h1}), k and v heads [{k0}, {k1})",
                "self_attn.o_proj.weight": f"rows [{h0 * d}, {h1 * d}); all-reduce after (bias after it)",
                "mlp.gate_up_proj.weight": f"columns: gate [{i0}, {i1}) and up [{i0}, {i1})",
                "mlp.down_proj.weight": f"rows [{i0}, {i1}); all-reduce after",
                "lm_head.weight": f"columns [{v0}, {v1}); logits all-gathered, cut to vocab_size",
                "replicated": "rope.inv_freq, norms, o_proj.bias",
            },
            "collectives": {"all_reduce": "pd_op.mp_allreduce_sum", "all_gather": "pd_op.all_gather"},
        }


class LlamaPaddleTP(LlamaPaddle):
    """One rank's decoder: `cfg` is the rank's local config, `shard` says where it sits."""

    def __init__(self, cfg: ModelConfig, params: dict, shard: RankShard):
        super().__init__(cfg, params)
        self.shard = shard

    def _all_reduce(self, x):
        return paddle._C_ops.mp_allreduce_sum(x, RING_ID)

    def _embed(self, ids):
        # Rows outside [start, start + local rows) come out zero; the all-reduce fills them in.
        start = self.shard.vocab[0]
        part = paddle._C_ops.c_embedding(self.p["embed_tokens.weight"], ids, start, self.shard.vocab_padded)
        return self._all_reduce(part)

    def _logits(self, h):
        # all_gather stacks the ranks' [N, V/world] along rows; their vocab slices go side by side.
        # (PaddleNLP uses c_concat, whose CPU kernel is a stub; all_gather has CPU (gloo) and GPU
        # kernels, so these graphs also run, and are tested, on CPU.)
        s = self.shard
        gathered = paddle._C_ops.all_gather(super()._logits(h), RING_ID, s.world)
        full = paddle.concat(paddle.split(gathered, s.world, axis=0), axis=-1)
        return full if s.vocab_padded == s.cfg.vocab_size else full[:, : s.cfg.vocab_size]


def rank_shards(cfg: ModelConfig, mp: int) -> list[RankShard]:
    check_mp(cfg, mp)
    return [RankShard(cfg, r, mp) for r in range(mp)]


def write_rank_files(out: Path, shard: RankShard) -> None:
    (out / f"rank_{shard.rank}" / "tp.json").write_text(json.dumps(shard.describe(), indent=2) + "\n")


def write_rank_mapping(out: Path, mp: int) -> None:
    """paddle.inference's comm_init_config (PaddleNLP writes it as rank_mapping.csv): the ranks of
    each ring, then the rings of each rank. One ring here, RING_ID, over every rank."""
    ranks = ",".join(map(str, range(mp)))
    lines = ["[ring_id -> ranks]", f"{RING_ID},{ranks}", "[rank -> ring_ids]"]
    lines += [f"{r},{RING_ID}" for r in range(mp)]
    (out / "rank_mapping.csv").write_text("\n".join(lines) + "\n")
