"""A second head proposer (runners/torch/head_proposer.py) needs no change to runner.py or cuda_graphs.py.

`LastTokenHead`, defined here only, proposes k copies of the token the target drew last: it learns
that token from each step through the interface (`after_step`: the step's tokens and, in a
verification step, its accepted counts; after a step replayed as a graph, from its own graph beside
it: the greedy token of each of the graph's rows), keeps it on the device, proposes placeholders
before scheduling and the real tokens after (`fill`). Registered in `HEADS` in place of mtp's, it is
built and served by the torch runner on the CPU; the engine verifies its drafts: greedy output is the
output without speculation, and every proposal is the request's last token.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_spec_draft import _one_thread  # noqa: F401 - autouse: one torch thread for this module
from test_spec_mtp import eager_graphs, make_engine, record_proposals
from test_speculative import run

from llmserve.engine.sampling_params import SamplingParams
from llmserve.runners.torch import head_proposer
from llmserve.runners.torch.head_proposer import HeadProposer, TargetStep


class LastTokenHead(HeadProposer):
    def __init__(self, runner, model_dir, config) -> None:
        super().__init__(runner, model_dir, config)
        self.last: dict[str, tuple[torch.Tensor, int]] = {}  # req_id -> (a step's tokens, its row there)
        self.graph_steps = 0  # steps whose last tokens came from the head's graph
        self.dropped: list[str] = []

    def after_step(self, step: TargetStep) -> None:
        sampled = [c for c in step.chunks if c.sample]
        n_rows = np.array([c.num_sampled_rows for c in sampled], dtype=np.int64)
        first = torch.from_numpy(np.cumsum(n_rows) - n_rows)
        last = first if step.num_new is None else first + step.num_new.long() - 1  # last accepted row
        tokens = step.tokens
        g, key = step.graphs, step.graph_key
        if g is not None and key in g.head_graphs:  # the graph's greedy tokens, at its sampled rows
            g.replay_head(key)
            rows = torch.from_numpy(step.layout[step.arrays["sample_tok"]])
            tokens = g.head_out[key][rows]
            self.graph_steps += 1
        for i, c in enumerate(sampled):
            self.last[c.request.req_id] = (tokens, int(last[i]))

    def graph_buffers(self, max_tokens: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(max_tokens, dtype=torch.long, device=device)

    def graph_forward(self, graphs, key: tuple[int, int]) -> torch.Tensor:
        q, bs = key
        out = graphs.head_static[: bs * q]
        out.copy_(graphs.logits[key].argmax(-1))
        return out

    def propose(self, reqs, k: int) -> None:
        for req in reqs:
            req.draft_token_ids = [0] * k if req.req_id in self.last else []

    def fill(self, chunks) -> None:
        for c in chunks:
            if c.draft_token_ids:
                tokens, row = self.last[c.request.req_id]
                c.draft_token_ids[:] = [int(tokens[row])] * len(c.draft_token_ids)
                c.request.draft_token_ids = c.draft_token_ids

    def drop(self, req_ids) -> None:
        self.dropped += req_ids
        for rid in req_ids:
            self.last.pop(rid, None)


def workload(seed: int, n: int = 6) -> list:
    rng = np.random.default_rng(seed)
    p = SamplingParams(max_tokens=int(rng.integers(12, 30)), temperature=0.0, ignore_eos=True)
    return [(f"r{i}", rng.integers(0, 512, int(rng.integers(1, 30))).tolist(), p) for i in range(n)]


@pytest.mark.parametrize("graphs", [False, True])
def test_a_head_proposer_of_its_own_module_is_served_and_verified(tiny_hf_dir, monkeypatch, fresh_seed, graphs):
    """With `graphs`, the runner's DecodeGraphs run eagerly on the CPU (test_spec_mtp.eager_graphs), and
    the head's graph beside each step graph gives its tokens."""
    reqs = workload(fresh_seed)
    plain = run(make_engine(str(tiny_hf_dir), tokenizer=False), reqs)
    monkeypatch.setitem(head_proposer.HEADS, "mtp", LastTokenHead)
    engine = make_engine(str(tiny_hf_dir), 3, tokenizer=False, speculate_adaptive=True)
    head = engine.runner.head
    assert isinstance(head, LastTokenHead) and engine.proposer is head
    assert engine.runner.kv_cache.data.shape[0] == engine.runner.model_config.num_hidden_layers  # kv_layers = 0
    ks = iter(random.Random(fresh_seed).choices([0, 1, 3], k=5000))  # plain and verification steps
    engine.draft_length.choose = lambda batch, acceptance: next(ks)
    if graphs:
        engine.runner.graphs = eager_graphs(engine.runner, True)
    proposals = record_proposals(engine)
    assert run(engine, reqs) == plain
    assert len(proposals) > 10
    for tokens, drafts in proposals.items():  # the request's tokens up to its last one -> its drafts
        assert drafts == [tokens[-1]] * len(drafts)
    st = engine.stats()
    assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens <= st.spec_draft_tokens
    if graphs:
        assert head.graph_steps > 0 and engine.runner.graphs.head_out
    engine.step()  # the engine hands the requests that left to the proposer with its next step
    assert not head.last and {r for r, _, _ in reqs} <= set(head.dropped)
