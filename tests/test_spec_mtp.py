"""Speculative decoding with an MTP module (SPECULATE_METHOD=mtp, torch runner).

- The proposals are the module's: for a random tiny Llama with a random MTP module, every proposal
  the engine makes (its first from the K/V and outputs that earlier steps' extends left, the rest
  from the chain) is the argmax of an independent reference, train/mtp.py's MTPLayer (HF's
  LlamaDecoderLayer) run over the whole sequence from scratch, the chain fed its own outputs.
- Through the engine on the trained demo model and its MTP module: greedy output with k = 1, 3, 5 is
  the output without speculation for 16 requests of Python source arriving at staggered steps,
  sharing prefixes (prefix-cache hits), ending on stop strings and on max_tokens; with preemption;
  with an abort while a verification step runs; every block free at the end; proposals accepted.
- Start errors name the setting: a checkpoint without an MTP module, the Paddle runner.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import numpy as np
import pytest
import torch
from test_spec_draft import _one_thread  # noqa: F401 - autouse: one torch thread for this module
from test_speculative import check_abort_while_verifying, check_stack_serves_speculating, run, with_stop_strings

from llmserve.config import Config, ConfigError
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.sampling_params import SamplingParams
from llmserve.engine.tokenizer import load_tokenizer
from llmserve.models.demo import DEMO_HF_DIR
from llmserve.runners.torch.runner import TorchRunner


def add_random_mtp(src, dst, seed: int) -> str:
    """A copy of the HF checkpoint `src` with a random MTP module (DeepSeek-V3's names and config)."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from llmserve.train.mtp import checkpoint_tensors, mtp_layer

    shutil.copytree(src, dst)
    trunk = LlamaForCausalLM.from_pretrained(dst, attn_implementation="sdpa")
    torch.manual_seed(seed)
    mtp = mtp_layer(trunk.config)
    with torch.no_grad():  # norms away from 1, so that a swapped norm would show
        for p in mtp.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    tensors = {k: v.detach().contiguous().clone() for k, v in checkpoint_tensors(mtp, trunk).items()}
    save_file(tensors, dst / "mtp.safetensors")
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg | {"num_nextn_predict_layers": 1}))
    return str(dst)


def make_engine(model_dir: str, k: int = 0, tokenizer: bool = True, **overrides) -> LLMEngine:
    kw = dict(block_size=4, max_seq_len=512, batch_size=8, block_bs=16, max_num_batched_tokens=64, device="cpu")
    kw |= dict(long_prefill_tokens=24)
    if k:
        kw |= dict(speculate_method="mtp", speculate_max_draft_tokens=k, speculate_adaptive=False)
    kw.update(overrides)
    cfg = Config.from_env(env={}, **kw)
    engine = LLMEngine(cfg, TorchRunner(model_dir, cfg), load_tokenizer(model_dir) if tokenizer else None)
    assert (engine.proposer is not None) == bool(k)
    return engine


def record_proposals(engine: LLMEngine) -> dict:
    """Every proposal the engine's MTP proposer makes from now on: the request's tokens so far (a
    tuple) -> its drafts."""
    got: dict = {}
    fill = engine.proposer.fill

    def spy(chunks):
        fill(chunks)
        for c in chunks:
            if c.draft_token_ids:
                got[tuple(c.request.token_ids_slice(0, c.start + 1))] = list(c.draft_token_ids)

    engine.proposer.fill = spy
    return got


# ---------------------------------------------------------------- the module against a reference


def reference_drafts(trunk, mtp, tokens: list[int], ours: list[int]) -> list[tuple[int, float, float]]:
    """For each of our drafts: (the reference's argmax, its logit, the reference logit of ours); the
    chain is fed our drafts (so a near-tie does not derail the comparison)."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        h = trunk.model(ids).last_hidden_state[0]
        fed_h, fed_ids, out = h[:-1], list(tokens), []
        for d in ours:
            last = torch.cat([fed_h, fed_h.new_zeros(1, fed_h.shape[1])])[None]
            y = mtp.hidden(trunk, last, torch.tensor([fed_ids]))[0, -1]
            logits = trunk.lm_head(y)
            out.append((int(logits.argmax()), float(logits.max()), float(logits[d])))
            fed_h, fed_ids = torch.cat([fed_h, y[None]]), fed_ids + [d]
    return out


def test_mtp_proposals_are_the_modules_argmax(tiny_hf_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from llmserve.train.mtp import load_mtp

    seed = random.randrange(1 << 30)
    model = add_random_mtp(tiny_hf_dir, tmp_path / "m", seed)
    # No prefix cache: a shared block's last MTP entry belongs to the request that wrote it (mtp.py).
    engine = make_engine(model, 3, tokenizer=False, enable_prefix_caching=False, max_seq_len=256)
    proposals = record_proposals(engine)
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(6):
        ids = rng.integers(0, 512, int(rng.integers(1, 40))).tolist()
        reqs.append(
            (f"r{i}", ids, SamplingParams(max_tokens=int(rng.integers(8, 30)), temperature=0.0, ignore_eos=True))
        )
    run(engine, reqs)
    captured = list(proposals.items())
    assert len(captured) > 10
    trunk = LlamaForCausalLM.from_pretrained(model, attn_implementation="sdpa").eval()
    tensors = load_file(f"{model}/mtp.safetensors")
    mtp = load_mtp(trunk.config, tensors).eval()
    checked = 0
    for tokens, drafts in captured[:: max(1, len(captured) // 24)]:
        for j, (best, top, mine) in enumerate(reference_drafts(trunk, mtp, tokens, drafts)):
            assert mine >= top - 1e-3, f"seed {seed}: draft {j} of {tokens}: ours {drafts[j]}, reference {best}"
            checked += 1
    assert checked >= 24


# ---------------------------------------------------------------- the engine on the trained demo


def demo_workload(seed: int, n: int = 16) -> list:
    """n greedy requests: pieces of Python source (some sharing a prefix), 1 to ~60 tokens."""
    import textwrap

    tok = load_tokenizer(str(DEMO_HF_DIR))
    source = tok.encode(open(textwrap.__file__).read() + open(json.__file__).read())
    rng = np.random.default_rng(seed)
    shared = source[:16]
    reqs = []
    for i in range(n):
        a = int(rng.integers(0, len(source) - 64))
        ids = source[a : a + int(rng.integers(1, 60))]
        if i % 4 == 0:
            ids = shared + ids
        p = SamplingParams(max_tokens=int(rng.integers(1, 40)), temperature=0.0, ignore_eos=i % 3 == 0)
        reqs.append((f"r{i}", ids, p))
    return reqs


def test_greedy_output_with_mtp_is_the_output_without_it():
    seed = random.randrange(1 << 30)
    model = str(DEMO_HF_DIR)
    reqs = demo_workload(seed)
    plain = run(make_engine(model), reqs)
    reqs = with_stop_strings(reqs, plain)
    plain_engine = make_engine(model)
    plain = run(plain_engine, reqs)
    assert any(r == "stop" for _, _, r in plain.values())
    for k in (1, 3, 5):
        engine = make_engine(model, k)
        got = run(engine, reqs)
        assert got == plain, f"seed {seed} k={k}"
        st = engine.stats()
        assert st.spec_draft_tokens > 0 and 0 < st.spec_accepted_tokens <= st.spec_draft_tokens, f"seed {seed}"
        assert st.prefix_cache_hits > 0
        assert st.steps < plain_engine.stats().steps, f"seed {seed} k={k}"
        engine.step()  # the engine hands the requests that left to the proposer with its next step
        assert not engine.proposer.head.rows, "MTP state left behind"


class ScriptedRule:
    """A draft-length rule that plays k from a list (then 0), and says truly what comes next."""

    def __init__(self, ks: list[int]) -> None:
        self.ks, self.i = ks, 0

    def choose(self, batch: int, acceptance: float) -> int:
        self.i += 1
        return self.ks[self.i - 1] if self.i <= len(self.ks) else 0

    def may_speculate_next(self, batch: int) -> bool:
        return self.i < len(self.ks) and self.ks[self.i] > 0

    def observe(self, *args) -> None:
        pass

    def rate(self, batch: int, k: int) -> None:
        return None  # nothing measured


def test_plain_steps_before_plain_steps_skip_the_module():
    """A step whose successor will not speculate does not run the MTP module and forgets its
    requests' kept outputs: the next speculating step proposes nothing for them, the one after does
    again. The output is still the plain output."""
    seed = random.randrange(1 << 30)
    reqs = demo_workload(seed, 8)
    plain = run(make_engine(str(DEMO_HF_DIR)), reqs)
    engine = make_engine(str(DEMO_HF_DIR), 3)
    engine.draft_length = ScriptedRule(([0] * 5 + [3] * 4 + [0] * 3 + [3] + [0] * 2) * 20)
    steps, ran = [], []
    assert engine.proposer is engine.runner.head  # the runner's head proposer serves the engine
    submit, extend = engine.runner.submit, engine.proposer.head.extend

    def spy_extend(*a, **kw):
        ran.append(1)
        return extend(*a, **kw)

    def spy_submit(batch):
        before = len(ran)
        handle = submit(batch)
        decoding = [c for c in batch.chunks if c.sample and c.num_sampled_rows == c.num_tokens]
        drafts = [bool(c.draft_token_ids) for c in decoding]
        steps.append((batch.proposer_state, len(ran) > before, drafts))
        return handle

    engine.proposer.head.extend, engine.runner.submit = spy_extend, spy_submit
    assert run(engine, reqs) == plain, f"seed {seed}"
    assert all(keep == extended for keep, extended, _ in steps)
    assert 0 < sum(keep for keep, _, _ in steps) < len(steps), steps
    for (keep, _, _), (_, _, drafts) in zip(steps, steps[1:]):
        if not keep:  # the module did not run: nothing to propose from, in the next step
            assert not any(drafts)
    assert any(any(d) for _, _, d in steps) and engine.stats().spec_accepted_tokens > 0, f"seed {seed}"


def test_preemption_with_mtp():
    seed = random.randrange(1 << 30)
    reqs = [
        (rid, ids, dataclasses.replace(p, max_tokens=40, ignore_eos=True)) for rid, ids, p in demo_workload(seed)[:8]
    ]
    small = dict(block_bs=1, max_seq_len=128)
    plain = run(make_engine(str(DEMO_HF_DIR), **small), reqs, arrive_every=1)
    engine = make_engine(str(DEMO_HF_DIR), 3, **small)
    assert run(engine, reqs, arrive_every=1) == plain, f"seed {seed}"
    assert engine.stats().preemptions > 0 and engine.stats().spec_accepted_tokens > 0, f"seed {seed}"


def test_abort_during_an_mtp_verification_step_frees_every_block():
    engine = make_engine(str(DEMO_HF_DIR), 4)
    for i, (_, ids, _) in enumerate(demo_workload(random.randrange(1 << 30), 6)):
        engine.add_request(f"a{i}", ids, SamplingParams(max_tokens=50, min_tokens=50, temperature=0))
    check_abort_while_verifying(engine, [f"a{i}" for i in range(6)], 50)


def eager_graphs(runner: TorchRunner, head_graphs: bool):
    """The runner's DecodeGraphs run eagerly on the CPU: a "replay" loads the static buffers and runs
    what the graph would (cuda_graphs.DecodeGraphs.load), so decode and verification steps take the
    graph paths, padded layouts included; with `head_graphs`, the head proposer's graphs too."""
    from llmserve.runners.torch.cuda_graphs import DecodeGraphs

    class EagerGraphs(DecodeGraphs):
        replays: list[int] = []

        def replay(self, a, fill_ids=None, q: int = 1):
            self.replays.append(q)
            bs = self.load(a, fill_ids, q)
            self.hidden[q, bs], self.logits[q, bs] = self._run(bs, q)
            self.last_hidden, self.last_key = self.hidden[q, bs], (q, bs)
            return self.logits[q, bs]

        def replay_head(self, key):
            self.head_out[key] = self.head.graph_forward(self, key)

    k = runner.config.speculate_max_draft_tokens
    head = runner.head if head_graphs else None
    g = EagerGraphs(runner.model, runner.kv_cache, runner.max_batch, runner.max_blocks_per_seq, 1, k, head)
    if head_graphs:  # "captured": static outputs of the main graphs, the head's graphs marked present
        for q, buckets in g.buckets.items():
            for bs in buckets:
                g.hidden[q, bs] = torch.zeros(bs * q, runner.model.cfg.hidden_size, dtype=runner.model.dtype)
                g.head_graphs[q, bs] = None
    return g


@pytest.mark.parametrize("mtp_graphs", [False, True])
def test_mtp_reads_graph_steps_in_their_padded_layout(mtp_graphs):
    """Steps replayed as graphs hand the module their padded layout (static inputs, the graph's hidden
    output, pad rows that write nothing): on the CPU, with the graphs run eagerly, the proposals and
    the output are those of eager steps, plain and verification steps alternating. With `mtp_graphs`
    the module runs as its own graphs would, over their static buffers."""
    seed = random.randrange(1 << 30)
    reqs = demo_workload(seed, 8)
    runs = {}
    for graphs in (False, True):
        engine = make_engine(str(DEMO_HF_DIR), 3, batch_size=8, speculate_adaptive=True)
        ks = iter(random.Random(seed).choices([0, 0, 1, 3], k=5000))  # plain and verification steps
        engine.draft_length.choose = lambda batch, acceptance, ks=ks: next(ks)
        if graphs:
            engine.runner.graphs = eager_graphs(engine.runner, mtp_graphs)
        seen = runs[graphs] = record_proposals(engine)
        seen["out"] = run(engine, reqs)
        assert engine.stats().spec_accepted_tokens > 0
        if graphs:  # decode and verification steps took the graph paths
            assert 1 in engine.runner.graphs.replays and max(engine.runner.graphs.replays) > 1
            assert bool(engine.runner.graphs.head_out) == mtp_graphs  # the module ran as its graphs
    assert runs[True].pop("out") == runs[False].pop("out"), f"seed {seed}"
    both = [key for key in runs[True] if key in runs[False]]
    same = sum(runs[True][key] == runs[False][key] for key in both)
    # Steps with proposals in both runs: 21-73 over 8 seeds (one CI seed had 20), so at least 10.
    assert len(both) >= 10 and same >= 0.98 * len(both), f"seed {seed}: {same} of {len(both)}"


# ---------------------------------------------------------------- start errors


def test_a_checkpoint_without_an_mtp_module_is_refused(tiny_hf_dir, tmp_path):
    with pytest.raises(ConfigError, match="SPECULATE_METHOD=mtp: MODEL_DIR=.*has no MTP module"):
        make_engine(str(tiny_hf_dir), 3, tokenizer=False)
    with pytest.raises(ConfigError, match="SPECULATE_METHOD=mtp: SPECULATE_MODEL_PATH=.*has no MTP module"):
        make_engine(str(tiny_hf_dir), 3, tokenizer=False, speculate_model_path=str(tiny_hf_dir))
    with pytest.raises(ConfigError, match="SPECULATE_MODEL_PATH=.*not an HF safetensors checkpoint"):
        make_engine(str(tiny_hf_dir), 3, tokenizer=False, speculate_model_path=str(tmp_path))


def test_mtp_weights_from_speculate_model_path(tiny_hf_dir, tmp_path):
    """The module may sit in its own directory (download_model.py --speculate_model_path)."""
    seed = random.randrange(1 << 30)
    full = add_random_mtp(tiny_hf_dir, tmp_path / "full", seed)
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(f"{full}/mtp.safetensors", alone / "model.safetensors")
    reqs = [("r", list(range(3, 30)), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))]
    a = make_engine(full, 3, tokenizer=False)
    b = make_engine(str(tiny_hf_dir), 3, tokenizer=False, speculate_model_path=str(alone))
    assert run(a, reqs) == run(b, reqs)
    assert a.stats().spec_draft_tokens == b.stats().spec_draft_tokens > 0


def test_the_paddle_runner_refuses_mtp(tiny_hf_dir, tmp_path):
    pytest.importorskip("paddle")
    from llmserve.engine.sampler import Sampler
    from llmserve.runners.paddle.export import export_hf
    from llmserve.runners.paddle.runner import PaddleRunner

    cfg = Config.from_env(env={}, block_size=4, max_seq_len=256, batch_size=8, block_bs=2)
    runner = PaddleRunner(str(export_hf(tiny_hf_dir, tmp_path / "paddle")), cfg, Sampler(0))
    cfg = dataclasses.replace(cfg, speculate_method="mtp")
    with pytest.raises(ConfigError, match="SPECULATE_METHOD=mtp runs on the torch runner only.*PaddleRunner"):
        LLMEngine(cfg, runner)


def test_mtp_on_cuda_graph_steps_proposes_as_on_eager_ones(tiny_hf_dir, tmp_path):
    """On the GPU decode and verification steps replay graphs, and the module reads their hidden
    states from the graphs' outputs: its proposals after the same tokens are those of eager steps
    (bf16: a near-tie may flip one now and then)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    seed = random.randrange(1 << 30)
    model = add_random_mtp(tiny_hf_dir, tmp_path / "m", seed)
    rng = np.random.default_rng(seed)
    p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    reqs = [(f"r{i}", rng.integers(0, 512, 5 + 7 * i).tolist(), p) for i in range(6)]
    proposals = {}
    for graphs in (True, False):
        engine = make_engine(model, 3, tokenizer=False, device="cuda", cuda_graphs=graphs, enable_prefix_caching=False)
        assert (engine.runner.graphs is not None) == graphs
        proposals[graphs] = record_proposals(engine)
        run(engine, reqs)
        assert engine.stats().spec_draft_tokens > 0
    both = [key for key in proposals[True] if key in proposals[False]]
    same = sum(proposals[True][key] == proposals[False][key] for key in both)
    assert len(both) > 20 and same >= 0.9 * len(both), f"seed {seed}: {same} of {len(both)}"


def test_the_whole_stack_serves_with_mtp_speculation(tmp_path):
    """SPECULATE_METHOD=mtp on the trained demo checkpoint and its MTP module (torch runner)."""
    env = dict(MODEL_DIR=str(DEMO_HF_DIR), LLMSERVE_DEVICE="cpu", SPECULATE_METHOD="mtp")
    check_stack_serves_speculating(tmp_path, str(DEMO_HF_DIR), **env, SPECULATE_MAX_DRAFT_TOKEN_NUM=3)
