"""A long prompt beside running streams, on the real stack with a short CHECK_HEALTH_INTERVAL.

Before the engine was split into a server and a core, one 2048-token prefill step on this 2-core
machine outlasted the interval: the adapter declared the engine hung and every request failed with
500 "the engine is not responding". Now heartbeats do not wait on steps, prompts are chunked by
default (LONG_PREFILL_TOKENS), and the streams keep receiving tokens while the prompt is prefilled.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest

from llmserve.serving.testing import ServingStack

tritonclient = pytest.importorskip("tritonclient.grpc")
from llmserve.triton.client import TritonStream  # noqa: E402

INTERVAL = 2.5  # CHECK_HEALTH_INTERVAL: a 2048-token chunk takes longer than this here
PROMPT_TOKENS = 3500
CHUNK = 256  # the Paddle runner's default LONG_PREFILL_TOKENS on a CPU: the prompt takes 14 steps
STREAMS, STREAM_TOKENS = 4, 300


@pytest.mark.slow
def test_long_prompt_beside_running_streams(tmp_path, demo_dir):
    vocab = json.loads((Path(demo_dir) / "config.json").read_text())["vocab_size"]
    env = {"CHECK_HEALTH_INTERVAL": INTERVAL, "BLOCK_BS": 8, "MAX_SEQ_LEN": 4096, "MAX_DEC_LEN": 1024}
    with ServingStack(tmp_path, **env) as stack:
        client = TritonStream(stack.grpc_url)
        not_ready: list[tuple[int, str]] = []
        done = threading.Event()

        def probe() -> None:
            while not done.wait(0.2):
                status, body = stack.ready()
                if status != 200:
                    not_ready.append((status, body))

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        try:
            body = {"text": "the long prompt waits", "max_dec_len": STREAM_TOKENS, "min_dec_len": STREAM_TOKENS}
            streams = [client.submit(body | {"top_k": 1, "req_id": f"s{i}"}) for i in range(STREAMS)]
            arrivals: list[list[float]] = [[] for _ in streams]
            msgs: list[list[dict]] = [[] for _ in streams]

            def read(q, a: list, m: list) -> None:  # stamps each message as it arrives
                while not m or not m[-1].get("is_end"):
                    m.append(q.get(timeout=300))
                    a.append(time.monotonic())

            readers = [threading.Thread(target=read, args=x, daemon=True) for x in zip(streams, arrivals, msgs)]
            for r in readers:
                r.start()
            deadline = time.monotonic() + 60
            while not all(msgs) and time.monotonic() < deadline:  # all streaming before the long prompt
                time.sleep(0.05)
            rng = random.Random()
            ids = [rng.randrange(vocab) for _ in range(PROMPT_TOKENS)]
            submitted = time.monotonic()
            long_q = client.submit({"input_ids": ids, "max_dec_len": 4, "req_id": "long"})
            long_msgs = [long_q.get(timeout=300)]
            first = time.monotonic()  # its first token: the prompt is in the cache
            while not long_msgs[-1].get("is_end"):
                long_msgs.append(long_q.get(timeout=300))
            for r in readers:
                r.join(300)
        finally:
            done.set()
            prober.join()
            client.close()
        assert long_msgs[-1]["error_code"] == 0, long_msgs[-1]
        for m in msgs:
            assert m[-1]["error_code"] == 0, m[-1]
            assert sum(len(x["token_ids"]) for x in m) == STREAM_TOKENS
        assert not not_ready, not_ready[:3]
        # While the prompt was prefilled (its submission to its first token), each stream kept decoding: a token a
        # step, with a chunk of the prompt in each of 14 steps. One prefill step (unchunked) would give them ~1-2.
        # Counted in tokens, not seconds: how long a step takes is the machine's business.
        during = [
            sum(len(x["token_ids"]) for x, t in zip(m, arr) if submitted < t <= first) for m, arr in zip(msgs, arrivals)
        ]
        assert min(during) >= PROMPT_TOKENS // CHUNK // 2, during
