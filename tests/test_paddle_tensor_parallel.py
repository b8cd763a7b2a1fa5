"""The Paddle runner at MP_NUM > 1 on a CPU build: an `--mp 2` export served by two ranks over gloo.

Rank 0 is the offline engine in this process and rank 1 a worker process (llmserve.executor); each runs
its own graph rank_<r> (runners/paddle/ranks.py). The export is test_export_mp's random tiny model,
whose sharded graphs compute the unsharded one's logits up to float32 summation order: greedy tokens
must agree with the `--mp 1` export at MP_NUM=1, over chunked prefill and a prefix-cache hit.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import signal
import subprocess
import sys
import time

import paddle
import pytest

from llmserve.engine.sampling_params import SamplingParams
from llmserve.executor.executor import EXIT_CODE
from llmserve.models.demo import DEMO_HF_DIR
from llmserve.offline import LLM
from llmserve.serving.testing import ROOT, port_is_free, process_tree
from tests.test_export_mp import BLOCK, random_exports  # noqa: F401 (a fixture)
from tests.test_tensor_parallel import config

pytestmark = pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="GPU builds refuse MP_NUM > 1 (NCCL)")

# Prompts within the model's 64 positions; 16-token steps chunk the long one's prefill.
SETTINGS = dict(runner="auto", block_size=BLOCK, max_seq_len=64, max_num_batched_tokens=16, block_bs=2)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SHARED = [5, 300, 17, 42, 99, 150, 151, 7, 8, 9, 250, 3]  # three blocks


@pytest.fixture(scope="module")
def exports(random_exports):  # noqa: F811
    """The `--mp 1` and `--mp 2` exports, with a tokenizer (ids above 300 never come out)."""
    for d in random_exports:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copyfile(DEMO_HF_DIR / name, d / name)
    return random_exports


def serve(model_dir, mp: int, **kw) -> LLM:
    return LLM(config=config(model_dir, mp, **(SETTINGS | kw)))


def run(llm: LLM) -> tuple[list[list[int]], list[float], int]:
    """Greedy tokens of a batch (one prompt chunked over 3 steps), then of a prompt that shares the
    first one's 3 blocks; the prompt tokens the prefix cache served; the prompt logprobs of another.
    Each call numbers its requests from 0: the last one's first step drops the previous call's."""
    first = [SHARED + [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79], [300, 1, 2]]
    out = [r.token_ids for r in llm.generate(first, GREEDY)]
    out += [r.token_ids for r in llm.generate([SHARED + [200, 201]], GREEDY)]
    hits = llm.engine.stats().prefix_cache_hits
    (r,) = llm.generate([SHARED + [9]], dataclasses.replace(GREEDY, max_tokens=1, prompt_logprobs=0))
    return out, [lp.logprob for lp in r.prompt_logprobs[1:]], hits


@pytest.mark.parametrize("extra", [{}, {"speculate_method": "ngram"}], ids=["plain", "ngram"])
def test_two_ranks_give_one_ranks_tokens(exports, extra):
    full, sharded = exports
    one = serve(full, 1, **extra)
    try:
        want, want_lp, hits = run(one)
    finally:
        one.engine.shutdown()
    assert hits == len(SHARED) and all(len(t) == GREEDY.max_tokens for t in want)
    two = serve(sharded, 2, **extra)
    try:
        got, got_lp, hits = run(two)
    finally:
        two.engine.shutdown()
    assert got == want and hits == len(SHARED)
    assert len(got_lp) == len(SHARED) and max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-4


def test_start_stop_leaves_nothing(exports):
    """Twice in this process (Paddle keeps its first communicator: ranks.py): each stop ends the worker
    and frees the rendezvous port."""
    _, sharded = exports
    before = set(process_tree(os.getpid()))
    tokens = []
    for _ in range(2):
        llm = serve(sharded, 2)
        workers = set(process_tree(os.getpid())) - before
        assert len(workers) == 1, workers  # rank 1
        tokens.append(llm.generate([SHARED], GREEDY)[0].token_ids)
        port = llm.config.dist_port
        llm.engine.shutdown()
        del llm
        gc.collect()
        assert set(process_tree(os.getpid())) == before and not any(os.path.exists(f"/proc/{p}") for p in workers)
        assert port_is_free(port)
    assert tokens[0] == tokens[1]


def test_a_dead_worker_ends_the_group(exports):
    """Rank 1 killed mid-generation: rank 0 (here a child process serving offline) exits with
    EXIT_CODE at once, rather than wait in the graph's next all-reduce; nothing is left."""
    _, sharded = exports
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.test_paddle_tensor_parallel", str(sharded)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("worker "), line
        os.kill(int(line.split()[1]), signal.SIGKILL)
        assert proc.wait(timeout=30) == EXIT_CODE
    finally:
        proc.kill()
        proc.wait()
    assert process_tree(proc.pid) == []


def test_paddle_rendezvous_fails_in_time_naming_the_rank():
    """Rank 0 waiting for Paddle's store: never announced, or announced and never opened (rank 1
    gone meanwhile): a RendezvousError after DIST_TIMEOUT naming who and where, not Paddle's 15 minutes."""
    from datetime import timedelta

    import torch.distributed as dist

    from llmserve.runners.paddle.ranks import join_gloo
    from llmserve.runners.rank_layout import Layout, RendezvousError
    from llmserve.serving.testing import free_ports

    port, dead = free_ports(2)
    store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=1), wait_for_workers=False)
    lay = Layout(world=2, nodes=1, node=0, master="127.0.0.1", port=port, ips=())
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=r"^rank 0 \(node 0, 127.0.0.1\) could not join the Paddle gloo group"):
        join_gloo(lay, 0, store, 1.0)
    store.set("paddle/store", f"127.0.0.1:{dead}")
    with pytest.raises(RendezvousError, match=rf"^rank 1 \(node 0, 127.0.0.1\) never opened .*127.0.0.1:{dead}"):
        join_gloo(lay, 0, store, 1.0)
    assert time.monotonic() - t0 < 10


def test_rank_count_mismatch_is_refused_before_any_rank_starts(exports):
    full, sharded = exports
    before = set(process_tree(os.getpid()))
    with pytest.raises(ValueError, match=r"^MP_NUM=2 but .* holds 1 rank graph\(s\) \(rank_0\)$"):
        serve(full, 2)
    with pytest.raises(ValueError, match=r"MP_NUM=1 but .* holds 2 rank graph\(s\).*--mp 1"):
        serve(sharded, 1)
    with pytest.raises(ValueError, match=r"does not support QUANT_TYPE=weight_only_int8"):
        serve(sharded, 2, quant_type="weight_only_int8")
    assert set(process_tree(os.getpid())) == before


if __name__ == "__main__":  # test_a_dead_worker_ends_the_group's rank 0: model_dir
    llm = serve(sys.argv[1], 2)
    (worker,) = set(process_tree(os.getpid())) - {os.getpid()}
    llm.generate([SHARED], GREEDY)
    print("worker", worker, flush=True)
    while True:
        llm.generate([SHARED], GREEDY)
