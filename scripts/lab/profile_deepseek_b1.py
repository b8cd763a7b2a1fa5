#!/usr/bin/env python3
"""Where a DeepSeek-V2-Lite batch-1 decode step's GPU time goes: torch.profiler over eager decode steps (the
kernels a CUDA graph replays are the same), the kernels by total CUDA time, per step (GPU).

The checkpoint is bench_deepseek.py's (random bf16, /dev/shm); the runner runs without graphs so that each
kernel is seen. Usage: PYTHONPATH=server python scripts/lab/profile_deepseek_b1.py [--steps 20] [--top 25]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_deepseek import checkpoint  # noqa: E402

from llmserve.config import Config  # noqa: E402
from llmserve.engine.llm_engine import LLMEngine  # noqa: E402
from llmserve.engine.sampling_params import SamplingParams  # noqa: E402
from llmserve.runners.torch.runner import TorchRunner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    model_dir = checkpoint("v2-lite", "", "cuda", 0)
    cfg = Config(device="cuda", batch_size=8, max_seq_len=1024, block_size=64, cuda_graphs=False,
                 enable_prefix_caching=False)  # fmt: skip
    engine = LLMEngine(cfg, TorchRunner(model_dir, cfg))
    greedy = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    engine.add_request("r", list(range(1, 129)), greedy)
    for _ in range(10):  # prefill, then warm decode steps
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events)
    print(f"GPU time a step: {total / a.steps / 1e3:.3f} ms over {a.steps} steps")
    print(f"{'us/step':>9} {'share':>6} {'calls/step':>10}  kernel")
    for e in events[: a.top]:
        t = e.self_device_time_total / a.steps
        print(f"{t:9.1f} {t * a.steps / total:6.1%} {e.count / a.steps:10.1f}  {e.key[:110]}")


if __name__ == "__main__":
    main()
