#!/usr/bin/env python3
"""Tensor parallelism on several GPUs (issue 17): correctness, decode against the floor, all-reduce cost.

One run, one JSON (rewritten after every section, so a time limit loses only the tail):
  - check: a tiny random bf16 Llama (8 heads, 2 KV heads), 16 prompts x 64 greedy tokens with CUDA
    graphs, at MP_NUM = 1 and each N of --mp: the tokens must be equal, else the first divergence and
    the logit margin there (MP_NUM=1's top-1 minus top-2 logprob: a near-tie when small);
  - decode: the --model checkpoint (a random one of --shape is written when absent) at each MP_NUM:
    batch-1 decode ms/step (prompt 128, 256 new tokens) and batch-64 (64 x 128 new tokens), against the
    floor = MP_NUM=1's weight bytes / (N x copy bandwidth of GPU 0); where one GPU cannot hold the model
    (70B), MP_NUM=1 is not run and its weight bytes are taken as N x rank 0's (rank 0 reads 1/N of
    every matrix: the shards are equal, the replicated norms negligible);
  - offline (with --offline, in the same engine): the 256-request workload of bench_gpu.py, output tok/s
    against the roofline of N GPUs (bench_gpu.roofline at N x the copy bandwidth and N x the matmul rate:
    perfect scaling, collectives free);
  - allreduce: the collectives of one decode step alone (the embedding's all-reduce, two per layer, the LM
    head's all-gather) at batch 1 and 64, in a CUDA graph over N processes: their time per step.

Usage: PYTHONPATH=server python scripts/bench_tp.py --mp 2 --out tp.json [--model DIR] [--skip check,...]
[--separate-norm] (each rank's sums and the RMSNorm after them in separate kernels: the fused kernel's
baseline; run it as its own process, which can give symmetric memory to one group only)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from bench_gpu import copy_bandwidth, matmul_tflops, offline_requests, roofline, run_engine  # as on one GPU

from llmserve.config import Config
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.sampling_params import SamplingParams
from llmserve.kernels import switches
from llmserve.layers.model_config import ModelConfig
from llmserve.models.random_model import SHAPES, write_random_checkpoint

R: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "gpus": 0}
OUT = "tp.json"
PORT = 29517
ENGINE_KW: dict = {}  # settings of every engine (kernel_switches: --separate-norm, --no-push)
PROFILE = False  # --profile


def save() -> None:
    Path(OUT).write_text(json.dumps(R, indent=1))


def engine_for(model_dir: str, mp: int, **kw) -> LLMEngine:
    from llmserve.executor.executor import start_executor
    from llmserve.runners.torch.runner import TorchRunner

    global PORT
    PORT += 1
    cfg = dataclasses.replace(
        Config(), model_dir=model_dir, runner="torch", mp_num=mp, dist_port=PORT, enable_prefix_caching=False,
        **ENGINE_KW, **kw,
    )  # fmt: skip
    runner = start_executor(model_dir, cfg) if mp > 1 else TorchRunner(model_dir, cfg)
    return LLMEngine(cfg, runner)


def close(engine: LLMEngine) -> None:
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(engine: LLMEngine, reqs: list[tuple[list[int], SamplingParams]]):
    """Outputs (tokens, logprobs) per request and the (start, end, outputs) of every step."""
    toks: dict[str, list[int]] = {}
    lps: dict[str, list] = {}
    for i, (ids, p) in enumerate(reqs):
        engine.add_request(f"r{i}", ids, p)
        toks[f"r{i}"], lps[f"r{i}"] = [], []
    trace = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        trace.append((t0, time.perf_counter(), len(outs)))
        for o in outs:
            toks[o.req_id] += o.new_token_ids
            lps[o.req_id] += o.logprobs or []
    n = len(reqs)
    return [toks[f"r{i}"] for i in range(n)], [lps[f"r{i}"] for i in range(n)], trace


# ---- check --------------------------------------------------------------------------------------
def check(mps: list[int], work: Path) -> None:
    d = work / "tiny-bf16"
    SHAPES.setdefault("tp-tiny", dict(SHAPES["tiny"], vocab_size=2048, hidden_size=256, intermediate_size=512))
    cuda = torch.cuda.is_available()
    write_random_checkpoint(d, "tp-tiny", seed=7, device="cuda" if cuda else "cpu", max_positions=1024)
    rng = np.random.default_rng(0)
    V = SHAPES["tp-tiny"]["vocab_size"]
    p = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=2)
    reqs = [(rng.integers(0, V, int(rng.integers(8, 200))).tolist(), p) for _ in range(16)]
    eng = engine_for(str(d), 1)
    want, want_lps, _ = run(eng, reqs)
    close(eng)
    R["check"] = {}
    for mp in mps:
        eng = engine_for(str(d), mp)
        got, _, _ = run(eng, reqs)
        close(eng)
        diverged = []
        for i, (a, b) in enumerate(zip(want, got)):
            j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if j is not None:
                top = want_lps[i][j].top
                diverged.append(dict(prompt=i, position=j, margin=top[0][1] - top[1][1]))
        R["check"][str(mp)] = dict(prompts=16, tokens=64, equal=16 - len(diverged), diverged=diverged)
        print(f"check MP_NUM={mp}: {16 - len(diverged)}/16 prompts equal over 64 tokens; {diverged}", flush=True)
        save()


# ---- decode -------------------------------------------------------------------------------------
def fits_one_gpu(model_dir: str) -> bool:
    size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    return size < 0.8 * torch.cuda.get_device_properties(0).total_memory


def offline(eng: LLMEngine, mp: int, bw: float, model_dir: str) -> dict:
    """bench_gpu's offline workload on this engine; the roofline of mp GPUs (of the whole model: a
    rank's own model_config has its shard's sizes)."""
    reqs, plen, olen = offline_requests(eng.runner.vocab_size)
    got, _, wall = run_engine(eng, reqs)
    n_out = sum(len(v) for v in got.values())
    mc = ModelConfig.from_file(f"{model_dir}/config.json")
    roof = roofline(mc, plen.tolist(), olen.tolist(), mp * bw, mp * R["matmul_tflops"] * 1e12)
    bad = [rid for rid, _, p in reqs if len(got[rid]) != p.max_tokens]
    return dict(output_tokens=n_out, wall_s=wall, tok_s=n_out / wall, roofline=roof,
                vs_roofline=n_out / wall / roof["output_tok_s"], requests_bad=bad)  # fmt: skip


def profile_b1(eng: LLMEngine, rng, V: int, steps: int = 64) -> list:
    """Rank 0's GPU kernels over `steps` batch-1 decode steps (CUDA-graph replays): the 15 that take
    the most time, as (name, calls a step, us a step)."""
    from torch.profiler import ProfilerActivity, profile

    p = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    eng.add_request("profiled", rng.integers(0, V, 128).tolist(), p)
    eng.step()  # the prefill, outside the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while eng.has_unfinished():
            eng.step()
        torch.cuda.synchronize()
    ev = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:15]
    return [(e.key[:70], round(e.count / steps, 2), round(e.device_time_total / steps, 1)) for e in ev]


def decode(model_dir: str, mps: list[int], bw: float, with_offline: bool) -> None:
    """MP_NUM > 1 first: this process, rank 0 of each group, can give symmetric memory to one group only."""
    R["decode"] = {}
    rng = np.random.default_rng(1)
    one = fits_one_gpu(model_dir)
    for mp in [*mps, 1] if one else mps:
        t = time.perf_counter()
        eng = engine_for(model_dir, mp, batch_size=256, max_seq_len=2048, max_num_batched_tokens=2048, block_size=64)
        load = time.perf_counter() - t
        runner = getattr(eng.runner, "runner", eng.runner)
        tp = runner.tp
        V = eng.runner.vocab_size
        greedy = dict(temperature=0.0, ignore_eos=True)
        run(eng, [(rng.integers(0, V, 300).tolist(), SamplingParams(max_tokens=8, **greedy))])  # warm-up
        _, _, trace = run(eng, [(rng.integers(0, V, 128).tolist(), SamplingParams(max_tokens=256, **greedy))])
        dec = trace[1:]
        b1 = (dec[-1][1] - dec[0][0]) / len(dec) * 1e3
        kernels = profile_b1(eng, rng, V) if PROFILE else None
        reqs = [(rng.integers(0, V, 128).tolist(), SamplingParams(max_tokens=128, **greedy)) for _ in range(64)]
        _, _, trace = run(eng, reqs)
        full = [s for s in trace if s[2] == 64][2:-2]  # steady decode steps of all 64
        b64 = statistics.median(e - s for s, e, _ in full) * 1e3 if full else None
        R["decode"][str(mp)] = dict(
            load_s=load, rank0_weight_bytes=runner.model.weight_bytes, b1_ms_per_step=b1, b64_ms_per_step=b64,
            b64_tok_s=64 / b64 * 1e3 if b64 else None, small_sums="one-shot" if tp.one_shot else "NCCL",
            fused_norm=tp.fused_norm is not None, b1_kernels_us_per_step=kernels,
        )  # fmt: skip
        save()
        if with_offline:
            R["decode"][str(mp)]["offline"] = offline(eng, mp, bw, model_dir)
        close(eng)
        for m, r in R["decode"].items():  # the floor: MP_NUM=1's weight bytes over N GPUs' bandwidth
            total = R["decode"]["1"]["rank0_weight_bytes"] if "1" in R["decode"] else None
            if total is None and not one:
                total = int(m) * r["rank0_weight_bytes"]
            if total is not None:
                r["floor_ms"] = total / (int(m) * bw) * 1e3
                r["b1_vs_floor"] = r["b1_ms_per_step"] / r["floor_ms"]
        print(f"decode MP_NUM={mp}: {R['decode'][str(mp)]}", flush=True)
        save()


# ---- allreduce ----------------------------------------------------------------------------------
def _symm_all_reduce(hidden: int, rows: int):
    """A one-shot all-reduce through torch's symmetric memory (P2P loads over NVLink, no multicast), or
    None where this torch has none: x [B, hidden] fp32 -> summed in place."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    ops = torch.ops.symm_mem
    name = dist.group.WORLD.group_name
    buf = symm_mem.empty(rows * hidden, dtype=torch.float32, device="cuda")
    symm_mem.rendezvous(buf, name)

    def ar(x: torch.Tensor) -> torch.Tensor:
        b = buf[: x.numel()].view_as(x)
        if hasattr(ops, "one_shot_all_reduce_copy_out"):
            ops.one_shot_all_reduce_copy_out(b, x, "sum", name, x)
        else:
            b.copy_(x)
            ops.one_shot_all_reduce_out(b, "sum", name, x)
        return x

    return ar


def _collectives(rank: int, n: int, port: int, hidden: int, layers: int, vocab: int, q) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    from llmserve.layers.parallel import TensorParallel

    tp = TensorParallel(rank, n, dist.group.WORLD)
    impls = {"nccl": tp.all_reduce}
    try:
        impls["symm_one_shot"] = _symm_all_reduce(hidden, 64)
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        impls["symm_one_shot"] = repr(e)[:300]
    res = {}
    for name, ar in impls.items():
        if isinstance(ar, str):
            res[name] = ar
            continue
        try:
            # The same sum as NCCL's, on fresh data.
            x = torch.randn(64, hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
            want = x.clone()
            dist.all_reduce(want)
            got = ar(x.clone())
            torch.cuda.synchronize()
            res[f"{name}_max_err"] = (got - want).abs().max().item()
            for batch in (1, 64):
                e = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
                xs = torch.randn(batch, hidden, device="cuda", dtype=torch.float32)
                lg = torch.randn(batch, -(-vocab // n), device="cuda", dtype=torch.float32)

                def step(e=e, xs=xs, lg=lg, ar=ar):
                    tp.all_reduce(e)
                    for _ in range(2 * layers):
                        ar(xs)
                    tp.all_gather_cols(lg)

                step()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    step()
                for _ in range(5):
                    g.replay()
                torch.cuda.synchronize()
                times = []
                for _ in range(30):
                    s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    g.replay()
                    t.record()
                    t.synchronize()
                    times.append(s.elapsed_time(t))
                res[f"{name}_b{batch}_ms"] = statistics.median(times)
        except Exception as e:  # noqa: BLE001
            res[name] = repr(e)[:300]
    if rank == 0:
        q.put(res)
    dist.barrier()
    os._exit(0)  # no teardown to wait for: the measurement is sent


def allreduce(mps: list[int], mc: dict) -> None:
    import torch.multiprocessing as mp

    R["allreduce_ms_per_step"] = {}
    ctx = mp.get_context("spawn")
    for n in mps:
        q = ctx.Queue()
        args = (n, PORT + 100 + n, mc["hidden_size"], mc["num_hidden_layers"], mc["vocab_size"], q)
        procs = [ctx.Process(target=_collectives, args=(r, *args)) for r in range(n)]
        for p in procs:
            p.start()
        res = q.get(timeout=300)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        R["allreduce_ms_per_step"][str(n)] = res
        print(f"collectives of one decode step, MP_NUM={n}: {res} ms (batch: ms)", flush=True)
        save()


def main() -> None:
    global OUT, PROFILE
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--mp",
        default="2",
        help="comma-separated MP_NUM values beside 1 (decode: only the first gets the symmetric-memory sums, "
        "one group a process; run each in its own process to compare them)",
    )
    ap.add_argument("--model", default="", help="checkpoint for decode (a random llama3-8b is written there if absent)")
    ap.add_argument("--work", default="/dev/shm/llmserve-tp" if os.path.isdir("/dev/shm") else "/tmp/llmserve-tp")
    ap.add_argument("--out", default="tp.json")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: check,decode,allreduce")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES), help="of the random checkpoint")
    ap.add_argument("--offline", action="store_true", help="also the 256-request offline workload at each MP_NUM")
    ap.add_argument(
        "--separate-norm", action="store_true", help="switch tp_fused_norm=0: sum, then normalize (the baseline)"
    )
    ap.add_argument(
        "--no-push", action="store_true", help="switch tp_gemv_push=0: the fused sums read the GEMVs' rows back"
    )
    ap.add_argument("--profile", action="store_true", help="rank 0's kernels a batch-1 decode step (decode)")
    a = ap.parse_args()
    OUT, PROFILE = a.out, a.profile
    # LLMSERVE_KERNEL_SWITCHES (kernels/switches.py), then the flags' (a later switch wins)
    flags = ["tp_fused_norm=0"] * a.separate_norm + ["tp_gemv_push=0"] * a.no_push
    R["kernel_switches"] = ENGINE_KW["kernel_switches"] = ",".join([Config.read("kernel_switches"), *flags])
    on = switches.parse(ENGINE_KW["kernel_switches"])
    R["fused_norm_setting"], R["gemv_push_setting"] = on.tp_fused_norm, on.tp_gemv_push
    mps = [int(x) for x in a.mp.split(",")]
    skip = set(a.skip.split(","))
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    R["gpus"] = torch.cuda.device_count()
    R["mp"] = mps
    cuda = torch.cuda.is_available()
    if "check" not in skip:
        check(mps, work)
    if cuda and "decode" not in skip:
        R["copy_tb_s"] = bw = copy_bandwidth()
        R["matmul_tflops"] = matmul_tflops() / 1e12
        R["shape"] = a.shape
        t = time.perf_counter()
        model = str(write_random_checkpoint(Path(a.model) if a.model else work / a.shape, a.shape))
        R["checkpoint_s"] = time.perf_counter() - t
        save()
        decode(model, mps, bw, a.offline)
    if cuda and "allreduce" not in skip:
        allreduce(mps, SHAPES[a.shape])
    save()
    print(json.dumps(R, indent=1), flush=True)
    os._exit(0)  # leftover NCCL / spawn teardown must not hold the call


if __name__ == "__main__":
    sys.exit(main())
