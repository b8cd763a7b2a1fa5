"""OpenAI's predicted outputs (`prediction`): the prediction's tokens are proposals the runner verifies, so an
output that repeats the prediction takes fewer steps, and every output is the one without a prediction
(greedy: the same tokens). The alignment of PredictionProposer is checked on its own too."""

from __future__ import annotations

import dataclasses
import random

import pytest

from llmserve.config import Config
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.prediction import PredictionProposer
from llmserve.engine.sampling_params import SamplingParams

PROMPTS = ["def fibonacci(n):\n", "import os\n\ndef ", "class Stack:\n    def __init__(self):\n"]


def test_alignment_follows_parts_and_realigns():
    p = PredictionProposer()
    pred = [10, 11, 12, 13, 14, 15, 16, 17]
    assert p.next_tokens("r", pred, [], 3) == [10, 11, 12]  # no output yet: the prediction's start
    assert p.next_tokens("r", pred, [10, 11], 3) == [12, 13, 14]  # kept to it
    assert p.next_tokens("r", pred, [10, 11, 99], 3) == []  # parted: 99 is nowhere in it
    assert p.next_tokens("r", pred, [10, 11, 99, 14], 2) == [15, 16]  # realigned on its last token
    assert p.next_tokens("r", pred, [10, 11, 99, 14, 15, 16, 17], 3) == []  # the prediction is used up
    p.drop(["r"])
    assert p.next_tokens("r", pred, [13], 2) == [14, 15]  # forgotten: aligned afresh


def test_realigns_at_or_after_the_last_alignment():
    """A repeated pattern realigns where the output was, not at its first occurrence."""
    p = PredictionProposer()
    pred = [1, 2, 3, 9, 1, 2, 3, 8]
    assert p.next_tokens("r", pred, [1, 2, 3, 9, 1], 2) == [2, 3]
    assert p.next_tokens("r", pred, [1, 2, 3, 9, 1, 2, 3, 7, 2, 3], 2) == [8]


@pytest.fixture(scope="module")
def engine(demo_dir):
    from llmserve.serving.compose import build_engine

    return build_engine(Config.from_env(env={}, model_dir=demo_dir, batch_size=8))


def generate(engine: LLMEngine, prompt: str, params: SamplingParams) -> tuple[list[int], int]:
    """(output tokens, engine steps) of one request run alone."""
    ids = engine.tokenizer.encode(prompt)
    rid = f"p{random.getrandbits(32)}"
    engine.add_request(rid, ids, params)
    steps, out = 0, []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
        steps += 1
    return out, steps


def test_prediction_saves_steps_and_changes_no_token(engine):
    base = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    report = []
    for prompt in PROMPTS:
        plain, plain_steps = generate(engine, prompt, base)
        exact, exact_steps = generate(engine, prompt, dataclasses.replace(base, prediction_token_ids=list(plain)))
        # An edit: the same output with 6 tokens in its middle changed (token 0 is the demo's <s>, never
        # produced after the prompt's start).
        edited = list(plain)
        edited[20:26] = [0] * 6
        edit, edit_steps = generate(engine, prompt, dataclasses.replace(base, prediction_token_ids=edited))
        assert exact == plain and edit == plain, "a prediction changed the output"
        k = engine.spec.max_k
        # Every step with the whole prediction matching accepts its k drafts: one step per k + 1 tokens.
        assert exact_steps <= -(-len(plain) // (k + 1)) + 2, (exact_steps, plain_steps)
        assert exact_steps <= edit_steps < plain_steps  # an edit costs steps until the output realigns
        report.append((prompt, plain_steps, exact_steps, edit_steps))
    print("steps (plain, exact prediction, edited prediction):", report)
    assert not engine.has_unfinished() and engine.block_manager.num_used == 0


def test_prediction_out_of_vocabulary_is_refused(engine):
    bad = SamplingParams(max_tokens=4, prediction_token_ids=[engine.runner.vocab_size])
    with pytest.raises(ValueError, match="prediction: token id .* out of vocabulary"):
        engine.add_request("bad", [5, 6, 7], bad)
