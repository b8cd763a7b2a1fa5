"""Draft-model proposals (SPECULATE_METHOD=draft) on the torch runner.

A smaller model with the target's tokenizer (SPECULATE_MODEL_PATH) proposes k tokens per decoding
request per step. It runs in a second TorchRunner whose KV cache has a fixed size (a BLOCK_BS derived
from the target's cache and BATCH_SIZE, so it never profiles free memory), with its own block
bookkeeping: per request a shadow `Request` that shares the real one's prompt and output lists (the
tokens) but has its own block table and computed count, in a BlockManager without prefix caching.

Each `propose(reqs, k)`:
1. one batched catch-up step feeds each request's tokens the draft has not computed yet, up to its
   last one (the first time, its whole prompt and output; split into pieces of MAX_PREFILL_TOKENS),
   and samples the first proposal from the logits at that last token;
2. k - 1 batched single-token steps feed the draft its own proposals, giving k per request.
The proposals fed in step 2 are in the draft's cache; next time, the shadow's computed count moves
back to those the request really took (its tokens compared with what was fed), so the KV of
rejected proposals is simply recomputed. A request longer than the draft's max_model_len allows gets
fewer proposals (none at all past it).

Proposals are drawn with the request's own sampling parameters (`DeviceSampler.propose`: bias,
penalties, min_tokens, temperature, top-k, top-p; greedy: argmax). For a sampled request the draft's
distributions q (one row per proposal) go with the proposals (`Request.draft_probs`), and the target
verifies them by rejection sampling against q (sampler.py), so the output keeps the target's
distribution whatever the draft proposes.

The chain's steps take their input tokens from the device (the last step's proposals): one copy to
the host at the end, unless a request has penalties (they count the proposals before each row, so
those are read back step by step).

Limits: on the GPU the target's KV cache is sized from the memory free when it loads, before the
draft: leave room for the draft (BLOCK_BS, or a lower KV_CACHE_MEMORY_FRACTION).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from llmserve.config import Config, ConfigError
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.request import Request
from llmserve.engine.runner_contract import ModelRunner, SeqChunk, StepBatch
from llmserve.engine.speculative import Proposer
from llmserve.layers.model_config import ModelConfig
from llmserve.runners.torch.inputs import FedChunk

log = logging.getLogger(__name__)


@dataclass
class _Shadow:
    real: Request
    req: Request  # the draft's view: real's token lists, the draft's blocks and computed count
    fed_at: int = 0  # position of the first proposal fed to the draft last time
    fed: list[int] = field(default_factory=list)  # the proposals fed (their KV is in the draft's cache)
    pen_counted: int = 0  # output tokens counted in the draft sampler's penalty state
    last_used: int = 0  # propose() call that last used it (least recently used ones are evicted first)


@dataclass
class _Plan:
    sh: _Shadow
    length: int  # the request's tokens (prompt + output)
    k: int  # proposals for it this step
    props: list[int] = field(default_factory=list)


def draft_config(config: Config, target_blocks: int) -> Config:
    """The draft runner's settings: the target's, with the draft model, no speculation of its own and
    a fixed KV cache: room for the target's tokens plus every sequence's proposals, at most
    BATCH_SIZE whole sequences."""
    k, bs = config.speculate_max_draft_tokens, config.block_size
    want = target_blocks + config.batch_size * (1 + -(-k // bs))
    block_bs = max(1, min(config.batch_size, -(-want // config.max_blocks_per_seq)))
    return dataclasses.replace(
        config,
        model_dir=config.speculate_model_path,
        model_config_path="",
        runner="torch",
        block_bs=block_bs,
        speculate_method="none",
        speculate_model_path="",
    )


def check_draft_dir(path: str, target_vocab: int) -> ModelConfig:
    """The draft's model config; ConfigError naming SPECULATE_MODEL_PATH when it cannot serve as one."""
    d = Path(path)
    if not d.is_dir():
        raise ConfigError(f"SPECULATE_MODEL_PATH={path!r}: not a directory (the draft model's HF checkpoint)")
    if not (d / "config.json").is_file() or not any(d.glob("*.safetensors")):
        raise ConfigError(
            f"SPECULATE_MODEL_PATH={path!r}: not an HF safetensors checkpoint (config.json and *.safetensors)"
        )
    mc = ModelConfig.from_file(str(d / "config.json"))
    if mc.vocab_size != target_vocab:
        raise ConfigError(
            f"SPECULATE_MODEL_PATH={path!r}: the draft model's vocab_size is {mc.vocab_size}, the target's "
            f"{target_vocab}; a draft model must share the target's tokenizer"
        )
    return mc


class DraftModelProposer(Proposer):
    def __init__(self, config: Config, target: ModelRunner) -> None:  # target: a TorchRunner
        path = config.speculate_model_path
        check_draft_dir(path, target.vocab_size)
        # The draft runs in a runner of the target's own class (built by it: TorchRunner.build_proposer).
        self.runner = type(target)(path, draft_config(config, target.num_kv_blocks))
        if self.runner.device != target.device:  # pragma: no cover - both follow LLMSERVE_DEVICE
            raise ConfigError(f"SPECULATE_MODEL_PATH={path!r}: the draft runs on {self.runner.device}")
        self.block_manager = BlockManager(self.runner.num_kv_blocks, self.runner.block_size, False)
        self.budget = config.max_num_batched_tokens  # tokens of one catch-up forward
        self._shadows: dict[str, _Shadow] = {}
        self._calls = 0
        log.info("draft model %s: %d KV blocks of %d tokens", path, self.runner.num_kv_blocks, self.runner.block_size)

    # ---- shadows and blocks ------------------------------------------------------
    def _shadow(self, req: Request) -> _Shadow:
        sh = self._shadows.get(req.req_id)
        if sh is not None and sh.real is not req:  # the id of a request gone, reused
            self.drop([req.req_id])
            sh = None
        if sh is None:
            shadow = Request(req.req_id, req.prompt_token_ids, req.params, req.eos_token_ids)
            shadow.output_token_ids = req.output_token_ids  # the same list: it grows with the real one
            sh = self._shadows[req.req_id] = _Shadow(req, shadow)
        sh.last_used = self._calls
        return sh

    def _rewind(self, sh: _Shadow, length: int) -> None:
        """Keep in the draft's cache only tokens the request has (proposals it took), and never its
        last one (its logits are needed)."""
        valid = sh.req.num_computed_tokens
        if sh.fed:
            real = sh.real.token_ids_slice(sh.fed_at, min(sh.fed_at + len(sh.fed), length))
            m = 0
            while m < len(real) and real[m] == sh.fed[m]:
                m += 1
            valid = min(valid, sh.fed_at + m)
            sh.fed = []
        keep = min(valid, length - 1)
        if keep < sh.req.num_computed_tokens:
            sh.req.num_computed_tokens = keep
            self.block_manager.trim(sh.req)

    def _reserve(self, sh: _Shadow, num_tokens: int) -> bool:
        """Blocks for `num_tokens` more tokens, evicting the least recently used shadows of requests not
        proposed for in this call; False when even that leaves too few."""
        bm = self.block_manager
        while not bm.ensure_slots(sh.req, num_tokens):
            idle = [s for s in self._shadows.values() if s.last_used < self._calls and s.req.block_table]
            if not idle:
                return False
            victim = min(idle, key=lambda s: s.last_used)
            bm.free(victim.req)
            victim.fed = []
        return True

    @torch.inference_mode()  # the draft sampler's state tensors were made in it
    def drop(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            sh = self._shadows.pop(rid, None)
            if sh is not None:
                self.block_manager.free(sh.req)
        self.runner.sampler.drop(req_ids)

    # ---- proposing -----------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: list[Request], k: int) -> None:
        self._calls += 1
        max_len = self.runner.max_model_len
        plans: list[_Plan] = []
        for req in reqs:
            req.draft_token_ids, req.draft_probs = [], None
            sh = self._shadow(req)
            length = req.num_known_tokens
            kr = min(k, max_len - length + 1)  # positions fed: up to length + kr - 2 < max_len
            if kr < 1:
                continue
            self._rewind(sh, length)
            if self._reserve(sh, length + kr - 1 - sh.req.num_computed_tokens):
                plans.append(_Plan(sh, length, kr))
        if not plans:
            return
        self._sync_penalties(plans)
        sampler = self.runner.sampler
        logits = self._catch_up(plans)
        first = [len(p.sh.real.output_token_ids) for p in plans]  # output index of the first proposal
        steps: list[tuple[list[int], torch.Tensor | None]] = []  # (plans drafted, their q rows) per step
        drawn: list[torch.Tensor] = []  # each step's proposals, on the device
        # Penalties count the proposals before a row: only then are they read back step by step.
        host_each_step = any(p.sh.real.params.penalised for p in plans)
        active = list(range(len(plans)))
        for s in range(k):
            if s:  # feed each active request its last proposal, from the device
                prev, active = active, [i for i in active if plans[i].k > s]
                if not active:
                    break
                feed = drawn[-1]
                if len(active) < len(prev):
                    where = {i: j for j, i in enumerate(prev)}
                    (idx,) = self.runner.uploader.upload([np.fromiter((where[i] for i in active), np.int64)])
                    feed = feed[idx.long()]
                chunks = [FedChunk(plans[i].sh.req, plans[i].length + s - 1, 1, True, ids=[0]) for i in active]
                logits = self.runner.forward_logits(StepBatch(chunks), ids=feed)
                for i in active:
                    plans[i].sh.req.num_computed_tokens += 1
            shadows = [plans[i].sh.req for i in active]
            prior = [plans[i].props for i in active] if host_each_step else None
            tokens, q = sampler.propose(logits, shadows, [first[i] + s for i in active], prior)
            drawn.append(tokens)
            if host_each_step:
                for i, t in zip(active, tokens.tolist()):
                    plans[i].props.append(t)
            steps.append((active, q))
        if not host_each_step:  # one copy to the host for all steps
            flat = torch.cat(drawn).tolist()
            for active, _ in steps:
                for i, t in zip(active, flat[: len(active)]):
                    plans[i].props.append(t)
                flat = flat[len(active) :]
        self._hand_over(plans, steps)

    def _catch_up(self, plans: list[_Plan]) -> torch.Tensor:
        """Feed each request its tokens the draft has not computed; logits [len(plans), V] at their last."""
        pieces: list[SeqChunk] = []
        for p in plans:
            start, end = p.sh.req.num_computed_tokens, p.length
            while start < end:
                n = min(self.budget, end - start)
                pieces.append(SeqChunk(p.sh.req, start, n, sample=start + n == end))
                start += n
            p.sh.req.num_computed_tokens = end
        # Forwards of at most `budget` tokens: a request's pieces never share one (each but its last
        # is a whole budget), and the sampled pieces come out in the plans' order.
        out, batch, used = [], [], 0
        for c in pieces:
            if batch and used + c.num_tokens > self.budget:
                out.append(self.runner.forward_logits(StepBatch(batch)))
                batch, used = [], 0
            batch.append(c)
            used += c.num_tokens
        out.append(self.runner.forward_logits(StepBatch(batch)))
        out = [x for x in out if x.shape[0]]
        return out[0] if len(out) == 1 else torch.cat(out)

    def _sync_penalties(self, plans: list[_Plan]) -> None:
        """Count in the draft sampler's penalty state the output tokens that came since last time (a
        request seen for the first time has its row filled from its whole output when it is used)."""
        state = self.runner.sampler.penalties
        for p in plans:
            prm, sh = p.sh.real.params, p.sh
            if not prm.penalised:
                continue
            out = sh.real.output_token_ids
            row = state.row.get(sh.req.req_id)
            if row is not None and sh.pen_counted < len(out):
                new = out[sh.pen_counted :]
                state.count(torch.full((len(new),), row, dtype=torch.int64), torch.tensor(new, dtype=torch.int64))
            sh.pen_counted = len(out)

    def _hand_over(self, plans: list[_Plan], steps: list[tuple[list[int], torch.Tensor | None]]) -> None:
        """Set each request's proposals, and the q rows of sampled requests; note what was fed."""
        stacked = None
        if steps[0][1] is not None and all(len(a) == len(plans) for a, _ in steps):
            stacked = torch.stack([q for _, q in steps], dim=1)  # [requests, k, V]
        where = [dict(zip(a, range(len(a)))) for a, _ in steps] if stacked is None else None
        for i, p in enumerate(plans):
            real = p.sh.real
            real.draft_token_ids = list(p.props)
            p.sh.fed_at, p.sh.fed = p.length, p.props[:-1]
            if real.params.greedy or steps[0][1] is None:
                continue
            if stacked is not None:
                real.draft_probs = stacked[i]
            else:
                real.draft_probs = torch.stack([q[where[s][i]] for s, (_, q) in enumerate(steps[: p.k])])
