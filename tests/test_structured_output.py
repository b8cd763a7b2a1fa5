"""Structured output: every output follows its grammar, on both runners, through the executor of a
tensor-parallel group, and through the whole stack with the OpenAI client.

The models know nothing of JSON (the demo continues Python; the tiny one is random): whatever they
produce here is the grammar's doing, so each check would fail without the mask.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from llmserve.engine.sampling_params import SamplingParams
from llmserve.offline import LLM
from llmserve.protocol.structured import grammar_for

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def params(field: str, value, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=120, temperature=1.0, seed=seed, grammar=grammar_for({field: value}), **kw)


def check_outputs(llm: LLM, fresh_seed: int, bounded_only: bool = False) -> None:
    """Bounded grammars (every output short) must end by themselves, each output valid. An unbounded
    one (any JSON object: its keys and strings may run on) must give valid objects wherever it ended,
    at least one of 8 (the demo ends ~3 in 4 within 120 tokens); a random model's strings never
    close, so it gets bounded grammars only."""
    prompts = ['d = {"a": 1}\ne = ', "import os\n", "x = [", "class A:\n"] * 2
    cases = [
        ("guided_json", PERSON, lambda t: jsonschema.validate(json.loads(t), PERSON)),
        ("guided_regex", r"[0-9]{3}-[a-z]{2,4}", lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) or 1 / 0),
        ("guided_choice", ["yes", "no", "maybe so"], lambda t: t in ("yes", "no", "maybe so") or 1 / 0),
    ]
    if not bounded_only:
        cases.append(("response_format", {"type": "json_object"}, lambda t: isinstance(json.loads(t), dict) or 1 / 0))
    for field, value, ok in cases:
        ps = [params(field, value, fresh_seed + i) for i in range(len(prompts))]
        done = [r for r in llm.generate(prompts, ps) if r.finish_reason == "stop"]  # ended by its grammar
        assert len(done) == len(prompts) or (field == "response_format" and done), (field, len(done))
        for r in done:
            ok(r.text)


def test_demo_model_follows_grammars(demo_dir, fresh_seed):
    """The Paddle runner (host sampler) on CPU."""
    llm = LLM(demo_dir)
    try:
        check_outputs(llm, fresh_seed)
        free = llm.generate(["x = ["], SamplingParams(max_tokens=20, temperature=0))[0].text
        assert not re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", free)  # unconstrained, it writes something else
    finally:
        llm.engine.shutdown()


def test_torch_runner_follows_grammars(tiny_hf_dir, fresh_seed):
    """The torch runner (the mask applied to the logits where the device samples)."""
    llm = LLM(str(tiny_hf_dir), runner="torch", device="cpu")
    try:
        check_outputs(llm, fresh_seed, bounded_only=True)
    finally:
        llm.engine.shutdown()


def test_bad_grammars_are_named():
    with pytest.raises(ValueError, match="guided_regex: cannot be compiled"):
        grammar_for({"guided_regex": "a(b"})
    with pytest.raises(ValueError, match="guided_json: cannot be compiled"):
        grammar_for({"guided_json": {"type": "strnig"}})
    with pytest.raises(ValueError, match="only one structured-output field"):
        grammar_for({"guided_regex": "a", "guided_choice": ["b"]})
    with pytest.raises(ValueError, match="response_format: json_schema needs"):
        grammar_for({"response_format": {"type": "json_schema"}})
    assert grammar_for({"response_format": {"type": "text"}}) is None


@pytest.mark.parametrize("runner", ["paddle", "torch"])
def test_speculative_drafts_are_checked_against_the_grammar(runner, demo_dir, tiny_hf_dir, fresh_seed):
    """n-gram proposals for constrained requests: each draft row masked by the grammar after the drafts
    before it, drafts the grammar refuses never kept. Greedy output equals decoding without
    speculation, and drafts were verified and accepted."""
    model = demo_dir if runner == "paddle" else str(tiny_hf_dir)
    kw = {} if runner == "paddle" else {"runner": "torch", "device": "cpu"}
    pattern = r"(ab|cd){4,30}x"
    ps = [SamplingParams(max_tokens=80, temperature=0.0, grammar=grammar_for({"guided_regex": pattern}))] * 3
    seeded = [
        SamplingParams(max_tokens=80, temperature=1.0, seed=fresh_seed + i, grammar=ps[0].grammar) for i in range(3)
    ]
    prompts = ["abab cdcd abab", "x = 1\n", "def f():\n"]
    out = {}
    for spec in ("none", "ngram"):
        llm = LLM(model, speculate_method=spec, **kw)
        try:
            out[spec] = [r.text for r in llm.generate(prompts, ps)], [r.text for r in llm.generate(prompts, seeded)]
            stats = llm.engine.stats()
        finally:
            llm.engine.shutdown()
        assert all(re.fullmatch(pattern, t) for t in out[spec][0] + out[spec][1]), out[spec]
    assert out["ngram"] == out["none"]  # greedy and seeded alike: n-gram drafts keep the draws
    assert stats.spec_verified > 0 and stats.spec_accepted_tokens > 0
