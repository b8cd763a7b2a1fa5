#!/usr/bin/env python3
"""Admitting a burst of text prompts: one prompt after another (as before) against `native.tokenize_burst`
(one `encode_batch` for the burst), with the demo model's tokenizer, on this machine's cores.

Prompts: --n windows of --chars characters of Python stdlib source (argparse.py, typing.py, ...).
Prints the median of --reps of each and checks that both give the same ids.

Usage: PYTHONPATH=server python scripts/lab/bench_tokenize_burst.py [--n 256] [--chars 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
import time
from pathlib import Path

from llmserve.engine.tokenizer import load_tokenizer
from llmserve.models.demo import DEMO_HF_DIR
from llmserve.protocol import native


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--chars", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    tok = load_tokenizer(str(DEMO_HF_DIR))
    lib = Path(sysconfig.get_paths()["stdlib"])
    src = "".join((lib / f).read_text() for f in ("argparse.py", "typing.py", "inspect.py", "pathlib.py"))
    src *= -(-a.n * a.chars // len(src))  # long enough for every window
    bodies = [{"text": src[i * a.chars : (i + 1) * a.chars]} for i in range(a.n)]
    serial, burst = [], []
    for _ in range(a.reps):
        t = time.perf_counter()
        one = [native.prompt_token_ids(native.parse(b), tok) for b in bodies]
        serial.append(time.perf_counter() - t)
        t = time.perf_counter()
        got = native.tokenize_burst([native.parse(b) for b in bodies], tok)
        burst.append(time.perf_counter() - t)
        assert [g[1] for g in got] == one
    tokens = sum(map(len, one))
    res = dict(cores=len(os.sched_getaffinity(0)), prompts=a.n, mean_tokens=tokens / a.n,
               one_by_one_ms=statistics.median(serial) * 1e3, burst_ms=statistics.median(burst) * 1e3)  # fmt: skip
    res["speedup"] = res["one_by_one_ms"] / res["burst_ms"]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
