#!/usr/bin/env python3
"""GPU benchmark of the torch runner (issue 5): one run, one table, one JSON.

Builds (or reuses) a random-weight Llama-3-8B-shaped bf16 checkpoint, then measures:
  - device-to-device copy bandwidth, and the decode floor = weight bytes / bandwidth;
  - single-stream decode ms/step (prompt 128, 256 new tokens) through LLMEngine + TorchRunner;
  - time to first token of one 1024-token prompt;
  - offline throughput: 256 seeded requests, prompt len U[128, 1024], output len U[64, 512], all at once;
    checks that every request got exactly its output length;
  - host overhead per step (step wall time minus the GPU time of the step) at batch >= 200;
  - HF transformers baselines on the same weights: static-cache compiled generate (batch 1) and
    generate_batch (continuous batching) on a subset of the same requests.
Ours runs first and the JSON is rewritten after every section, so a time limit loses only the tail.

Usage: PYTHONPATH=server python scripts/bench_gpu.py --out bench.json [--shape llama3-8b] [--skip-hf]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from llmserve.config import Config
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.request import Request
from llmserve.engine.runner_contract import SeqChunk, StepBatch
from llmserve.engine.sampling_params import SamplingParams
from llmserve.models.random_model import write_random_checkpoint
from llmserve.runners.torch.runner import TorchRunner

R: dict = {}


def save(out: str) -> None:
    Path(out).write_text(json.dumps(R, indent=1))


def copy_bandwidth(gib: float = 4.0) -> float:
    """Bytes read + written per second by a device-to-device copy (median of 20)."""
    n = int(gib * (1 << 30)) // 2
    a = torch.randn(n // 2, device="cuda", dtype=torch.float32).view(torch.bfloat16)
    b = torch.empty_like(a)
    times = []
    for _ in range(23):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n * 2 / statistics.median(times[3:])


def run_engine(engine: LLMEngine, reqs: list[tuple[str, list[int], SamplingParams]], trace: list | None = None):
    """Submit all, step until done; returns {req_id: tokens}, first-token times, wall time."""
    got: dict[str, list[int]] = {}
    first: dict[str, float] = {}
    t0 = time.perf_counter()
    for rid, ids, p in reqs:
        engine.add_request(rid, ids, p)
        got[rid] = []
    while engine.has_unfinished():
        ts = time.perf_counter()
        outs = engine.step()
        te = time.perf_counter()
        if trace is not None:
            trace.append((ts, te, len(outs)))
        for o in outs:
            if o.new_token_ids and o.req_id not in first:
                first[o.req_id] = te - t0
            got[o.req_id] += o.new_token_ids
    return got, first, time.perf_counter() - t0


class StepTimer:
    """Wraps runner.submit/result to record (batch size, tokens, model_time, wait for the result) per step.

    With overlapped steps the host waits for a step's result while the next one is already queued,
    so the wait, not the launch, is what the host spends on the device."""

    def __init__(self, runner: TorchRunner) -> None:
        self.submit, self.result = runner.submit, runner.result
        self.steps: list[tuple[int, int, float, float]] = []
        self.shapes: list[tuple[int, int]] = []
        runner.submit, runner.result = self._submit, self._result

    def _submit(self, batch):
        self.shapes.append((len(batch.chunks), batch.num_tokens))
        return self.submit(batch)

    def _result(self, handle):
        t = time.perf_counter()
        res = self.result(handle)
        b, n = self.shapes.pop(0)
        self.steps.append((b, n, res.model_time, time.perf_counter() - t))
        return res


def matmul_tflops(n: int = 8192) -> float:
    """bf16 matrix product rate on random data (median of 10 after 3 warm-ups), FLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n**3 / statistics.median(times[3:])


def roofline(mc, prompt_lens: list[int], output_lens: list[int], bw: float, peak: float) -> dict:
    """The fastest the offline workload could run on this GPU, all requests at once:

    T = sum_i F_prefill(p_i) / peak
      + sum_k max((W + kv * sum_{i: o_i > k} (p_i + k)) / bw, (2 P b_k + 4 L H D sum_{i: o_i > k} (p_i + k)) / peak)
    with F_prefill(p) = 2 P p + 2 L H D p^2 (causal attention), P the parameters of the matrix products
    (lm_head included), W the weight bytes, kv the KV-cache bytes of one token, b_k the requests still
    decoding at decode step k (k = 1 .. max o - 1: each request's first token comes from its prefill).
    Returns the time and the output tokens/s it allows."""
    L, H, KVH, D = mc.num_hidden_layers, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    d, inter, V = mc.hidden_size, mc.intermediate_size, mc.vocab_size
    P = L * (d * (H + 2 * KVH) * D + H * D * d + 3 * d * inter) + d * V
    W = 2 * P  # bf16 bytes of the matrix products (the embedding table is read by rows only)
    kv = 2 * L * KVH * D * 2  # K and V, fp16
    p, o = np.asarray(prompt_lens, dtype=np.float64), np.asarray(output_lens)
    t_prefill = float(np.sum(2 * P * p + 2 * L * H * D * p**2)) / peak
    t_decode = 0.0
    for k in range(1, int(o.max())):
        ctx = (p + k)[o > k]
        if not ctx.size:
            break
        t_decode += max((W + kv * ctx.sum()) / bw, (2 * P * ctx.size + 4 * L * H * D * ctx.sum()) / peak)
    t = t_prefill + t_decode
    return dict(prefill_s=t_prefill, decode_s=t_decode, total_s=t, output_tok_s=float(o.sum()) / t)


def offline_requests(vocab: int, n_req: int = 256, seed: int = 1234):
    """The offline workload: (requests, prompt lengths, output lengths); prompts U[128, 1024], outputs
    U[64, 512], sampled at temperature 0.8 with per-request seeds, eos ignored."""
    rs = np.random.default_rng(seed)
    plen = rs.integers(128, 1025, n_req)
    olen = rs.integers(64, 513, n_req)
    reqs = [
        (
            f"q{i}",
            rs.integers(0, vocab, int(plen[i])).tolist(),
            SamplingParams(max_tokens=int(olen[i]), temperature=0.8, seed=i, ignore_eos=True),
        )
        for i in range(n_req)
    ]
    return reqs, plen, olen


def set_budget(engine: LLMEngine, tokens: int) -> None:
    """The step budget (MAX_PREFILL_TOKENS) the scheduler fills, up to what the runner was sized for."""
    engine.scheduler.max_num_batched_tokens = tokens
    engine.scheduler.long_prefill_tokens = tokens


def offline_figures(reqs, got, plen, wall, steps, st0, st, budget: int) -> dict:
    """The offline run's throughput, lost requests and where its GPU time went."""
    n_out = sum(len(got[f"{rid}-b{budget}"]) for rid, _, _ in reqs)
    fig = dict(budget=budget)
    fig["throughput_output_tokens"] = n_out
    fig["throughput_wall_s"] = wall
    fig["throughput_tok_s"] = n_out / wall
    fig["throughput_total_tok_s"] = (n_out + int(plen.sum())) / wall
    fig["throughput_requests_bad"] = [rid for rid, _, p in reqs if len(got[f"{rid}-b{budget}"]) != p.max_tokens]
    big = [s for s in steps if s[0] >= 200 and s[1] == s[0]]  # decode-only steps at batch >= 200
    if big:
        fig["batch256_decode_steps"] = len(big)
        fig["batch256_step_gpu_ms"] = statistics.median(s[2] for s in big) * 1e3
        fig["batch256_execute_wall_ms"] = statistics.median(s[3] for s in big) * 1e3
    n = max(1, st.steps - st0.steps)
    # engine-level host overhead: whole step wall time minus GPU time, over the steps of the run
    fig["host_overhead_ms_per_step"] = ((st.step_time - st0.step_time) - (st.model_time - st0.model_time)) / n * 1e3
    fig["steps"] = st.steps - st0.steps
    fig["step_trace"] = [(b, m, round(g * 1e3, 3), round(w * 1e3, 3)) for b, m, g, w in steps]
    mixed = [x for x in steps if x[1] != x[0]]
    fig["mixed_steps"] = dict(
        n=len(mixed), gpu_s=sum(x[2] for x in mixed), max_ms=max((x[2] for x in mixed), default=0) * 1e3
    )
    fig["decode_steps"] = dict(n=len(steps) - len(mixed), gpu_s=sum(x[2] for x in steps if x[1] == x[0]))
    fig["gpu_busy_s"] = sum(x[2] for x in steps)
    fig["preemptions"] = st.preemptions - st0.preemptions
    return fig


def bench_ours(
    model_dir: str, weight_bytes_hint: int, bw: float, seed: int, out: str, n_req: int, budgets: list[int]
) -> None:
    # The runner is sized for the largest step budget; the scheduler runs each in turn (the first
    # for the single-stream and TTFT figures, which it does not change).
    cfg = Config(
        batch_size=256,
        max_seq_len=2048,
        block_size=64,
        max_num_batched_tokens=max(budgets),
        enable_prefix_caching=False,
    )
    t = time.perf_counter()
    runner = TorchRunner(model_dir, cfg)
    R["ours_load_s"] = time.perf_counter() - t
    R["weight_bytes"] = wb = runner.model.weight_bytes
    R["decode_floor_ms"] = wb / bw * 1e3
    R["kv_blocks"] = runner.num_kv_blocks
    R["kv_cache_gb"] = runner.num_kv_blocks * runner.kv_spec.block_bytes / 1e9
    timer = StepTimer(runner)
    engine = LLMEngine(cfg, runner)
    set_budget(engine, budgets[0])
    rng = np.random.default_rng(seed)
    V = runner.vocab_size
    greedy = dict(temperature=0.0, ignore_eos=True)

    # warm-up (all graph buckets were captured at start; this compiles the prefill path)
    run_engine(engine, [("w", rng.integers(0, V, 300).tolist(), SamplingParams(max_tokens=8, **greedy))])
    run_engine(
        engine,
        [(f"w{i}", rng.integers(0, V, 900).tolist(), SamplingParams(max_tokens=6, temperature=1.0)) for i in range(6)],
    )  # mixed steps and sampling

    # single stream: prompt 128, 256 new tokens
    timer.steps.clear()
    trace: list = []
    s0 = engine.stats()
    got, first, wall = run_engine(
        engine, [("s", rng.integers(0, V, 128).tolist(), SamplingParams(max_tokens=256, **greedy))], trace
    )
    s1 = engine.stats()
    dec = trace[1:]  # steps after the prefill step
    R["single_stream_ms_per_step"] = (dec[-1][1] - dec[0][0]) / len(dec) * 1e3
    R["single_stream_gpu_ms_per_step"] = statistics.median(s[2] for s in timer.steps[1:]) * 1e3
    R["single_stream_vs_floor"] = R["single_stream_ms_per_step"] / R["decode_floor_ms"]
    # where the host's share of a step goes (ms per step, prefill step included)
    n = s1.steps - s0.steps
    per = lambda k: (getattr(s1, k) - getattr(s0, k)) / n * 1e3  # noqa: E731
    R["single_stream_host_ms"] = dict(
        schedule=per("schedule_time"),
        execute_minus_model=per("execute_time") - per("model_time"),
        output=per("output_time"),
        outside_engine_step=R["single_stream_ms_per_step"] - per("step_time"),
    )
    save(out)

    # TTFT: fresh 1024-token prompts (no prefix cache), median of 5
    ttfts = []
    for i in range(5):
        _, first, _ = run_engine(
            engine, [(f"t{i}", rng.integers(0, V, 1024).tolist(), SamplingParams(max_tokens=1, **greedy))]
        )
        ttfts.append(first[f"t{i}"])
    R["ttft_1024_ms"] = statistics.median(ttfts) * 1e3
    save(out)

    # offline throughput, once per step budget; the first budget's figures are the top-level ones
    reqs, plen, olen = offline_requests(V, n_req)
    R["throughput_requests"] = [(r[0], len(r[1]), r[2].max_tokens) for r in reqs]
    R["roofline"] = roofline(runner.model_config, plen.tolist(), olen.tolist(), bw, R["matmul_tflops"] * 1e12)
    R["offline_by_budget"] = {}
    for b in reversed(budgets):  # the first budget last: its step trace is the one profiled and kept
        set_budget(engine, b)
        st0 = engine.stats()
        timer.steps.clear()
        fresh = [(f"{rid}-b{b}", ids, dataclasses.replace(p)) for rid, ids, p in reqs]
        got, first, wall = run_engine(engine, fresh)
        st = engine.stats()
        R["offline_by_budget"][str(b)] = fig = offline_figures(reqs, got, plen, wall, timer.steps, st0, st, b)
        save(out)
    set_budget(engine, budgets[0])
    R.update({k: v for k, v in fig.items() if k != "budget"})
    R["throughput_vs_roofline"] = R["throughput_tok_s"] / R["roofline"]["output_tok_s"]
    for f in R["offline_by_budget"].values():
        f["vs_roofline"] = f["throughput_tok_s"] / R["roofline"]["output_tok_s"]
    R["engine_stats"] = {k: getattr(st, k) for k in vars(st)}
    save(out)
    try:
        profile_steps(runner, out)
    except Exception as e:  # noqa: BLE001 - report and go on
        R["profile_error"] = repr(e)[:500]
    save(out)
    del R["throughput_requests"]
    runner.shutdown()
    del engine, runner, timer
    gc.collect()
    torch.cuda.empty_cache()


def synthetic(runner: TorchRunner, ctxs: list[int], q_lens: list[int]) -> StepBatch:
    """A step over fake requests with contexts `ctxs` and chunks of `q_lens` (blocks laid out in order)."""
    bs, nxt, chunks = runner.block_size, 0, []
    for i, (c, q) in enumerate(zip(ctxs, q_lens)):
        r = Request(f"x{i}", [1] * (c + q), SamplingParams(max_tokens=4, temperature=0.0))
        n = -(-(c + q) // bs)
        r.block_table = list(range(nxt, nxt + n))
        nxt += n
        chunks.append(SeqChunk(r, c, q, True))
    assert nxt <= runner.num_kv_blocks
    return StepBatch(chunks)


def gpu_ms(fn, reps: int = 10) -> float:
    fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


@torch.inference_mode()
def profile_steps(runner: TorchRunner, out: str) -> None:
    """Step times (graph vs eager) and the kernel split of decode at batch 1 and 256 and a mixed step."""
    from torch.profiler import ProfilerActivity, profile

    from llmserve.runners.torch.inputs import host_arrays

    rng = np.random.default_rng(0)
    cases = {
        "decode_b1_ctx256": synthetic(runner, [256], [1]),
        "decode_b256_ctx700": synthetic(runner, rng.integers(400, 1000, 256).tolist(), [1] * 256),
        "mixed_200dec_1848pf": synthetic(runner, rng.integers(400, 1000, 200).tolist() + [0], [1] * 200 + [1848]),
    }
    prof: dict = {}
    m = runner.model
    for name, batch in cases.items():
        a = host_arrays(batch.chunks, runner.block_size)
        x = runner.prepare(batch, a)

        def eager(x=x):
            return m.logits(m.forward(x.input_ids, x.positions, x.slot_mapping, x.meta, runner.kv_cache))

        d = {"eager_ms": gpu_ms(eager)}
        if runner.graphs is not None and a["ids"].shape[0] == len(batch.chunks):
            d["graph_ms"] = gpu_ms(lambda a=a: runner.graphs.replay(a))
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            eager()
            torch.cuda.synchronize()
        ev = sorted(p.key_averages(), key=lambda e: -e.device_time_total)[:12]
        d["kernels"] = [(e.key[:80], e.count, round(e.device_time_total / 1e3, 3)) for e in ev]
        prof[name] = d
        print(name, {k: v for k, v in d.items() if k != "kernels"}, flush=True)
        for k in d["kernels"]:
            print("   ", k)
    # attention alone at batch 256, context 1024: bytes of K and V read once
    kv = runner.kv_cache
    batch = synthetic(runner, [1024] * 256, [1] * 256)
    x = runner.prepare(batch, host_arrays(batch.chunks, runner.block_size))
    from llmserve.kernels.attention import paged_attention

    mc = runner.model_config
    q = torch.randn(256, mc.num_attention_heads, mc.head_dim, device="cuda", dtype=runner.dtype)
    k, v, k_scale, v_scale = kv.layer(0)
    ms = gpu_ms(lambda: paged_attention(q, k, v, x.meta, 0.1, runner.dtype, k_scale, v_scale), reps=20)
    nbytes = 2 * 256 * 1025 * mc.num_key_value_heads * mc.head_dim * 2
    prof["attn_decode_b256_ctx1024"] = {"ms": ms, "tb_s": nbytes / ms / 1e9}
    print("attention b256 ctx1024:", prof["attn_decode_b256_ctx1024"], flush=True)
    R["profile"] = prof


def bench_hf(model_dir: str, seed: int, out: str, n_req: int, subset: int, full_budget_s: float) -> None:
    import transformers
    from transformers import GenerationConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    V = model.config.vocab_size
    rng = np.random.default_rng(seed)
    ids = torch.tensor([rng.integers(0, V, 128).tolist()], device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None, attention_mask=torch.ones_like(ids))
    # static cache + compiled step (transformers compiles the forward when the cache is static)
    try:
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=256, min_new_tokens=256, cache_implementation="static", **kw)
        R["hf_static_compile_s"] = time.perf_counter() - t
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            o = model.generate(ids, max_new_tokens=256, min_new_tokens=256, cache_implementation="static", **kw)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        R["hf_static_ms_per_step"] = min(times) / (o.shape[1] - 128) * 1e3
    except Exception as e:  # noqa: BLE001 - report and go on
        R["hf_static_error"] = repr(e)[:500]
    save(out)
    # continuous batching on a subset of the same requests
    try:
        rs = np.random.default_rng(1234)
        plen = rs.integers(128, 1025, n_req)
        olen = rs.integers(64, 513, n_req)
        all_prompts = [rs.integers(0, V, int(plen[i])).tolist() for i in range(n_req)]
        prompts = all_prompts[:subset]
        new = int(np.mean(olen))
        gc_ = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        model.generate_batch(inputs=prompts[:4], generation_config=gc_)  # warm-up
        t = time.perf_counter()
        res = model.generate_batch(inputs=prompts, generation_config=gc_)
        wall = time.perf_counter() - t
        n_out = sum(len(r.generated_tokens) for r in res.values())
        R["hf_generate_batch"] = dict(
            requests=len(prompts), max_new_tokens=new, output_tokens=n_out, wall_s=wall, tok_s=n_out / wall
        )
        save(out)
        est = n_req * new / (n_out / wall)
        if subset < n_req and est < full_budget_s:  # all requests, when the subset says they fit in time
            prompts = all_prompts
            t = time.perf_counter()
            res = model.generate_batch(inputs=prompts, generation_config=gc_)
            wall = time.perf_counter() - t
            n_out = sum(len(r.generated_tokens) for r in res.values())
            R["hf_generate_batch"] = dict(
                requests=len(prompts),
                max_new_tokens=new,
                output_tokens=n_out,
                wall_s=wall,
                tok_s=n_out / wall,
                subset_64=R["hf_generate_batch"],
            )
    except Exception as e:  # noqa: BLE001
        R["hf_generate_batch_error"] = repr(e)[:500]
    save(out)


def table() -> str:
    rows = [
        ("device", R.get("device")),
        ("copy bandwidth (TB/s)", R.get("copy_tb_s")),
        ("weights (GB)", R.get("weight_bytes", 0) / 1e9),
        ("decode floor (ms/step)", R.get("decode_floor_ms")),
        ("ours: single-stream decode (ms/step)", R.get("single_stream_ms_per_step")),
        ("ours: single-stream GPU time (ms/step)", R.get("single_stream_gpu_ms_per_step")),
        ("ours / floor", R.get("single_stream_vs_floor")),
        ("HF static+compiled generate (ms/step)", R.get("hf_static_ms_per_step")),
        ("ours: TTFT 1024-token prompt (ms)", R.get("ttft_1024_ms")),
        ("bf16 matmul (TFLOP/s)", R.get("matmul_tflops")),
        ("ours: offline throughput (output tok/s)", R.get("throughput_tok_s")),
        ("roofline of that workload (output tok/s)", (R.get("roofline") or {}).get("output_tok_s")),
        ("ours / roofline", R.get("throughput_vs_roofline")),
        (
            "ours: requests lost/truncated",
            len(R.get("throughput_requests_bad", [])) if "throughput_tok_s" in R else None,
        ),
        ("HF generate_batch (output tok/s)", (R.get("hf_generate_batch") or {}).get("tok_s")),
        (
            "ours / HF generate_batch",
            (R["throughput_tok_s"] / R["hf_generate_batch"]["tok_s"])
            if "hf_generate_batch" in R and "throughput_tok_s" in R
            else None,
        ),
        ("ours: batch>=200 decode step, GPU (ms)", R.get("batch256_step_gpu_ms")),
        ("ours: batch>=200 decode step, execute wall (ms)", R.get("batch256_execute_wall_ms")),
        ("ours: host overhead per engine step (ms)", R.get("host_overhead_ms_per_step")),
    ]
    for b, f in (R.get("offline_by_budget") or {}).items():
        rows.append(
            (
                f"ours: offline at a step budget of {b} (tok/s, / roofline)",
                f"{f['throughput_tok_s']:.0f}, {f.get('vs_roofline', 0):.3f}",
            )
        )
    w = max(len(r[0]) for r in rows)
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    return "\n".join(f"{k:<{w}}  {fmt(v)}" for k, v in rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_gpu.json")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--model-dir", default="")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--hf-subset", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-full-budget", type=float, default=150.0, help="run HF on all requests if it fits (s)")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--offline-budgets",
        default="2048",
        help="step budgets (MAX_PREFILL_TOKENS) to run the offline workload at, comma-separated; the first is the headline",
    )
    args = ap.parse_args()
    R["device"] = torch.cuda.get_device_name()
    R["torch"] = torch.__version__
    R["copy_tb_s"] = copy_bandwidth() / 1e12
    R["matmul_tflops"] = matmul_tflops() / 1e12
    root = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    model_dir = args.model_dir or f"{root}/llmserve-random-v3-{args.shape}"
    t = time.perf_counter()
    write_random_checkpoint(model_dir, args.shape)
    R["build_model_s"] = time.perf_counter() - t
    bw = R["copy_tb_s"] * 1e12
    save(args.out)
    if not args.skip_ours:
        budgets = [int(b) for b in args.offline_budgets.split(",")]
        bench_ours(model_dir, 0, bw, args.seed, args.out, args.requests, budgets)
        print(table(), flush=True)
    if not args.skip_hf:
        bench_hf(model_dir, args.seed, args.out, args.requests, args.hf_subset, args.hf_full_budget)
    save(args.out)
    print(table())


if __name__ == "__main__":
    main()
