"""Speculative decoding with a draft model (SPECULATE_METHOD=draft, torch runner).

- Through the engine: greedy output with a draft model (k = 1, 3, 5) is the output without
  speculation, for 16 requests arriving at staggered steps, sharing prefixes (prefix-cache hits),
  ending on max_tokens, and in a cache too small for all (preemption); every block, the target's and
  the draft's own, is free at the end. A draft that is the target itself has (nearly) every proposal
  accepted, greedy or sampled: its q is the target's p.
- The rejection sampler alone (`DeviceSampler.verify` with `Request.draft_probs`): for random p
  (random logits through bias, penalties, the min_tokens ban, temperature, top-k and top-p, as the
  target applies them) and random q (full support, and with zeros), drafts d ~ q: over 20,000
  independently seeded chunks the first emitted token follows p, the token after an accepted draft
  follows p at the next row (the draft counted by the penalties), and the acceptance rate is
  sum_x min(p(x), q(x)). Chunks without q in the same batch keep the one-hot path.
- Start errors name the setting: SPECULATE_MODEL_PATH missing, not a directory, another vocabulary;
  the Paddle runner.

Inputs are fresh each run; every assertion names the run's seed. scipy is not a dependency:
chi-square p-values use the Wilson-Hilferty approximation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import shutil

import numpy as np
import pytest
import torch

from llmserve.config import Config, ConfigError
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.request import Request
from llmserve.engine.runner_contract import SeqChunk
from llmserve.engine.sampling_params import SamplingParams
from llmserve.layers.sampler import DeviceSampler
from llmserve.runners.torch.runner import TorchRunner

ALPHA = 1e-4  # per test of a correct sampler: a false alarm in about one run in a few thousand
Z_MAX = 4.0  # two-sided normal tail ~6e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared machine their spinning costs
    tens of times the work: one thread for this module, restored after it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------- models


def _copy_checkpoint(src, dst, layers: int | None = None, vocab: int | None = None, positions: int = 0) -> str:
    """An HF checkpoint made from `src`'s: its first `layers` layers; another vocab_size or
    max_position_embeddings (config only)."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    index = json.loads((src / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        wm = {k: f for k, f in wm.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    if vocab is not None:
        cfg["vocab_size"] = vocab
    if positions:
        cfg["max_position_embeddings"] = positions
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    for f in set(wm.values()):
        shutil.copy(src / f, dst / f)
    return str(dst)


@pytest.fixture(scope="module")
def draft_dir(tiny_hf_dir, tmp_path_factory) -> str:
    """A smaller draft: the target's first layer, its embeddings and head (same vocabulary). Its
    max_position_embeddings (96, the target's 256) leaves longer requests fewer proposals, then none."""
    return _copy_checkpoint(tiny_hf_dir, tmp_path_factory.mktemp("draft") / "m", layers=1, positions=96)


def make_engine(target: str, draft: str | None = None, k: int = 3, **overrides) -> LLMEngine:
    kw = dict(block_size=4, max_seq_len=256, batch_size=8, block_bs=8, max_num_batched_tokens=48)
    kw |= dict(long_prefill_tokens=16)
    if draft is not None:
        kw |= dict(speculate_method="draft", speculate_model_path=draft, speculate_max_draft_tokens=k)
        kw |= dict(speculate_adaptive=False)
    kw.update(overrides)
    cfg = Config.from_env(env={}, **kw)
    engine = LLMEngine(cfg, TorchRunner(target, cfg))
    assert (engine.proposer is not None) == (draft is not None)
    return engine


def workload(seed: int, vocab: int, n: int = 16, temperature: float = 0.0) -> list:
    """n requests: lengths 1 to ~70 tokens, a shared prefix for every fourth (prefix-cache hits)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, 12).tolist()
    reqs = []
    for i in range(n):
        ids = rng.integers(0, vocab, int(rng.integers(1, 60))).tolist()
        if i % 4 == 0:
            ids = shared + ids
        p = SamplingParams(max_tokens=int(rng.integers(1, 40)), temperature=temperature, ignore_eos=i % 3 == 0)
        if temperature:
            p = dataclasses.replace(p, top_p=0.9, top_k=50, seed=seed + i, frequency_penalty=0.2)
        reqs.append((f"r{i}", ids, p))
    return reqs


def run(engine: LLMEngine, reqs, arrive_every: int = 2) -> dict[str, tuple[list[int], str]]:
    """tests/test_speculative.run (every target block free at the end), then the draft's blocks too;
    req_id -> (tokens, finish reason)."""
    from tests.test_speculative import run as run_engine

    got = run_engine(engine, reqs, arrive_every)
    if engine.proposer is not None:
        engine.step()  # the engine hands the requests that left to the proposer with its next step
        assert engine.proposer.block_manager.num_used == 0, "draft blocks left in use"
        assert not engine.proposer._shadows
    return {r: (tokens, reason) for r, (tokens, _text, reason) in got.items()}


NEAR_TIE = 1e-4  # fp64 logits this close: fp32 rounding in another step shape may pick either


def assert_same_greedy(got: dict, plain: dict, reqs, target: str, why: str) -> None:
    """Greedy outputs equal, but where a request's first difference is at a near-tie of the target:
    the Hugging Face fp64 logits after the plain tokens before it put both tokens within NEAR_TIE of
    the top (CI saw a margin of 8e-7 with the draft that is the target; a verification step's
    shape rounds differently from a decode step's). Nothing after such a tie is compared."""
    assert got.keys() == plain.keys(), why
    prompts = {rid: ids for rid, ids, _ in reqs}
    for rid in plain:
        if got[rid] == plain[rid]:
            continue
        a, b = plain[rid][0], got[rid][0]
        j = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
        assert j is not None, f"{why}: {rid} differs without a differing token: {plain[rid]} {got[rid]}"
        logits = _fp64_logits(target, tuple(prompts[rid] + a[:j]))
        gaps = [float(logits.max() - logits[t]) for t in (a[j], b[j])]
        assert max(gaps) < NEAR_TIE, f"{why}: {rid} parts at token {j} ({a[j]} vs {b[j]}), no near-tie: {gaps}"


@functools.lru_cache(maxsize=64)
def _fp64_logits(path: str, ids: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return _fp64_model(path)(torch.tensor([ids])).logits[0, -1]


@functools.lru_cache(maxsize=2)
def _fp64_model(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)


# ---------------------------------------------------------------- through the engine


def test_greedy_output_with_a_draft_model_is_the_output_without_it(tiny_hf_dir, draft_dir):
    seed = random.randrange(1 << 30)
    target = str(tiny_hf_dir)
    plain_engine = make_engine(target)
    reqs = workload(seed, plain_engine.runner.vocab_size)
    plain = run(plain_engine, reqs)
    for k in (1, 3, 5):
        engine = make_engine(target, draft_dir, k)
        assert_same_greedy(run(engine, reqs), plain, reqs, target, f"seed {seed} k={k}")
        st = engine.stats()
        assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens <= st.spec_draft_tokens, f"seed {seed}"
        assert st.prefix_cache_hits > 0
    for rid, _ids, p in reqs:  # lengths applied exactly
        tokens, reason = plain[rid]
        assert len(tokens) <= p.max_tokens and (reason != "length" or len(tokens) == p.max_tokens)
    # A cache too small for all: requests preempted, some between a proposal and its verification;
    # and the draft's own cache (40 blocks, about one request's) too small too: it evicts idle
    # requests' KV (recomputed when they come back) and skips a request it cannot fit.
    small = dict(block_bs=1, batch_size=8)
    # 60 tokens each: 8 requests need 2-4x the 64 blocks (at 40, one seed in ~20 preempted nothing).
    long_reqs = [(rid, ids, dataclasses.replace(p, max_tokens=60, ignore_eos=True)) for rid, ids, p in reqs[:8]]
    plain = run(make_engine(target, **small), long_reqs, arrive_every=1)
    engine = make_engine(target, draft_dir, 3, **small)
    engine.proposer.block_manager = BlockManager(40, engine.runner.block_size, enable_prefix_caching=False)
    assert_same_greedy(run(engine, long_reqs, arrive_every=1), plain, long_reqs, target, f"seed {seed}")
    assert engine.stats().preemptions > 0 and engine.stats().spec_draft_tokens > 0, f"seed {seed}"


def test_a_draft_that_is_the_target_is_accepted(tiny_hf_dir):
    """Same checkpoint: greedy proposals are the target's argmax, sampled ones come from q = p; all but
    a rounding accident are accepted, and the greedy output is still the output without speculation."""
    seed = random.randrange(1 << 30)
    target = str(tiny_hf_dir)
    reqs = workload(seed, 512, n=8)
    plain = run(make_engine(target), reqs)
    engine = make_engine(target, target, 4)
    assert_same_greedy(run(engine, reqs), plain, reqs, target, f"seed {seed}")
    st = engine.stats()
    assert st.spec_draft_tokens > 20 and st.spec_accepted_tokens >= 0.95 * st.spec_draft_tokens, f"seed {seed} {st}"
    sampled = workload(seed, 512, n=8, temperature=0.9)
    # One ends at the model's length (256, 16 tokens after its prompt; the engine refuses more than fit):
    # the draft proposes fewer than k there.
    near_end = SamplingParams(max_tokens=16, temperature=0.9, seed=seed, ignore_eos=True)
    sampled.insert(1, ("long", np.random.default_rng(seed).integers(0, 512, 240).tolist(), near_end))
    engine = make_engine(target, target, 4)
    got = run(engine, sampled)
    assert len(got["long"][0]) == 16 and got["long"][1] == "length", f"seed {seed}"
    st = engine.stats()
    assert st.spec_draft_tokens > 20 and st.spec_accepted_tokens >= 0.9 * st.spec_draft_tokens, f"seed {seed} {st}"


def test_sampled_requests_with_a_draft_model(tiny_hf_dir, draft_dir):
    """Sampled requests (seeded, top-k, top-p, penalties) verified against the draft's q, some past
    the draft's length (fewer proposals, then none), in a cache small enough to preempt: every
    request ends by its limits, with its drafts verified, and every block is free at the end."""
    seed = random.randrange(1 << 30)
    reqs = [(r, ids, dataclasses.replace(p, max_tokens=40)) for r, ids, p in workload(seed, 512, 10, 0.8)]
    engine = make_engine(str(tiny_hf_dir), draft_dir, 4, block_bs=1)
    got = run(engine, reqs, arrive_every=1)
    for rid, _ids, p in reqs:
        tokens, reason = got[rid]
        assert len(tokens) <= p.max_tokens and (reason != "length" or len(tokens) == p.max_tokens), f"seed {seed}"
    st = engine.stats()
    assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens > 0 and st.preemptions > 0, f"seed {seed} {st}"


# ---------------------------------------------------------------- the rejection sampler alone


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df >= x), Wilson-Hilferty: (X / df)^(1/3) is about normal, mean 1 - 2/(9 df), var 2/(9 df)."""
    if x <= 0:
        return 1.0
    v = 2.0 / (9.0 * df)
    z = ((x / df) ** (1.0 / 3.0) - (1.0 - v)) / math.sqrt(v)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def gof(counts: np.ndarray, expected: np.ndarray) -> tuple[float, str]:
    """Chi-square goodness of fit of counts to expected counts, the smallest cells merged until the
    merged one expects >= 5: (p-value, description). A count where nothing is expected: p-value 0."""
    counts, expected = np.asarray(counts, np.float64), np.asarray(expected, np.float64)
    impossible = (expected <= 1e-9) & (counts > 0)
    if impossible.any():
        return 0.0, f"tokens of probability 0 emitted: {np.flatnonzero(impossible).tolist()}"
    live = np.flatnonzero(expected > 1e-9)
    order = live[np.argsort(expected[live], kind="stable")]
    cut = int(np.searchsorted(np.cumsum(expected[order]), 5.0)) + 1 if expected[order[0]] < 5 else 0
    groups = ([order[:cut]] if cut else []) + [np.array([i]) for i in order[cut:]]
    obs = np.array([counts[g].sum() for g in groups])
    exp = np.array([expected[g].sum() for g in groups])
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(groups) - 1
    return (chi2_sf(stat, df) if df > 0 else 1.0), f"chi2 {stat:.1f} on {df} df"


def ref_probs(
    logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams, index: int, eos
) -> np.ndarray:
    """The target's distribution, dense numpy float64 (the definitions of engine/sampler.py)."""
    x = logits.astype(np.float64).copy()
    for t, b in p.logit_bias.items():
        x[t] += b
    seen = sorted(set(prompt) | set(output))
    x[seen] = np.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=len(x)).astype(np.float64)
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    if index < p.min_tokens:
        x[list(eos)] = -np.inf
    x /= p.temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(len(x), dtype=bool)
    top = order[: p.top_k] if p.top_k else order
    z = np.exp(x[top] - x[top].max())
    z /= z.sum()
    before = np.cumsum(z) - z
    keep[top[(before < p.top_p) | (np.arange(len(top)) == 0)]] = True
    x = np.where(keep, x, -np.inf)
    e = np.exp(x - x.max())
    return e / e.sum()


def check_rate(accepted: np.ndarray, rate: float, what: str) -> None:
    """Bernoulli draws against their probability: a z-test, or exactly none / all where it is 0 / 1
    (the z-score would be 0 / 0)."""
    n, k = accepted.size, int(accepted.sum())
    if rate <= 0.0 or rate >= 1.0:
        assert k == (0 if rate <= 0.0 else n), f"{what} {k / n:.4f}, expected {rate:.4f}"
        return
    z = (k - n * rate) / math.sqrt(n * rate * (1 - rate))
    assert abs(z) < Z_MAX, f"{what} {k / n:.4f}, expected {rate:.4f} (z = {z:.1f})"


@pytest.mark.parametrize("q_kind", ["full", "zeros"])
def test_rejection_sampling_keeps_the_target_distribution(q_kind):
    seed = random.randrange(1 << 30)
    rng = np.random.default_rng(seed)
    V, N, N_PLAIN = 40, 20_000, 4_000  # vocabulary; chunks verified against q; chunks without q
    logits = rng.normal(0, 1.5, V).astype(np.float32)
    eos = int(rng.integers(V))
    prompt = rng.integers(0, V, 10).tolist()
    output = rng.integers(0, V, 6).tolist()
    bias = {int(t): float(rng.normal(0, 2)) for t in rng.choice(V, 3, replace=False)}
    params = SamplingParams(
        max_tokens=50,
        min_tokens=len(output) + 1,  # the first row bans eos, the next does not
        temperature=float(rng.uniform(0.6, 1.4)),
        top_k=int(rng.integers(15, 35)),
        top_p=float(rng.uniform(0.8, 0.97)),
        repetition_penalty=float(rng.uniform(1.05, 1.5)),
        frequency_penalty=float(rng.uniform(0.1, 0.5)),
        presence_penalty=float(rng.uniform(0.1, 0.5)),
        logit_bias=bias,
    )
    idx = len(output)
    p0 = ref_probs(logits, prompt, output, params, idx, {eos})
    p1 = np.stack([ref_probs(logits, prompt, output + [d], params, idx + 1, {eos}) for d in range(V)])
    # A draft model's q: like p but off (other logits, another temperature), with some mass everywhere.
    near = np.exp(logits / params.temperature + rng.normal(0, 1.0, V))
    q = 0.7 * near / near.sum() + 0.3 * rng.dirichlet(np.full(V, 0.7))
    if q_kind == "zeros":  # no mass on some tokens, among them p's most likely one
        zero = rng.choice(V, V // 3, replace=False)
        q[np.append(zero, p0.argmax())] = 0.0
        q /= q.sum()
    drafts = rng.choice(V, N + N_PLAIN, p=q)

    sampler = DeviceSampler(V, torch.device("cpu"), seed)
    q_dev = torch.tensor(q, dtype=torch.float32)[None, :]
    chunks = []
    for i in range(N + N_PLAIN):
        prm = dataclasses.replace(params, seed=int(rng.integers(1 << 62)))
        req = Request(f"c{i}", prompt, prm, frozenset({eos}))
        req.output_token_ids = list(output)
        if i < N:
            req.draft_probs = q_dev
        chunks.append(SeqChunk(req, 0, 2, sample=True, draft_token_ids=[int(drafts[i])]))
    rows = torch.tensor(logits)[None, :].repeat(2 * len(chunks), 1)
    with torch.inference_mode():
        tokens, num_new, _ = sampler.verify(rows, chunks, [idx] * len(chunks))
    tokens, num_new = tokens.view(-1, 2).numpy(), num_new.numpy()
    first, accepted = tokens[:, 0], num_new == 2
    assert (first[accepted] == drafts[accepted]).all() and (first[~accepted] != drafts[~accepted]).all()

    what = f"seed {seed}, q {q_kind}"
    # With q: the first token follows p; accepted with probability sum_x min(p(x), q(x)).
    pv, desc = gof(np.bincount(first[:N], minlength=V), N * p0)
    assert pv > ALPHA, f"{what}: first token vs p: {desc}, p-value {pv:.2e}"
    check_rate(accepted[:N], np.minimum(p0, q).sum(), f"{what}: acceptance")
    # After an accepted draft d, the bonus token follows p at the next row with d counted as output.
    acc = np.flatnonzero(accepted[:N])
    if acc.size:  # none when p and q share no token (top-k/top-p cut p to tokens q gives no mass)
        pv, desc = gof(np.bincount(tokens[acc, 1], minlength=V), p1[drafts[acc]].sum(axis=0))
        assert pv > ALPHA, f"{what}: bonus token vs p: {desc}, p-value {pv:.2e}"
    # Without q (n-gram proposals), in the same batch: the one-hot path, accepted with probability p(d).
    plain = slice(N, None)
    pv, desc = gof(np.bincount(first[plain], minlength=V), N_PLAIN * p0)
    assert pv > ALPHA, f"{what}: first token without q: {desc}, p-value {pv:.2e}"
    check_rate(accepted[plain], p0[drafts[plain]].mean(), f"{what}: one-hot acceptance")


def test_rejection_sampling_of_a_seeded_request_repeats():
    """The acceptance uniforms and the residual draws are keyed by (seed, output index): the same
    chunk verified twice, alone or in another batch, gives the same tokens."""
    seed = random.randrange(1 << 30)
    rng = np.random.default_rng(seed)
    V = 64
    logits = torch.tensor(rng.normal(0, 2, (8, V)), dtype=torch.float32)
    q = torch.tensor(rng.dirichlet(np.ones(V), 3), dtype=torch.float32)

    def chunk(s: int) -> SeqChunk:
        req = Request(f"s{s}", [1, 2, 3], SamplingParams(temperature=1.0, seed=s))
        req.draft_probs = q
        return SeqChunk(req, 0, 6, sample=True, draft_token_ids=rng.integers(0, V, 3).tolist())

    a, b = chunk(seed), chunk(seed + 1)
    b.draft_token_ids = list(a.draft_token_ids)
    alone = DeviceSampler(V, torch.device("cpu")).verify(logits[:4].clone(), [a], [5])
    pair = DeviceSampler(V, torch.device("cpu"), 7).verify(torch.cat([logits[4:], logits[:4]]), [b, a], [9, 5])
    n = int(alone[1][0])
    assert int(pair[1][1]) == n and pair[0][4 : 4 + n].tolist() == alone[0][:n].tolist(), f"seed {seed}"


# ---------------------------------------------------------------- settings and start errors


def test_draft_settings_are_checked():
    with pytest.raises(ConfigError, match="SPECULATE_METHOD=draft needs SPECULATE_MODEL_PATH"):
        Config.from_env(env={"SPECULATE_METHOD": "draft"})
    # mtp may read its module from SPECULATE_MODEL_PATH (checked at start: test_spec_mtp.py)
    assert Config.from_env(env={"SPECULATE_METHOD": "mtp", "SPECULATE_MODEL_PATH": "/x"}).speculate_model_path == "/x"
    cfg = Config.from_env(env={"SPECULATE_METHOD": "draft", "SPECULATE_MODEL_PATH": "/x"})
    assert cfg.speculate_method == "draft" and cfg.speculate_model_path == "/x"


def test_start_errors_name_the_setting(tiny_hf_dir, tmp_path):
    target = str(tiny_hf_dir)
    with pytest.raises(ConfigError, match="SPECULATE_MODEL_PATH=.*not a directory"):
        make_engine(target, str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="SPECULATE_MODEL_PATH=.*safetensors"):
        make_engine(target, str(tmp_path / "empty"))
    other = _copy_checkpoint(tiny_hf_dir, tmp_path / "other-vocab", vocab=256)
    with pytest.raises(ConfigError, match="SPECULATE_MODEL_PATH=.*vocab_size is 256.*512"):
        make_engine(target, other)


def test_the_paddle_runner_refuses_a_draft_model(tiny_hf_dir, draft_dir, tmp_path):
    pytest.importorskip("paddle")
    from llmserve.engine.sampler import Sampler
    from llmserve.runners.paddle.export import export_hf
    from llmserve.runners.paddle.runner import PaddleRunner

    cfg = Config.from_env(env={}, block_size=4, max_seq_len=256, batch_size=8, block_bs=2)
    runner = PaddleRunner(str(export_hf(tiny_hf_dir, tmp_path / "paddle")), cfg, Sampler(0))
    cfg = dataclasses.replace(cfg, speculate_method="draft", speculate_model_path=draft_dir)
    with pytest.raises(ConfigError, match="SPECULATE_METHOD=draft runs on the torch runner only.*PaddleRunner"):
        LLMEngine(cfg, runner)
