"""The forward pass of a training step and the held-out evaluation (perplexity, top-1, MTP metrics)."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from llmserve.train.mtp import MTPLayer


def forward(model: PreTrainedModel, mtp: MTPLayer | None, x: torch.Tensor, autocast: bool, frozen: bool = False):
    """(trunk logits [B, S, V] float32, MTP logits [B, S-1, V] float32 or None); `frozen`: no trunk
    logits (None) and no autograd graph through the trunk."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        with torch.no_grad() if frozen else contextlib.nullcontext():
            h = model.model(input_ids=x, use_cache=False).last_hidden_state
            logits = None if frozen else model.lm_head(h).float()
        mtp_logits = model.lm_head(mtp.hidden(model, h, x)).float() if mtp is not None else None
    return logits, mtp_logits


@torch.no_grad()
def evaluate(model, mtp, heldout: np.ndarray, seq_len: int, max_windows: int, batch: int, autocast: bool) -> dict:
    """Held-out perplexity over evenly spaced, non-overlapping windows of seq_len + 1 tokens."""
    n = (len(heldout) - 1) // seq_len
    if n == 0:
        raise ValueError(f"held-out split has {len(heldout)} tokens, fewer than one window of {seq_len + 1}")
    k = min(max_windows, n)
    starts = np.arange(k) * n // k * seq_len
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    sums = dict(nll=0.0, hits=0, count=0, mtp_nll=0.0, mtp_hits=0, mtp_agree=0, mtp_count=0)
    for i in range(0, k, batch):
        w = np.stack([heldout[s : s + seq_len + 1] for s in starts[i : i + batch]]).astype(np.int64)
        w = torch.from_numpy(w).to(device)
        x, y = w[:, :-1], w[:, 1:]
        logits, mtp_logits = forward(model, mtp, x, autocast)
        sums["nll"] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        pred = logits.argmax(-1)
        sums["hits"] += (pred == y).sum().item()
        sums["count"] += y.numel()
        if mtp_logits is not None:
            sums["mtp_nll"] += F.cross_entropy(mtp_logits.flatten(0, 1), y[:, 1:].flatten(), reduction="sum").item()
            mtp_pred = mtp_logits.argmax(-1)
            sums["mtp_hits"] += (mtp_pred == y[:, 1:]).sum().item()
            # what greedy speculation accepts, roughly: the MTP's guess for t+2 equals the trunk's own
            sums["mtp_agree"] += (mtp_pred == pred[:, 1:]).sum().item()
            sums["mtp_count"] += y[:, 1:].numel()
    model.train(was_training)
    res = {
        "heldout_ppl": math.exp(sums["nll"] / sums["count"]),
        "heldout_top1": sums["hits"] / sums["count"],
        "heldout_tokens": sums["count"],
        "heldout_windows": k,
    }
    if sums["mtp_count"]:
        res.update(
            mtp_heldout_ppl=math.exp(sums["mtp_nll"] / sums["mtp_count"]),
            mtp_top1=sums["mtp_hits"] / sums["mtp_count"],
            mtp_agrees_with_trunk=sums["mtp_agree"] / sums["mtp_count"],
        )
    return res
