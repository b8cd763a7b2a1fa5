"""Head proposers: speculative proposers that run inside the torch runner's step (SPECULATE_METHOD=mtp;
an EAGLE- or Medusa-style head would be one too).

A head reads the target's own outputs (its final hidden states, the tokens it drew) where a draft model
(draft.py) runs a model of its own. The runner builds the head of SPECULATE_METHOD (`HEADS`) before it
sizes its KV cache and captures its graphs, serves it as the engine's proposer (build_proposer), and
calls it at fixed points; neither runner.py nor cuda_graphs.py names a head:

- KV sizing: `kv_layers` more layers in the target's cache, after its own (a head's K/V share the
  target's slots, block tables and rollback); `kv_layer(cache, model)` is a head's first.
- After each step's sampling (runner.submit, nothing synced): `after_step(TargetStep)` when the
  step keeps the proposer's state (`StepBatch.proposer_state`); when it does not, the runner drops
  the step's sampled requests (`drop`): what the head kept for them is stale.
- CUDA graphs (cuda_graphs.DecodeGraphs): a head with `graph_buffers` gets a second graph beside each
  step graph (q, bucket), captured right after it over the same memory pool; `graph_forward(graphs,
  key)` is its work there, over the graph's static inputs (`graphs.inputs(key)`), its hidden output
  (`graphs.hidden[key]`) and the head's own static buffers (`graphs.head_static`). The head replays
  it itself (`graphs.replay_head(key)`, outputs in `graphs.head_out[key]`).
- Engine side it is a Proposer (engine/speculative.py): `propose` before scheduling, `fill` after.

A second head is one new module with a HeadProposer subclass, named in `HEADS` (and SPECULATE_METHODS
in config.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np
import torch

from llmserve.config import Config
from llmserve.engine.runner_contract import SeqChunk
from llmserve.engine.speculative import Proposer
from llmserve.layers.kv_cache import KVCache, LayerKV
from llmserve.runners.torch.inputs import StepInputs, host_arrays

# SPECULATE_METHOD -> its head: a HeadProposer subclass, or "module:class" (imported when served; a
# head module imports this one, so naming it here by its path keeps the imports acyclic).
HEADS: dict[str, str | type] = {"mtp": "llmserve.runners.torch.mtp:MTPProposer"}


@dataclass
class TargetStep:
    """What a head sees of a target step after its sampling (all on the device but the host arrays)."""

    chunks: list[SeqChunk]
    arrays: dict  # inputs.host_arrays of the chunks (packed-token order)
    hidden: torch.Tensor  # the step's final hidden states, rows in `layout`
    inputs: StepInputs  # its device inputs, in the same layout
    layout: np.ndarray | None  # layout[i]: the row of packed token i (None: in order; a graph's padded layout)
    tokens: torch.Tensor  # the tokens drawn, one per sampled row
    num_new: torch.Tensor | None  # verification steps: each sampled chunk's new tokens (accepted drafts + 1)
    graphs: object | None  # the runner's DecodeGraphs when one of them ran the step, else None
    graph_key: tuple[int, int] | None  # (q, bucket) of that graph


class HeadProposer(Proposer):
    """A proposer the torch runner runs inside its steps (module doc)."""

    per_step_state = True  # it reads every step's outputs (the engine may tell the runner to skip that)
    kv_layers = 0  # layers it adds to the target's KV cache

    def __init__(self, runner, model_dir: str, config: Config) -> None:
        """Built by the runner (`build_head`) once its model and uploader exist, before its KV cache."""
        self.runner = runner

    def kv_layer(self, cache: KVCache, model) -> LayerKV:
        """The head's first layer of the target's KV cache (after the model's own)."""
        return cache.layer(model.cfg.num_hidden_layers)

    def after_step(self, step: TargetStep) -> None:  # noqa: B027 - optional hook
        """After a target step that keeps the proposer's state (module doc)."""

    def graph_buffers(self, max_tokens: int, device: torch.device) -> object | None:
        """Static buffers of its graphs, for steps of up to `max_tokens` tokens; None: it captures none."""
        return None

    def graph_forward(self, graphs, key: tuple[int, int]) -> torch.Tensor:
        """Its work beside the step graph `key` (captured, and run eagerly to warm up), returning its output."""
        raise NotImplementedError


def target_step(chunks, hidden, x, layout, a, tokens, num_new, graphs, block_size: int) -> TargetStep:
    """A step as its head proposer sees it, after its launch (runner.submit's `_forward` parts: `x` and `a`
    None after a replayed graph and a graph-packed verification step)."""
    g = key = None
    if x is None:  # a replayed graph: its inputs, in its padded layout
        g, key = graphs, graphs.last_key
        x = g.inputs()
    a = a if a is not None else host_arrays(chunks, block_size)  # (after the launch)
    return TargetStep(chunks, a, hidden, x, layout, tokens, num_new, g, key)


def build_head(runner, model_dir: str, config: Config) -> HeadProposer | None:
    """The head of SPECULATE_METHOD for `runner` (None: the method has none)."""
    cls = HEADS.get(config.speculate_method)
    if cls is None:
        return None
    if isinstance(cls, str):
        module, name = cls.split(":")
        cls = getattr(importlib.import_module(module), name)
    return cls(runner, model_dir, config)
