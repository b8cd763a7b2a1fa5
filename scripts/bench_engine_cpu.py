"""CPU decode speed of the engine on the demo model, and where each step's time goes.

For batch sizes 1, 8 and 32: each request has a 32-token prompt and decodes
128 tokens greedily (ignoring eos). Prints decode tokens/s (pure-decode steps
only), mean step time, and the per-step time outside the model run, split into
scheduling, input preparation, sampling and output processing (stop checks,
detokenizing). Writes the table as JSON too.

    python scripts/bench_engine_cpu.py [--batches 1,8,32] [--new-tokens 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

from llmserve.config import Config
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.sampling_params import SamplingParams
from llmserve.runners.model_dir import ensure_demo_model
from llmserve.serving.compose import load_model


def bench(batch: int, new_tokens: int, prompt_len: int) -> dict:
    config = Config.from_env(
        env={}, model_dir=str(ensure_demo_model()), batch_size=batch, max_seq_len=1024, block_bs=batch
    )
    runner, tokenizer = load_model(config)
    engine = LLMEngine(config, runner, tokenizer)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    # Warm up once (first runs allocate), then measure from a clean engine state.
    engine.add_request(
        "warm",
        [rng.randrange(runner.vocab_size) for _ in range(prompt_len)],
        SamplingParams(max_tokens=4, temperature=0),
    )
    while engine.has_unfinished():
        engine.step()
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(runner.vocab_size) for _ in range(prompt_len)], params)
    # All prompts fit one step's token budget: the first step is the prefill, the rest decode.
    assert batch * prompt_len <= config.max_num_batched_tokens
    engine.step()
    before = engine.stats()
    decode_tokens = 0
    t = time.perf_counter()
    while engine.has_unfinished():
        decode_tokens += sum(len(o.new_token_ids) for o in engine.step())
    decode_time = time.perf_counter() - t
    after = engine.stats()
    steps = after.steps - before.steps

    def per_step(name: str) -> float:
        return (getattr(after, name) - getattr(before, name)) / steps * 1e3

    prep = per_step("execute_time") - per_step("model_time") - per_step("sample_time")
    row = {
        "batch": batch,
        "decode_tok_s": decode_tokens / decode_time,
        "step_ms": per_step("step_time"),
        "model_ms": per_step("model_time"),
        "host_ms": per_step("step_time") - per_step("model_time"),
        "schedule_ms": per_step("schedule_time"),
        "prepare_ms": prep,
        "sample_ms": per_step("sample_time"),
        "output_ms": per_step("output_time"),
        "steps": steps,
    }
    engine.shutdown()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    rows = [bench(int(b), args.new_tokens, args.prompt_len) for b in args.batches.split(",")]
    cols = [
        "batch",
        "decode_tok_s",
        "step_ms",
        "model_ms",
        "host_ms",
        "schedule_ms",
        "prepare_ms",
        "sample_ms",
        "output_ms",
    ]
    print(f"demo model, CPU: {platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores")
    print("  ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>12.2f}" if isinstance(r[c], float) else f"{r[c]:>12}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.node(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
