"""The host sampler against independent, straightforward definitions."""

import numpy as np
import pytest

from llmserve.engine.request import Request
from llmserve.engine.sampler import Sampler, apply_penalties
from llmserve.engine.sampling_params import SamplingParams

V = 64


def _req(rid, params, prompt=(1, 2, 3), output=(), eos=frozenset()):
    r = Request(rid, list(prompt), params, eos)
    r.output_token_ids = list(output)
    return r


def _reference_penalties(logits, prompt, output, p):
    out = logits.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        c = output.count(t)
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def test_penalties_match_definition():
    rng = np.random.default_rng()
    for _ in range(20):
        logits = rng.normal(size=V).astype(np.float32) * 3
        prompt = rng.integers(0, V, size=rng.integers(1, 10)).tolist()
        output = rng.integers(0, V, size=rng.integers(0, 15)).tolist()
        p = SamplingParams(
            repetition_penalty=float(rng.uniform(0.5, 2.0)),
            frequency_penalty=float(rng.uniform(-1, 1)),
            presence_penalty=float(rng.uniform(-1, 1)),
        )
        got = apply_penalties(logits.copy(), prompt, output, p)
        np.testing.assert_allclose(got, _reference_penalties(logits, prompt, output, p), rtol=1e-5, atol=1e-5)
        untouched = [t for t in range(V) if t not in set(prompt) | set(output)]
        np.testing.assert_array_equal(got[untouched], logits[untouched])


def test_greedy_is_argmax_after_penalties():
    logits = np.zeros(V, np.float32)
    logits[5], logits[7] = 3.0, 2.0
    s = Sampler()
    req = _req("a", SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[5])
    assert s.sample(logits[None], [req])[0] == [7]  # 3/2 < 2
    req = _req("b", SamplingParams(temperature=0), prompt=[5])
    assert s.sample(logits[None], [req])[0] == [5]


def test_min_tokens_bans_stop_tokens():
    logits = np.zeros(V, np.float32)
    logits[0] = 50.0  # eos would win by far
    s = Sampler()
    req = _req("a", SamplingParams(temperature=0, min_tokens=3, max_tokens=5), output=[4], eos=frozenset({0}))
    assert s.sample(logits[None], [req])[0] != [0]
    req.output_token_ids = [4, 4, 4]
    assert s.sample(logits[None], [req])[0] == [0]


def test_seeded_sampling_reproduces_whatever_the_batch():
    rng = np.random.default_rng()
    steps = [rng.normal(size=(4, V)).astype(np.float32) for _ in range(30)]
    seed = int(rng.integers(1 << 30))

    def run(position, batch_seeds):
        s = Sampler(seed=int(rng.integers(1 << 30)))
        reqs = [_req(f"r{i}", SamplingParams(temperature=0.9, top_p=0.95, seed=sd)) for i, sd in enumerate(batch_seeds)]
        target = _req("t", SamplingParams(temperature=0.9, top_p=0.95, seed=seed))
        reqs.insert(position, target)
        out = []
        for logits in steps:
            order = [0, 1, 2, 3][: len(reqs)]
            rows = np.stack([logits[min(i, 3)] for i in order])
            rows[position] = logits[0]
            toks, _ = s.sample(rows, reqs)
            out.append(toks[position])
        return out

    alone = run(0, [])
    assert run(0, [None, 7]) == alone
    assert run(2, [None, 11]) == alone
    assert len(set(alone)) > 1  # it really sampled


def test_top_p_never_leaves_the_nucleus():
    rng = np.random.default_rng()
    s = Sampler(seed=int(rng.integers(1 << 30)))
    for trial in range(30):
        logits = rng.normal(size=V).astype(np.float32) * rng.uniform(0.5, 4)
        top_p = float(rng.uniform(0.05, 0.95))
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        mass_before = np.cumsum(probs[order]) - probs[order]
        nucleus = set(order[mass_before < top_p].tolist()) | {int(order[0])}
        drawn = set()
        for i in range(200):  # a draw is a function of (seed, output index): each its own seed
            req = _req(f"r{trial}.{i}", SamplingParams(temperature=1.0, top_p=top_p, seed=trial * 1000 + i))
            drawn.add(s.sample(logits[None], [req])[0][0])
        assert drawn <= nucleus
        assert len(drawn) > 1 or len(nucleus) == 1


def test_top_k_and_temperature_follow_softmax():
    rng = np.random.default_rng()
    logits = rng.normal(size=V).astype(np.float32)
    k, temp, n = 5, 0.7, 6000
    s = Sampler(seed=int(rng.integers(1 << 30)))
    counts = np.zeros(V)
    for i in range(n):  # unseeded requests: the sampler draws each its own seed
        counts[s.sample(logits[None], [_req(f"a{i}", SamplingParams(temperature=temp, top_k=k))])[0][0]] += 1
    top = np.argsort(-logits)[:k]
    assert counts.sum() == counts[top].sum()
    p = np.exp((logits[top] - logits[top].max()) / temp)
    p /= p.sum()
    # Within 5 standard deviations of the binomial count, for each kept token.
    sd = np.sqrt(n * p * (1 - p))
    assert np.all(np.abs(counts[top] - n * p) < 5 * sd + 1)


def test_logprobs_are_log_softmax():
    rng = np.random.default_rng()
    logits = rng.normal(size=V).astype(np.float32)
    req = _req("a", SamplingParams(temperature=0, logprobs=3))
    toks, lps = Sampler().sample(logits[None], [req])
    ref = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    assert toks[0] == int(np.argmax(logits))
    assert lps[0].logprob == pytest.approx(ref[toks[0]], abs=1e-5)
    assert [t for t, _ in lps[0].top] == np.argsort(-ref)[:3].tolist()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(max_tokens=0),
        dict(min_tokens=5, max_tokens=2),
        dict(top_k=-1),
        dict(stop=[""]),
    ],
)
def test_bad_params_name_the_field(kwargs):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert next(iter(kwargs)) in str(e.value) or "min_tokens" in str(e.value)
