#!/usr/bin/env python3
"""Quantization benchmark (issue 15): speed on the 8B shape, fidelity on a trained model.

  speed     (GPU) a random-weight Llama-3-8B-shaped bf16 checkpoint served as bf16 and quantized at
            load (QUANT_TYPE weight_only_int8 / weight_only_int4 / fp8), one runner at a time:
            batch-1 decode ms/step against its floor (the bytes one step reads: weights + the KV of
            the context, at the copy bandwidth measured in the same run), output tok/s at batch 64
            and 256 (prompt 256, 128 new tokens, greedy) against bf16. Then bf16 weights with each KV
            cache dtype: how many 8K-token sequences fit, and the batch-256 decode step at 1K context.
  fidelity  (CPU or GPU) a trained checkpoint (the demo model by default) unquantized (bf16 on a GPU,
            fp32 on a CPU), in each weight format and with each KV cache dtype: perplexity of 64 held-out stdlib windows of 512 tokens (teacher forcing, through
            prompt logprobs), and greedy agreement with the unquantized model over 256 new tokens for
            64 prompts of 64 tokens (tokens equal position by position, and the mean common prefix).

Usage: PYTHONPATH=server python scripts/bench_quant.py speed --out speed.json
       PYTHONPATH=server python scripts/bench_quant.py fidelity --out fid.json [--model DIR] [--device cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.quant_checkpoints (GPTQ writer)

from bench_gpu import copy_bandwidth, run_engine  # noqa: E402

from llmserve.config import Config, parse_kernel_switches  # noqa: E402
from llmserve.engine.llm_engine import LLMEngine  # noqa: E402
from llmserve.engine.sampling_params import SamplingParams  # noqa: E402
from llmserve.runners.torch.runner import TorchRunner  # noqa: E402

R: dict = {}
PROFILE = False  # speed --profile: the kernels of a batch-1 decode step
BATCHES = (64, 256)  # speed --batches
GREEDY = dict(temperature=0.0, ignore_eos=True)


def save(out: str) -> None:
    Path(out).write_text(json.dumps(R, indent=1))


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def decode_rows(engine: LLMEngine, runner: TorchRunner, bw: float, rng) -> dict:
    V = runner.vocab_size
    run_engine(engine, [("w", rng.integers(0, V, 300).tolist(), SamplingParams(max_tokens=8, **GREEDY))])
    trace: list = []
    run_engine(engine, [("s", rng.integers(0, V, 128).tolist(), SamplingParams(max_tokens=256, **GREEDY))], trace)
    dec = trace[1:]
    ms = (dec[-1][1] - dec[0][0]) / len(dec) * 1e3
    kv_bytes = runner.kv_spec.block_bytes / runner.block_size * (128 + 128)  # the mean context's K/V
    floor = (runner.model.weight_bytes + kv_bytes) / bw * 1e3
    row = dict(b1_ms_per_step=ms, b1_floor_ms=floor, b1_vs_floor=ms / floor)
    if PROFILE:
        from bench_tp import profile_b1

        row["b1_kernels_us_per_step"] = profile_b1(engine, rng, V)
    for b in BATCHES:
        reqs = [
            (f"b{b}-{i}", rng.integers(0, V, 256).tolist(), SamplingParams(max_tokens=128, **GREEDY)) for i in range(b)
        ]
        got, _, wall = run_engine(engine, reqs)
        row[f"b{b}_tok_s"] = sum(len(v) for v in got.values()) / wall
    return row


def speed(out: str, shape: str, formats: list[str], kv: bool = True) -> None:
    from llmserve.models.random_model import write_random_checkpoint

    R["device"] = torch.cuda.get_device_name()
    R["torch"] = torch.__version__
    R["kernel_switches"] = Config.read("kernel_switches")  # LLMSERVE_KERNEL_SWITCHES (scripts/lab/device_gemv.sh)
    R["gemv"] = parse_kernel_switches(R["kernel_switches"]).get("gemv", True)
    ckpt = write_random_checkpoint(Path(tempfile.gettempdir()) / f"rand-{shape}", shape)
    R["copy_bandwidth_gbs"] = (bw := copy_bandwidth()) / 1e9
    base = Config(batch_size=256, max_seq_len=2048, block_size=64, max_num_batched_tokens=2048)
    base = dataclasses.replace(base, enable_prefix_caching=False, kernel_switches=R["kernel_switches"])
    R["weights"] = rows = {}
    for quant in formats:
        t = time.perf_counter()
        try:
            runner = TorchRunner(str(ckpt), dataclasses.replace(base, quant_type=quant))
        except Exception as e:  # a format this device cannot run: say so in the table
            rows[quant or "bf16"] = {"error": f"{type(e).__name__}: {e}"}
            continue
        row = dict(load_s=time.perf_counter() - t, weight_gb=runner.model.weight_bytes / 1e9)
        row |= decode_rows(
            LLMEngine(dataclasses.replace(base, quant_type=quant), runner), runner, bw, np.random.default_rng(0)
        )
        rows[quant or "bf16"] = row
        for b in BATCHES:
            if "bf16" in rows:
                row[f"b{b}_vs_bf16"] = row[f"b{b}_tok_s"] / rows["bf16"][f"b{b}_tok_s"]
        print(quant or "bf16", json.dumps(row), flush=True)
        save(out)
        del runner
        free()
    if not kv:
        return
    R["kv"] = kv_rows = {}
    for kv in ("auto", "int8", "fp8"):
        cfg = dataclasses.replace(base, max_seq_len=8192, kv_cache_dtype=kv)
        try:
            runner = TorchRunner(str(ckpt), cfg)
        except Exception as e:
            kv_rows[kv] = {"error": f"{type(e).__name__}: {e}"}
            continue
        row = dict(kv_blocks=runner.num_kv_blocks, seqs_8k=runner.num_kv_blocks * runner.block_size // 8192)
        engine = LLMEngine(cfg, runner)
        rng = np.random.default_rng(1)
        V = runner.vocab_size
        reqs = [
            (f"k{i}", rng.integers(0, V, 1024).tolist(), SamplingParams(max_tokens=48, **GREEDY)) for i in range(256)
        ]
        trace: list = []
        run_engine(engine, reqs, trace)
        row["b256_ctx1k_step_ms"] = statistics.median(t[1] - t[0] for t in trace[-24:]) * 1e3
        kv_rows[kv] = row
        print("kv", kv, json.dumps(row), flush=True)
        save(out)
        del runner, engine
        free()


def fidelity(out: str, model: str, device: str, corpus: str) -> None:
    from bench_spec import heldout_prompts

    from llmserve.engine.tokenizer import load_tokenizer
    from llmserve.offline import LLM
    from tests.quant_checkpoints import write_gptq

    R["model"], R["device"] = model, device
    R["torch"] = torch.__version__
    tok = load_tokenizer(model)
    windows = heldout_prompts(tok, 64, 512, corpus, seed=1)
    prompts = [w[:64] for w in heldout_prompts(tok, 64, 64, corpus, seed=2)]
    gptq_dir = Path(tempfile.mkdtemp()) / "gptq"
    write_gptq(Path(model), gptq_dir, desc_act=True)
    variants = {
        "unquantized": (model, {}), "int8": (model, dict(quant_type="weight_only_int8")),
        "int4": (model, dict(quant_type="weight_only_int4")), "gptq_int4": (str(gptq_dir), {}),
        "fp8": (model, dict(quant_type="fp8")), "kv_int8": (model, dict(kv_cache_dtype="int8")),
        "kv_fp8": (model, dict(kv_cache_dtype="fp8")),
    }  # fmt: skip
    R["rows"] = rows = {}
    ref_tokens = None
    for name, (d, kw) in variants.items():
        cfg = Config.from_env(env={}, device=device, max_seq_len=1024, batch_size=64, **kw)
        try:
            llm = LLM(d, cfg)
        except Exception as e:
            rows[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        res = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
        nll = [-lp.logprob for r in res for lp in r.prompt_logprobs[1:]]
        gen = [r.token_ids for r in llm.generate(prompts, SamplingParams(max_tokens=256, **GREEDY))]
        llm.shutdown()
        row = dict(perplexity=math.exp(statistics.fmean(nll)))
        if ref_tokens is None:
            ref_tokens = gen
        same = [sum(a == b for a, b in zip(g, r)) / len(r) for g, r in zip(gen, ref_tokens)]
        prefix = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(r)) for g, r in zip(gen, ref_tokens)]
        row |= dict(greedy_same_position=statistics.fmean(same), greedy_common_prefix=statistics.fmean(prefix))
        row["perplexity_vs_unquantized"] = row["perplexity"] / rows["unquantized"]["perplexity"] if rows else 1.0
        rows[name] = row
        print(name, json.dumps(row), flush=True)
        save(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["speed", "fidelity"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--model", default="")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--corpus", default="")
    ap.add_argument(
        "--formats", default=",weight_only_int8,weight_only_int4,fp8", help="speed: QUANT_TYPEs (empty: bf16)"
    )
    ap.add_argument("--skip-kv", action="store_true", help="speed: no KV-cache rows")
    ap.add_argument("--profile", action="store_true", help="speed: the kernels of a batch-1 decode step")
    ap.add_argument("--batches", default="64,256", help="speed: the batch sizes of the tok/s rows")
    a = ap.parse_args()
    global PROFILE, BATCHES
    PROFILE, BATCHES = a.profile, tuple(int(b) for b in a.batches.split(",") if b)
    if a.what == "speed":
        speed(a.out, a.shape, a.formats.split(","), kv=not a.skip_kv)
    else:
        from llmserve.models.demo import DEMO_HF_DIR

        fidelity(a.out, a.model or str(DEMO_HF_DIR), a.device, a.corpus)


if __name__ == "__main__":
    main()
