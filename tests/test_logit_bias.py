"""OpenAI logit_bias in both samplers (host numpy, torch device) and end to end through the engine.

The bias is added to the raw logits before penalties, the min_tokens ban, temperature and the
top-k/top-p cuts, and before greedy's argmax. Each sampler is checked against a small numpy
reference of that whole pipeline on fresh random logits, and its draws by a chi-square test.
No scipy here: the chi-square critical value comes from the Wilson-Hilferty approximation.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from llmserve.config import Config
from llmserve.engine.request import Request
from llmserve.engine.sampler import Sampler
from llmserve.engine.sampling_params import SamplingParams

torch = pytest.importorskip("torch")
from llmserve.layers.sampler import DeviceSampler  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
Z_1E4 = 3.719  # standard normal quantile at 1 - 1e-4: each chi-square test fails by chance 1 in 10,000


def _req(rid: str, params: SamplingParams, prompt=(1, 2, 3), output=(), eos=frozenset()) -> Request:
    r = Request(rid, list(prompt), params, frozenset(eos))
    r.output_token_ids = list(output)
    return r


class Run:
    """One sampler behind one call: (logits [N, V], requests) -> (tokens, logprobs, processed logits)."""

    def __init__(self, kind: str, vocab: int, seed: int) -> None:
        self.kind = kind
        self.sampler = Sampler(seed) if kind == "host" else DeviceSampler(vocab, DEV, seed)

    def __call__(self, logits: np.ndarray, reqs: list[Request]):
        if self.kind == "host":
            rows = np.array(logits, dtype=np.float32)  # sample_one processes its row in place
            out = [self.sampler.sample_one(row, r) for row, r in zip(rows, reqs)]
            return [t for t, _ in out], [lp for _, lp in out], rows
        x = torch.tensor(logits, dtype=torch.float32, device=DEV)
        tokens, lps = self.sampler.sample(x, reqs)
        return tokens.tolist(), (lps(tokens) if lps is not None else [None] * len(reqs)), x.cpu().numpy()


@pytest.fixture(params=["host", "device"])
def kind(request) -> str:
    return request.param


def reference(logits: np.ndarray, req: Request) -> np.ndarray:
    """The whole pipeline up to temperature, written out plainly in float64."""
    x = logits.astype(np.float64).copy()
    p, out = req.params, req.output_token_ids
    for t, b in p.logit_bias.items():
        if t < x.shape[0]:
            x[t] += b
    for t in set(req.prompt_token_ids) | set(out):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    if len(out) < p.min_tokens:
        x[list(req.eos_token_ids)] = -np.inf
    return x


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom over the support of `probs` (which must hold every
    draw); cells expecting under 5 draws are pooled into one."""
    assert counts[probs == 0].sum() == 0, "draws where the distribution has no mass"
    counts, exp = counts[probs > 0], counts.sum() * probs[probs > 0]
    small = exp < 5
    obs, ex = list(counts[~small]), list(exp[~small])
    if small.any():
        obs.append(counts[small].sum())
        ex.append(exp[small].sum())
    o, e = np.array(obs, dtype=np.float64), np.array(ex)
    return float(((o - e) ** 2 / e).sum()), len(o) - 1


def chi2_critical(df: int, z: float = Z_1E4) -> float:
    """Wilson-Hilferty: the chi-square quantile whose normal quantile is z."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# ---------------------------------------------------------------- both samplers, fresh random logits
def test_plus_100_forces_the_token(kind, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    V = 1000
    run = Run(kind, V, fresh_seed)
    for trial in range(10):
        logits = rng.normal(size=(3, V)).astype(np.float32) * 4
        t = int(rng.integers(V))
        # greedy, sampled at temperature 1, and sampled with a cut: the forced token wins every way
        params = [SamplingParams(temperature=0, logit_bias={t: 100.0}), SamplingParams(logit_bias={t: 100.0})]
        params.append(SamplingParams(temperature=1.3, top_k=5, top_p=0.5, logit_bias={t: 100.0}))
        tokens, _, _ = run(logits, [_req(f"r{trial}.{i}", p) for i, p in enumerate(params)])
        assert tokens == [t, t, t], (fresh_seed, trial)


def test_minus_100_on_the_argmax_gives_the_second_best(kind, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    V = 500
    run = Run(kind, V, fresh_seed)
    for trial in range(10):
        logits = rng.normal(size=(1, V)).astype(np.float32) * 3
        first, second = np.argsort(-logits[0])[:2].tolist()
        req = _req(f"r{trial}", SamplingParams(temperature=0, logit_bias={first: -100.0}))
        assert run(logits, [req])[0] == [second], (fresh_seed, trial)


def test_ids_past_the_vocabulary_are_ignored(kind, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    V = 100
    logits = rng.normal(size=(1, V)).astype(np.float32)
    t = int(rng.integers(V))
    req = _req("a", SamplingParams(temperature=0, logit_bias={V: 100.0, V + 7: -5.0, t: 100.0}))
    tokens, _, processed = Run(kind, V, fresh_seed)(logits, [req])
    assert tokens == [t]
    expect = logits[0].copy()
    expect[t] += 100.0
    np.testing.assert_allclose(processed[0], expect, rtol=1e-6)


def test_a_bias_on_b_leaves_a_alone(kind, fresh_seed):
    """Seeded sampling over several steps: request A draws the same tokens whether or not B has a bias."""
    rng = np.random.default_rng(fresh_seed)
    V, steps = 200, 25
    logits = [rng.normal(size=(2, V)).astype(np.float32) * 2 for _ in range(steps)]
    forced = int(rng.integers(V))
    seed_a, seed_b = (int(s) for s in rng.integers(1 << 30, size=2))

    def go(bias_b: dict[int, float]):
        run = Run(kind, V, fresh_seed)
        a = _req("a", SamplingParams(temperature=1.0, top_p=0.95, seed=seed_a))
        b = _req("b", SamplingParams(temperature=1.0, seed=seed_b, logit_bias=bias_b))
        for x in logits:
            tokens, _, processed = run(x, [a, b])
            np.testing.assert_array_equal(processed[0], x[0])  # A's row is not touched at all
            a.output_token_ids.append(tokens[0])
            b.output_token_ids.append(tokens[1])
        return a.output_token_ids, b.output_token_ids

    a_plain, b_plain = go({})
    a_biased, b_biased = go({forced: 100.0})
    assert a_biased == a_plain, fresh_seed
    assert b_biased == [forced] * steps and b_plain != b_biased
    assert len(set(a_plain)) > 1  # it really sampled


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 6)])
def test_draws_follow_softmax_of_biased_logits(kind, fresh_seed, temperature, top_k):
    rng = np.random.default_rng(fresh_seed)
    V, n = 24, 20000
    logits = rng.normal(size=V).astype(np.float32)
    # +1.5 on three of the ranks 4-12 and -1 on the best: with top-k 6, the bias moves tokens across
    # the cut, and without it the bias always changes the distribution enough for the power check.
    order = np.argsort(-logits)
    bias = {int(t): 1.5 for t in rng.choice(order[3:12], size=3, replace=False)} | {int(order[0]): -1.0}
    params = SamplingParams(temperature=temperature, top_k=top_k, logit_bias=bias)
    # n requests of one draw each: every request has its own stream (host generator / device seed)
    reqs = [_req(f"r{i}", params) for i in range(n)]
    tokens, _, _ = Run(kind, V, fresh_seed)(np.broadcast_to(logits, (n, V)), reqs)
    counts = np.bincount(tokens, minlength=V)

    biased = logits.astype(np.float64)
    biased[list(bias)] += list(bias.values())
    scaled = biased / temperature
    if top_k:
        scaled[np.argsort(-scaled, kind="stable")[top_k:]] = -np.inf
    stat, df = chi2(counts, softmax(scaled))
    assert stat < chi2_critical(df), (fresh_seed, stat, df)
    # The test has power: the unbiased distribution is rejected.
    plain = logits.astype(np.float64) / temperature
    if top_k:
        plain[np.argsort(-plain, kind="stable")[top_k:]] = -np.inf
    plain_p = softmax(plain)
    if counts[plain_p == 0].sum() == 0:  # (else draws outside its support already reject it)
        stat0, df0 = chi2(counts, plain_p)
        assert stat0 > chi2_critical(df0), (fresh_seed, stat0, df0)


def test_penalties_and_min_tokens_apply_on_top_of_the_bias(kind, fresh_seed):
    """Greedy tokens, processed logits and logprobs against the numpy reference, over two steps
    (the device sampler then uses its cached bias and its incremental penalty counts)."""
    rng = np.random.default_rng(fresh_seed)
    V = 64
    run = Run(kind, V, fresh_seed)
    reqs = []
    for i in range(6):
        prompt = rng.integers(0, V, size=int(rng.integers(1, 8))).tolist()
        output = rng.integers(0, V, size=int(rng.integers(0, 6))).tolist()
        # biases on seen tokens (where the order against the penalties matters) and on random ones
        pool = list(set(prompt) | set(output)) + rng.integers(0, V, size=3).tolist()
        bias = {int(t): float(rng.uniform(-4, 4)) for t in pool} if i != 5 else {}
        p = SamplingParams(
            temperature=0,
            max_tokens=50,
            min_tokens=int(rng.integers(0, 8)),
            repetition_penalty=float(rng.uniform(0.5, 2.0)),
            frequency_penalty=float(rng.uniform(-1, 1)),
            presence_penalty=float(rng.uniform(-1, 1)),
            logprobs=2,
            logit_bias=bias,
        )
        reqs.append(_req(f"p{i}", p, prompt, output, eos={int(rng.integers(V))}))
    for step in range(2):
        logits = rng.normal(size=(len(reqs), V)).astype(np.float32) * 3
        tokens, lps, processed = run(logits, reqs)
        for i, r in enumerate(reqs):
            ref = reference(logits[i], r)
            np.testing.assert_allclose(processed[i], ref, rtol=1e-5, atol=1e-4, err_msg=f"{fresh_seed} {step} {i}")
            assert tokens[i] == int(np.argmax(ref)), (fresh_seed, step, i)
            # Logprobs are of the processed logits before temperature: the bias shows in them.
            ls = ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())
            assert lps[i].logprob == pytest.approx(ls[tokens[i]], abs=1e-4)
            r.output_token_ids.append(tokens[i])


def test_reused_request_id_takes_its_new_bias(kind, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    V = 50
    run = Run(kind, V, fresh_seed)
    logits = rng.normal(size=(1, V)).astype(np.float32)
    t1, t2 = (int(t) for t in rng.choice(V, size=2, replace=False))
    assert run(logits, [_req("x", SamplingParams(temperature=0, logit_bias={t1: 100.0}))])[0] == [t1]
    assert run(logits, [_req("x", SamplingParams(temperature=0, logit_bias={t2: 100.0}))])[0] == [t2]
    run.sampler.drop(["x"])
    assert run(logits, [_req("x", SamplingParams(temperature=0))])[0] == [int(np.argmax(logits))]


def test_device_sampler_builds_a_bias_once_per_request_and_skips_unbiased_batches(monkeypatch, fresh_seed):
    import llmserve.layers.sampler as dev_sampler

    built = []
    real = dev_sampler.bias_arrays
    monkeypatch.setattr(dev_sampler, "bias_arrays", lambda b, v: built.append(b) or real(b, v))
    rng = np.random.default_rng(fresh_seed)
    V = 40
    s = DeviceSampler(V, DEV, fresh_seed)
    biased = _req("b", SamplingParams(temperature=0, logit_bias={3: 100.0}))
    plain = _req("p", SamplingParams(temperature=0))
    for _ in range(3):
        x = torch.tensor(rng.normal(size=(2, V)), dtype=torch.float32, device=DEV)
        assert s.sample(x, [plain, biased])[0].tolist()[1] == 3
    assert len(built) == 1
    s.drop(["b"])
    assert "b" not in s._bias

    def boom(*a):
        raise AssertionError("a batch without any bias must not build one")

    monkeypatch.setattr(DeviceSampler, "_apply_bias", boom)
    x = torch.tensor(rng.normal(size=(1, V)), dtype=torch.float32, device=DEV)
    assert s.sample(x.clone(), [plain])[0].tolist() == [int(x.argmax())]


def _key_hashing_token0_to(h: int) -> int:
    """The noise key under which token 0's 32-bit hash is `h` (the mixing steps inverted)."""
    inv = pow(0x45D9F3B, -1, 1 << 32)
    h ^= h >> 16
    h = (h * inv) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * inv) & 0xFFFFFFFF
    return h ^ (h >> 16)  # token 0's pre-mix value is the key itself


@pytest.mark.parametrize("h", [0xFFFFFFFF, 0])
def test_gumbel_noise_stays_finite_at_the_extreme_hashes(h):
    """The largest hash once gave u == 1.0 in float32 (+inf noise): a top-k-masked token then won."""
    from llmserve.kernels import HAS_TRITON
    from llmserve.kernels.sampling import _noise_ref, gumbel_argmax, gumbel_argmax_ref

    key = torch.tensor([_key_hashing_token0_to(h)], dtype=torch.int64)
    u = _noise_ref(key, 8)
    assert bool(((u > 0) & (u < 1)).all()), u
    logits = torch.tensor([[float("-inf"), 0.0, 1.0, -1.0]])  # token 0 masked, as top-k/top-p do
    inv_t = torch.tensor([1.0])
    assert int(gumbel_argmax_ref(logits, inv_t, key)[0]) != 0
    if HAS_TRITON and torch.cuda.is_available():  # the kernel computes the same noise
        cuda = [t.cuda() for t in (logits, inv_t, key)]
        assert int(gumbel_argmax(*cuda)[0]) == int(gumbel_argmax_ref(logits, inv_t, key)[0])


# ---------------------------------------------------------------- end to end through the engine
def _generate(engine, prompt: list[int], params_list: list[SamplingParams]) -> list[list[int]]:
    """Run the requests together (one batch); their tokens, in order."""
    for i, p in enumerate(params_list):
        engine.add_request(f"g{i}", prompt if i == 0 else prompt[::-1], dataclasses.replace(p))
    got: dict[str, list[int]] = {f"g{i}": [] for i in range(len(params_list))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.req_id] += out.new_token_ids
    return [got[f"g{i}"] for i in range(len(params_list))]


def _check_engine(make_engine, vocab: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, size=int(rng.integers(4, 12))).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    base, other = _generate(make_engine(), prompt, [greedy, greedy])
    banned = dataclasses.replace(greedy, logit_bias={base[0]: -100.0})
    assert _generate(make_engine(), prompt, [banned])[0][0] != base[0], seed
    forced_tok = int(rng.integers(vocab))
    forced = dataclasses.replace(greedy, logit_bias={forced_tok: 100.0})
    got, other_beside = _generate(make_engine(), prompt, [forced, greedy])
    assert got == [forced_tok] * 6, seed
    assert other_beside == other, seed  # the unbiased request beside it is unchanged


def test_engine_paddle_runner_honours_logit_bias(demo_dir, fresh_seed):
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.runners.paddle.runner import PaddleRunner

    config = Config.from_env(env={}, max_seq_len=128, block_size=8, block_bs=4, batch_size=4)
    runner = PaddleRunner(str(demo_dir), config, Sampler(0))

    def make():
        runner.sampler = Sampler(0)  # a fresh engine over the same loaded graph
        return LLMEngine(config, runner)

    _check_engine(make, runner.vocab_size, fresh_seed)


def test_engine_torch_runner_honours_logit_bias(tiny_hf_dir, fresh_seed):
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.runners.torch.runner import TorchRunner

    config = Config(block_size=4, max_seq_len=128, batch_size=4, block_bs=4, max_num_batched_tokens=32)
    runner = TorchRunner(str(tiny_hf_dir), config)

    def make():
        runner.sampler = DeviceSampler(runner.vocab_size, runner.device, 0)
        return LLMEngine(config, runner)

    _check_engine(make, runner.vocab_size, fresh_seed)
