"""DeepSeek on the GPU: decode and verification steps (and the MTP head's) replayed as CUDA graphs decode as
eager steps do (bf16 tiny random checkpoints; skipped without a CUDA device).

The CPU tests (test_deepseek.py, test_deepseek_mtp.py) check the family against transformers in fp32; these
check what only a GPU runs: the MLA decode kernel, the latent-cache write and the fused experts inside
captured graphs, with real block tables and padding rows. bf16: a near-tie may flip a token now and then, so
each compares the share of equal tokens, not every token.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_spec_mtp import make_engine
from test_speculative import run

from llmserve.engine.sampling_params import SamplingParams
from llmserve.models.random_model import write_random_deepseek

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def same_share(a: dict, b: dict) -> float:
    """Of the requests' tokens, the share equal up to each request's first difference."""
    same = total = 0
    for rid, (tokens, *_) in a.items():
        other = b[rid][0]
        n = next((i for i, (x, y) in enumerate(zip(tokens, other)) if x != y), min(len(tokens), len(other)))
        same, total = same + n, total + len(tokens)
    return same / total


@pytest.mark.gpu
@pytest.mark.parametrize("version,k", [("v3", 0), ("v2", 0), ("v3", 3)], ids=["v3", "v2", "v3-mtp3"])
def test_graph_steps_decode_as_eager_ones(tmp_path, version, k):
    seed = random.randrange(1 << 30)
    path = write_random_deepseek(tmp_path, version, seed=seed, dtype=torch.bfloat16)
    rng = np.random.default_rng(seed)
    p = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    reqs = [(f"r{i}", rng.integers(0, 256, 3 + 9 * i).tolist(), p) for i in range(7)]
    got = {}
    for graphs in (True, False):
        engine = make_engine(str(path), k, tokenizer=False, device="cuda", cuda_graphs=graphs)
        assert (engine.runner.graphs is not None) == graphs
        got[graphs] = run(engine, reqs)
        if k:
            assert engine.stats().spec_draft_tokens > 0
        del engine
        torch.cuda.empty_cache()
    share = same_share(got[True], got[False])
    assert share >= 0.8, f"seed {seed}: {share:.2f} of the tokens equal"
