"""MTP proposals (SPECULATE_METHOD=mtp) on the torch runner: a head proposer (head_proposer.py).

A DeepSeek-V3-style multi-token-prediction module (train/mtp.py; checkpoint tensors under
`model.layers.{N}.`, `num_nextn_predict_layers` in config.json) over the target's trunk: at position
i it takes the trunk's last hidden state h_i and the embedding of token t_{i+1} and predicts t_{i+2}:

    x = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))      (embedding zeroed at position 0)
    y = shared_head.norm(decoder_layer(x))                   one layer, causal, RoPE at i
    logits = lm_head(y)                                      shared_head.head, or the trunk's LM head

The decoder layer is the model family's, built by the model (`load_head_layer`) and run as it runs its
own (`layer`): a Llama / Qwen2 layer, or DeepSeek-V2/V3's (MLA, and the experts where the layer's index
says: V3's MTP layer is a MoE layer). `embed_tokens` and `shared_head.head` under the module's prefix,
where the checkpoint has them, are copies of the trunk's (DeepSeek-V3 shares them): the trunk's serve,
unless a copy differs.

Its K/V live in one more layer of the target's KV cache, at the same slots as the target's (MLA: one
more latent row): the target's block tables, rollback and block lifetimes serve it unchanged. Two parts:

- `MTPHead.extend`, after every target step (`MTPProposer.after_step`, whatever k) that may precede
  a speculating one (`StepBatch.proposer_state`; the draft-length rule says when): the module over
  every position the step computed, with t_{i+1} the next input token or, at sampled rows, the token
  the target drew there (for a verification row j: the token at row j, which equals draft j + 1
  where it was accepted). Rows past a rejection write K/V that the rollback makes stale and a later
  step overwrites. Each sampled request's y at its last accepted position is kept (`state`): it
  predicts the token after the one just drawn, the first proposal.
- `MTPProposer`: before scheduling it asks for k placeholder proposals, so that the scheduler reserves
  their KV slots within its budget and limits; after scheduling (`fill`) it writes the real ones: the
  first from the kept y, then a chain of k - 1 single-token steps that feed the module its own output
  y in place of the trunk's (not yet computed) hidden state and its last proposal as the next token,
  writing K/V at the reserved slots (overwritten by the verification step's extend). Proposals are the
  module's argmax, verified as one-hot proposals (lossless for greedy and sampled requests alike).
  Tokens stay on the device through the chain; one copy to the host at its end.
On CUDA the module runs as graphs captured beside the step graphs (cuda_graphs.py, `graph_forward`):
after a replayed step over that graph's static inputs and hidden output, and for each chain step over
the decode graph of its bucket; after an eager step, and where no graph fits, it runs eagerly.

A step the rule runs plain with no speculation to follow skips the module (on a host-bound target
it would cost a third of the step) and forgets its requests' kept y: they propose again one step
after a step that ran it. Its positions keep no MTP entry (whatever the slots held): weaker
proposals over that stretch, never a wrong output.

The MTP entry of a position depends on the token after it, so a block shared through the prefix
cache holds, at its last position, the entry of the request that wrote it: a weaker proposal for a
request that continues differently, never a wrong output (verification is lossless).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from llmserve.config import Config, ConfigError
from llmserve.engine.request import Request
from llmserve.engine.runner_contract import SeqChunk, StepBatch
from llmserve.kernels.attention import AttnMeta
from llmserve.kernels.norm import rms_norm
from llmserve.layers.kv_cache import LayerKV
from llmserve.layers.linear import Linear
from llmserve.layers.model_config import ModelConfig
from llmserve.layers.parallel import TensorParallel
from llmserve.layers.quant.methods import LinearMethod, load_linear
from llmserve.layers.weights import WeightReader
from llmserve.runners.torch.head_proposer import HeadProposer, TargetStep
from llmserve.runners.torch.inputs import FedChunk, StepInputs, host_arrays


class TrunkModel(Protocol):
    """What the head uses of the target's model (models/llama.py's DecoderModel, models/deepseek.py's)."""

    cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype
    out_dtype: torch.dtype  # what its products write
    method: LinearMethod
    tp: TensorParallel
    embed: torch.Tensor
    lm_head: torch.Tensor

    def load_head_layer(self, r: WeightReader, p: str) -> Any: ...

    def layer(
        self, lw: Any, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
        meta: AttnMeta, kv: LayerKV,
    ) -> torch.Tensor: ...  # fmt: skip

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass
class MTPWeights:
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: Linear  # 2 * hidden -> hidden: embedding half first
    layer: Any  # the family's layer weights (TrunkModel.load_head_layer)
    norm: torch.Tensor  # shared_head.norm
    embed: torch.Tensor  # the trunk's, or the module's own where it differs
    lm_head: torch.Tensor  # likewise (shared_head.head)


def own_copy(r: WeightReader, name: str, trunk: torch.Tensor) -> torch.Tensor:
    """The module's copy `name` of a trunk tensor: the trunk's where it has none or an equal one (no second
    copy in memory), else its own."""
    if not r.has(name):
        return trunk
    t = r.get(name)
    if t.shape != trunk.shape:
        raise ConfigError(f"SPECULATE_METHOD=mtp: {name} has shape {tuple(t.shape)}, the model's {tuple(trunk.shape)}")
    return trunk if torch.equal(t, trunk) else t


def find_mtp(model_dir: str, config: Config, hidden_size: int) -> tuple[Path, str]:
    """(checkpoint directory, tensor prefix) of the MTP module: SPECULATE_MODEL_PATH when set, else
    MODEL_DIR. ConfigError naming the setting when there is none."""
    where = config.speculate_model_path or model_dir
    setting = "SPECULATE_MODEL_PATH" if config.speculate_model_path else "MODEL_DIR"
    d = Path(where)
    if not d.is_dir() or not any(d.glob("*.safetensors")):
        raise ConfigError(f"SPECULATE_METHOD=mtp: {setting}={where!r} is not an HF safetensors checkpoint")
    reader = WeightReader(d, torch.device("cpu"), torch.float32)
    prefixes = sorted(
        (n[: -len("eh_proj.weight")] for n in reader.where if n.endswith(".eh_proj.weight")),
        key=lambda p: int(p.split(".")[-2]) if p.split(".")[-2].isdigit() else 0,
    )
    if not prefixes:
        layers = None
        if (d / "config.json").is_file():
            layers = json.loads((d / "config.json").read_text()).get("num_nextn_predict_layers")
        raise ConfigError(
            f"SPECULATE_METHOD=mtp: {setting}={where!r} has no MTP module (no `model.layers.N.eh_proj.weight`; "
            f"num_nextn_predict_layers={layers}): serve a checkpoint with one, point SPECULATE_MODEL_PATH at "
            "it, or use SPECULATE_METHOD=ngram or draft"
        )
    p = prefixes[0]
    shape = tuple(reader.get(p + "enorm.weight").shape)
    if shape != (hidden_size,):
        raise ConfigError(
            f"SPECULATE_METHOD=mtp: the MTP module in {setting}={where!r} has hidden size {shape[0]}, "
            f"the model {hidden_size}"
        )
    return d, p


class MTPHead:
    """The module's weights, its forward over the KV cache's extra layer, and the kept outputs."""

    def __init__(self, model: TrunkModel, model_dir: str, config: Config, upload) -> None:
        self.model = model
        self.upload = upload  # Uploader.upload: host int32 arrays to the device through pinned memory
        d, p = find_mtp(model_dir, config, model.cfg.hidden_size)
        r = WeightReader(d, model.device, model.dtype)
        method = model.method  # the module is quantized as the trunk is (a dense tensor stays dense)
        self.w = MTPWeights(
            r.get(p + "enorm.weight"), r.get(p + "hnorm.weight"), load_linear(method, r, (p + "eh_proj.", None)),
            model.load_head_layer(r, p), r.get(p + "shared_head.norm.weight"),
            own_copy(r, p + "embed_tokens.weight", model.embed), own_copy(r, p + "shared_head.head.weight", model.lm_head),
        )  # fmt: skip
        # Each request's y at its last accepted position: row self.rows[req_id] of `state`.
        self.state = torch.zeros(0, model.cfg.hidden_size, dtype=model.dtype, device=model.device)
        self.rows: dict[str, int] = {}
        self._free: list[int] = []

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, x: StepInputs, kv: LayerKV) -> torch.Tensor:
        """y [T, hidden] (after shared_head.norm) at positions `x.positions`, given the trunk's (or the
        chain's) hidden state there and the next token; writes the module's K/V into `kv`."""
        m, w, eps = self.model, self.w, self.model.cfg.rms_norm_eps
        e = F.embedding(next_ids, w.embed) * (x.positions != 0)[:, None].to(m.dtype)
        cat = torch.cat([rms_norm(e, w.enorm, eps), rms_norm(hidden.to(m.dtype), w.hnorm, eps)], dim=-1)
        h = w.eh_proj(cat, m.out_dtype)
        residual = h.float()
        out = m.layer(w.layer, rms_norm(h, w.layer.in_norm, eps), residual, x.positions, x.slot_mapping, x.meta, kv)
        return m.tp.sum_norm(out, w.norm, eps, residual)

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32 of the module's outputs: the trunk's LM head, or the module's own."""
        if self.w.lm_head is self.model.lm_head:
            return self.model.logits(y)
        return self.model.method.dense.apply({"weight": self.w.lm_head}, y, None, torch.float32)

    def _row(self, req_id: str) -> int:
        r = self.rows.get(req_id)
        if r is None:
            if not self._free:
                n = self.state.shape[0]
                grow = max(64, n)
                self.state = torch.cat([self.state, self.state.new_zeros(grow, self.state.shape[1])])
                self._free = list(range(n + grow - 1, n - 1, -1))
            r = self.rows[req_id] = self._free.pop()
        return r

    def drop(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            r = self.rows.pop(rid, None)
            if r is not None:
                self._free.append(r)

    def extend(self, step: TargetStep, kv: LayerKV, run=None) -> None:
        """After a target step (module doc): the module's K/V at the step's positions, and each sampled
        request's y at its last accepted position. The step's hidden states and inputs are its rows in
        its layout (`layout[i]`: the row of packed token i; None: in order; a CUDA graph's pad rows write
        no K/V). `run(next_ids)`: the module's output over those rows from a captured graph
        (cuda_graphs.py), else it runs eagerly."""
        chunks, a, hidden, x, layout = step.chunks, step.arrays, step.hidden, step.inputs, step.layout
        tokens, num_new = step.tokens, step.num_new
        ids, cu = a["ids"], a["cu_q"]
        nxt = np.zeros(ids.shape[0], dtype=np.int64)
        nxt[:-1] = ids[1:]
        for i, c in enumerate(chunks):
            if not c.sample:  # a prompt piece: the prompt token after it
                end = c.start + c.num_tokens
                nxt[cu[i + 1] - 1] = c.request.token_ids_slice(end, end + 1)[0]
        sample = a["sample_tok"]
        if layout is not None:
            nxt_rows = np.zeros(hidden.shape[0], dtype=np.int64)
            nxt_rows[layout] = nxt
            nxt, sample = nxt_rows, layout[sample]
        sampled = [c for c in chunks if c.sample]
        rows = np.fromiter((self._row(c.request.req_id) for c in sampled), np.int64, len(sampled))
        n_rows = np.fromiter((c.num_sampled_rows for c in sampled), np.int64, len(sampled))
        # One pinned upload (a pageable copy would wait for the step in flight).
        nxt_dev, sample_dev, rows_dev, first = self.upload([nxt, sample, rows, np.cumsum(n_rows) - n_rows])
        nxt_dev, sample_dev = nxt_dev.long(), sample_dev.long()
        nxt_dev[sample_dev] = tokens  # sampled rows: what the target drew there
        y = run(nxt_dev) if run is not None else self.forward(nxt_dev, hidden, x, kv)
        if not sampled:
            return
        last = sample_dev if num_new is None else sample_dev[first.long() + num_new.long() - 1]
        self.state[rows_dev.long()] = y[last]


class MTPProposer(HeadProposer):
    """The module's extend after each target step; placeholders before scheduling, the module's
    proposals after it (module doc)."""

    PLACEHOLDER = 0
    kv_layers = 1  # the module's K/V

    def __init__(self, runner, model_dir: str, config: Config) -> None:  # runner: a TorchRunner
        super().__init__(runner, model_dir, config)
        self.head = MTPHead(runner.model, model_dir, config, runner.uploader.upload)

    def after_step(self, step: TargetStep) -> None:
        """The module's K/V at the step's positions (MTPHead.extend); after a replayed graph, as the
        module's graph beside it."""
        g, key, run = step.graphs, step.graph_key, None
        if g is not None and key in g.head_graphs:
            run = partial(self._replay, g, hidden=None, key=key)
        kv = self.kv_layer(self.runner.kv_cache, self.runner.model)
        self.head.extend(step, kv, run)

    # ---- CUDA graphs (cuda_graphs.DecodeGraphs) ---------------------------------------
    def graph_buffers(self, max_tokens: int, device: torch.device) -> torch.Tensor:
        """The next token of each graph row."""
        return torch.zeros(max_tokens, dtype=torch.long, device=device)

    def graph_forward(self, graphs, key: tuple[int, int]) -> torch.Tensor:
        """The module over the graph's positions: its hidden output and the static next tokens."""
        q, bs = key
        kv = self.kv_layer(graphs.kv_cache, graphs.model)
        return self.head.forward(graphs.head_static[: bs * q], graphs.hidden[key], graphs.inputs(key), kv)

    @staticmethod
    def _replay(graphs, next_ids: torch.Tensor, hidden: torch.Tensor | None, key: tuple[int, int]) -> torch.Tensor:
        """The module's graph `key` over its positions with these next tokens, and these hidden states
        in place of the step graph's own output (the chain, after `graphs.load`); its output y for
        those rows (a view of a static buffer)."""
        n = next_ids.shape[0]
        if hidden is not None:
            graphs.hidden[key][:n].copy_(hidden)
        graphs.head_static[:n].copy_(next_ids)
        graphs.replay_head(key)
        return graphs.head_out[key][:n]

    # ---- Proposer ---------------------------------------------------------------------

    def propose(self, reqs: list[Request], k: int) -> None:
        for req in reqs:  # a request the module has not seen yet (none kept) waits a step
            req.draft_token_ids = [self.PLACEHOLDER] * k if req.req_id in self.head.rows else []

    def drop(self, req_ids: list[str]) -> None:
        self.head.drop(req_ids)

    @torch.inference_mode()
    def fill(self, chunks: list[SeqChunk]) -> None:
        chunks = [c for c in chunks if c.draft_token_ids]
        if not chunks:
            return
        head, runner = self.head, self.runner
        ks = [len(c.draft_token_ids) for c in chunks]
        (rows,) = head.upload([np.fromiter((head.rows[c.request.req_id] for c in chunks), np.int64, len(chunks))])
        y = head.state[rows.long()]
        tok = head.logits(y).argmax(-1)
        drafts = [tok]
        kv = self.kv_layer(runner.kv_cache, runner.model)
        for s in range(1, max(ks)):
            act = [i for i, k in enumerate(ks) if k > s]
            # Position of draft s's input: the chunk starts at the request's last token (draft 0's).
            fed = [FedChunk(chunks[i].request, chunks[i].start + s - 1, 1, True, ids=[0]) for i in act]
            a = host_arrays(fed, runner.block_size)
            (idx,) = head.upload([np.asarray(act, np.int64)])
            idx = idx.long()
            g = runner.graphs
            if g is not None and g.head_graphs and g.bucket(len(act)) is not None and a["bt"].shape[1] <= g.max_blocks:
                bs = g.load(a)  # the module's decode graph over the chain's positions
                y_act = self._replay(g, tok[idx], y[idx], (1, bs))
            else:
                y_act = head.forward(tok[idx], y[idx], runner.prepare(StepBatch(fed), a), kv)
            y, tok = y.clone(), tok.clone()
            y[idx] = y_act
            tok[idx] = head.logits(y_act).argmax(-1)
            drafts.append(tok)
        got = torch.stack(drafts, dim=1).tolist()  # the one device sync
        for c, k, row in zip(chunks, ks, got):
            c.draft_token_ids[:] = row[:k]
            c.request.draft_token_ids = c.draft_token_ids
