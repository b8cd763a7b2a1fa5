#!/usr/bin/env python3
"""DeepSeek-V2-Lite end to end on one GPU: random bf16 weights, LLMEngine + TorchRunner, CUDA graphs on.

The shape is kv_capacity.py's V2_LITE (15.7 B parameters, 27 layers, MLA with kv_lora r = 512 and rope R = 64,
64 routed experts top-6 + 2 shared, layer 0 dense). Sections (--sections); the JSON is rewritten after each:
  copy     device-to-device copy bandwidth bw (bytes read + written; bench_gpu.py's) and bf16 matmul FLOP/s peak;
  b1       batch 1, prompt 128, 256 greedy tokens: median ms per decode step against floor = bytes / bw, bytes =
           every non-expert weight (one row of embed_tokens, attention, norms, the dense MLP, the float32 routers,
           lm_head) + per MoE layer its 2 shared and the token's 6 routed experts + the latent cache read (mean
           context x layers x (r + R) x 2). The issue's goal: ratio <= 1.3;
  decode   per --batches B: B requests (512-token prompts, 128 output tokens) added at once: output tokens / wall
           time of the steps after the last prefill step (pure decode), their median step time, and tok/s over
           the steps still at the full batch B (the requests prefilled first end first);
  offline  bench_gpu.py's request mix (prompts U[128, 1024], outputs U[64, 512], temperature 0.8) against its
           roofline with MoE terms, over decode steps k = 1 .. max o - 1 with b_k requests, contexts summing to C_k:
             T = sum_i F(p_i) / peak + sum_k max(bytes_k / bw, flops_k / peak),   F(p) = 2 A p + L H (qk + v) p^2,
             flops_k = 2 A b_k + 2 L H (2 r + R) C_k,   bytes_k = W + n_moe e(b_k) X + kv C_k.
           A = the ACTIVE parameters a token multiplies (non-expert matrices, routers, lm_head, per MoE layer 2
           shared + 6 routed experts); prefill attention expanded and causal (qk = 192, v = 128), decode absorbed
           (scores over r + R, values over r); W = the bytes every step reads (non-expert weights, shared experts),
           X = one routed expert's bytes, e(b) = E (1 - (1 - k/E)^b) the distinct experts b tokens choose when
           routing is uniform (6 at b = 1, ~all 64 from b = 64), kv = the latent cache's bytes a token.
A section past --section-limit seconds aborts its requests (`truncated`); an error is recorded, the next runs.
The checkpoint: random_model.py's write_random_deepseek, its tensors drawn on --device (on the CPU: ~5 s a GB),
in /dev/shm (/tmp when too small) unless --model-dir; a directory with an index is reused.

Usage: PYTHONPATH=server python scripts/lab/bench_deepseek.py --out ds.json [--sections copy,b1,decode,offline]
           [--batches 64,256] [--model-dir DIR] [--shape v2-lite|tiny] [--device cuda|cpu] [--requests 256]
CPU smoke: ... --shape tiny --device cpu --batches 4,8 --b1-tokens 32 --decode-prompt 64 --decode-output-len 16
           --requests 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
import timeit
import traceback
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from safetensors.torch import save_file

from llmserve.config import Config
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.sampling_params import SamplingParams
from llmserve.layers.moe import MoE
from llmserve.models import random_model
from llmserve.runners.torch.runner import TorchRunner

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from bench_gpu import copy_bandwidth, matmul_tflops, offline_requests  # noqa: E402
from kv_capacity import V2_LITE, params  # noqa: E402

R: dict = {}
GREEDY = dict(temperature=0.0, ignore_eos=True)
Step = tuple[int, int, float, float]  # requests, tokens, device seconds, perf_counter() when its result came


class _OnDevice:
    """random_model's `torch`, with Generator and randn on `device` (the rest is torch's own)."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def Generator(self) -> torch.Generator:  # noqa: N802 - torch's name
        return torch.Generator(device=self.device)

    def randn(self, *shape: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=self.device)


def checkpoint(shape: str, model_dir: str, device: str, seed: int) -> str:
    """The checkpoint's directory, written unless it has an index (the file written last): write_random_deepseek
    with its randn on `device` and each shard's tensors copied to the CPU to be saved (a shard at a time)."""
    over = dict(V2_LITE) if shape == "v2-lite" else dict(max_position_embeddings=4096)  # tiny: bench_gpu's lengths
    if not model_dir:
        need = 2.2 * params(V2_LITE) if shape == "v2-lite" else 1e8  # bf16 bytes, with room
        shm = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need
        model_dir = f"{'/dev/shm' if shm else '/tmp'}/llmserve-random-deepseek-{shape}"
    if not (Path(model_dir) / "model.safetensors.index.json").exists():
        t = time.perf_counter()
        on_cpu = lambda ts, f, metadata: save_file({k: v.cpu() for k, v in ts.items()}, f, metadata)  # noqa: E731
        with (
            mock.patch.object(random_model, "torch", _OnDevice(device)),
            mock.patch.object(random_model, "save_file", on_cpu),
        ):
            random_model.write_random_deepseek(model_dir, "v2", seed, torch.bfloat16, **over)
        R["build_model_s"] = time.perf_counter() - t
    R["model_dir"] = model_dir
    return model_dir


def save(out: str) -> None:
    if out:
        Path(out).write_text(json.dumps(R, indent=1))


def free(device: str) -> None:
    """Wait for the device, then hand its unused cached memory back (between sections)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def bandwidth(device: str) -> tuple[float, float]:
    """(copy bytes read + written per second, matmul FLOP/s): bench_gpu's on CUDA, a small CPU stand-in."""
    if device == "cuda":
        return copy_bandwidth(), matmul_tflops()  # FLOP/s, despite its name
    a, m = torch.randn(1 << 25), torch.randn(1024, 1024)
    best = lambda fn: min(timeit.repeat(fn, number=1, repeat=5))  # noqa: E731
    return 2 * a.nbytes / best(a.clone), 2 * 1024**3 / best(lambda: m @ m)


def reads(model) -> dict:
    """A decode step's weights (module doc): `fixed` bytes read at any batch, `expert` one routed expert's bytes,
    `active` the parameters a token multiplies; n_moe MoE layers of E experts, k chosen a token."""
    nb = lambda *ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa: E731
    fixed, matmul, routers = nb(model.embed[0], model.norm, model.lm_head), nb(model.lm_head), 0
    moe = [lw.mlp for lw in model.layers if isinstance(lw.mlp, MoE)]
    for lw in model.layers:
        w = lw.attn.w
        attn = w.q_a_kv_a.nbytes + w.q.nbytes + w.o.nbytes + nb(w.w_uk, w.w_uv)
        if isinstance(lw.mlp, MoE):  # the shared experts and the router (float32); the routed ones: `expert`
            mlp, gate = lw.mlp.shared.nbytes if lw.mlp.shared is not None else 0, lw.mlp.gate
        else:  # a dense layer's MLP
            mlp, gate = lw.mlp.nbytes, None
        fixed += attn + mlp + nb(w.kv_a_norm, w.q_a_norm, lw.in_norm, lw.post_norm, gate)
        matmul, routers = matmul + attn + mlp, routers + (gate.numel() if gate is not None else 0)
    E, k = (moe[0].cfg.n_routed_experts, moe[0].cfg.num_experts_per_tok) if moe else (1, 0)
    expert = moe[0].experts[0].nbytes if moe else 0
    active = (matmul + len(moe) * k * expert) // model.embed.element_size() + routers
    return dict(fixed=fixed, expert=expert, active=active, n_moe=len(moe), E=E, k=k)


def roofline(rd: dict, mc, kv: float, plen: np.ndarray, olen: np.ndarray, bw: float, peak: float) -> dict:
    """The offline workload's fastest time on this device (module doc's formula) and the output tok/s it allows."""
    m, L, H, A, E, k = mc.mla, mc.num_hidden_layers, mc.num_attention_heads, rd["active"], rd["E"], rd["k"]
    p = plen.astype(np.float64)
    t_pre = float(np.sum(2 * A * p + L * H * (m.qk_head_dim + m.v_head_dim) * p**2)) / peak
    t_dec = 0.0
    for s in range(1, int(olen.max())):
        ctx = (p + s)[olen > s]
        b, C = ctx.size, float(ctx.sum())
        nbytes = rd["fixed"] + rd["n_moe"] * E * (1 - (1 - k / E) ** b) * rd["expert"] + kv * C
        t_dec += max(nbytes / bw, (2 * A * b + 2 * L * H * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * C) / peak)
    t = t_pre + t_dec
    return dict(prefill_s=t_pre, decode_s=t_dec, total_s=t, output_tok_s=float(olen.sum()) / t)


class Recorder:
    """Wraps runner.submit / result: `steps`, one Step per runner step, in order."""

    def __init__(self, runner: TorchRunner) -> None:
        self.steps: list[Step] = []
        self._shapes: list[tuple[int, int]] = []
        self._submit, self._result = runner.submit, runner.result
        runner.submit, runner.result = self.submit, self.result

    def submit(self, batch):
        self._shapes.append((len(batch.chunks), batch.num_tokens))
        return self._submit(batch)

    def result(self, handle):
        res = self._result(handle)
        self.steps.append((*self._shapes.pop(0), res.model_time, time.perf_counter()))
        return res


def drive(engine: LLMEngine, rec: Recorder, reqs: list, limit: float) -> tuple[dict[str, list[int]], bool, float]:
    """Add all, step until done (past `limit` seconds: abort the rest) -> (tokens by request, truncated, wall s)."""
    rec.steps.clear()
    got: dict[str, list[int]] = {rid: [] for rid, _, _ in reqs}
    t0, cut = time.perf_counter(), False
    try:
        for rid, ids, p in reqs:
            engine.add_request(rid, ids, p)
        while engine.has_unfinished():
            if not cut and time.perf_counter() - t0 > limit:
                cut = True
                for rid in list(engine.requests):
                    engine.abort(rid)
            for o in engine.step():
                got[o.req_id] += o.new_token_ids
    except Exception:  # leave no request behind for the next section's run
        for rid in list(engine.requests):
            engine.abort(rid)
        raise
    return got, cut, time.perf_counter() - t0


def pure_decode(steps: list[Step], full: int) -> dict:
    """The steps after the last one that computed prompt tokens: tok/s, median step; the same at batch `full`."""
    m = max((i for i, s in enumerate(steps) if s[1] != s[0]), default=0)
    dec, gaps = steps[m + 1 :], np.diff([s[3] for s in steps[m:]])
    if not dec:
        return dict(steps=0)
    n, wall, at_full = sum(s[0] for s in dec), dec[-1][3] - steps[m][3], [g for g, s in zip(gaps, dec) if s[0] == full]
    d = dict(steps=len(dec), tokens=n, wall_s=wall, tok_s=n / wall, mean_batch=n / len(dec))
    d.update(step_ms=float(np.median(gaps)) * 1e3, step_gpu_ms=statistics.median(s[2] for s in dec) * 1e3)
    if at_full:
        d.update(full_batch_steps=len(at_full), full_batch_tok_s=full / float(np.median(at_full)))
    return d


def table() -> str:
    b1, off = R.get("b1", {}), R.get("offline", {})
    rows = [("device / shape", f"{R.get('device')} / {R.get('shape')}"), ("copy bandwidth (TB/s)", R.get("copy_tb_s")),
            ("bf16 matmul (TFLOP/s)", R.get("matmul_tflops")), ("weights (GB)", R.get("weight_bytes", 0) / 1e9),
            ("b1: decode (ms/step, median)", b1.get("ms_per_step")), ("b1: floor (ms/step)", b1.get("floor_ms")),
            ("b1: decode / floor (goal <= 1.3)", b1.get("vs_floor"))]  # fmt: skip
    for b, d in ((b, d) for b, d in R.get("decode", {}).items() if isinstance(d, dict)):
        rows.append((f"decode b{b}: pure-decode tok/s, step ms", f"{d.get('tok_s', 0):.0f}, {d.get('step_ms', 0):.2f}"))
        rows.append((f"decode b{b}: tok/s at the full batch", d.get("full_batch_tok_s")))
    rows += [("offline: output tok/s", off.get("tok_s")),
             ("offline: roofline (output tok/s)", off.get("roofline", {}).get("output_tok_s")),
             ("offline: / roofline", off.get("vs_roofline")),
             ("offline: requests short / truncated", f"{len(off['bad'])} / {off['truncated']}" if "bad" in off else None)]  # fmt: skip
    rows += [(f"error in {k}", v["error"][:80]) for k, v in R.items() if isinstance(v, dict) and "error" in v]
    rows = [r for r in rows if r[1] is not None]  # the sections that ran
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{k:<{w}}  {f'{v:.3f}' if isinstance(v, float) else v}" for k, v in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("--out", "bench_deepseek.json"), ("--sections", "copy,b1,decode,offline"),
                          ("--batches", "64,256"), ("--model-dir", "")):  # fmt: skip
        ap.add_argument(flag, default=default)
    ap.add_argument("--shape", choices=("v2-lite", "tiny"), default="v2-lite")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    for flag, default in (("--b1-prompt", 128), ("--b1-tokens", 256), ("--decode-prompt", 512),
                          ("--decode-output-len", 128), ("--requests", 256), ("--seed", 0)):  # fmt: skip
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--section-limit", type=float, default=150.0, help="seconds a section's requests may run")
    a = ap.parse_args()
    sections, batches, dev = a.sections.split(","), [int(b) for b in a.batches.split(",")], a.device
    R.update(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__, shape=a.shape)
    bw, peak = bandwidth(dev)  # the floors need them whether or not `copy` is asked for
    R.update(copy_tb_s=bw / 1e12, matmul_tflops=peak / 1e12)
    print(f"copy: {bw / 1e12:.3f} TB/s, matmul {peak / 1e12:.1f} TFLOP/s", flush=True)
    if set(sections) <= {"copy"}:  # nothing needs the model
        save(a.out)
        print(table())
        return
    model_dir = checkpoint(a.shape, a.model_dir, dev, a.seed)
    free(dev)
    save(a.out)
    cfg = Config(device=dev, batch_size=max(256, *batches), max_seq_len=2048, block_size=64, cuda_graphs=True,
                 kv_cache_memory_fraction=0.9, enable_prefix_caching=False)  # fmt: skip
    t = time.perf_counter()
    runner = TorchRunner(model_dir, cfg)  # the KV cache: 0.9 of the memory free after a profiled largest step
    rd, kv_tok = reads(runner.model), runner.kv_spec.block_bytes / runner.block_size  # the latent cache: bytes a token
    R.update(load_s=time.perf_counter() - t, weight_bytes=runner.model.weight_bytes, kv_blocks=runner.num_kv_blocks)
    R.update(cuda_graphs=runner.graphs is not None, reads=rd, kv_bytes_per_token=kv_tok)
    engine, rec, rng, V = LLMEngine(cfg, runner), Recorder(runner), np.random.default_rng(a.seed), runner.vocab_size
    prompt = lambda n: rng.integers(0, V, n).tolist()  # noqa: E731
    # warm-up: prefill shapes, mixed steps and sampling (the decode graphs were captured at start)
    drive(engine, rec, [("w", prompt(300), SamplingParams(max_tokens=8, **GREEDY))], a.section_limit)
    warm = [(f"w{i}", prompt(900), SamplingParams(max_tokens=6, temperature=1.0)) for i in range(6)]
    drive(engine, rec, warm, a.section_limit)

    def b1() -> dict:
        sp = SamplingParams(max_tokens=a.b1_tokens, **GREEDY)
        _, cut, _ = drive(engine, rec, [("b1", prompt(a.b1_prompt), sp)], a.section_limit)
        dec, ctx = rec.steps[1:], a.b1_prompt + len(rec.steps) / 2  # the decode steps' mean context
        nbytes = rd["fixed"] + rd["n_moe"] * rd["k"] * rd["expert"] + kv_tok * ctx
        ms, floor = float(np.median(np.diff([s[3] for s in rec.steps]))) * 1e3, nbytes / bw * 1e3
        return dict(ms_per_step=ms, gpu_ms_per_step=statistics.median(s[2] for s in dec) * 1e3, floor_ms=floor,
                    vs_floor=ms / floor, bytes=nbytes, mean_context=ctx, steps=len(dec), truncated=cut)  # fmt: skip

    def decode() -> dict:
        R["decode"] = out = {}
        for b in batches:
            sp = SamplingParams(max_tokens=a.decode_output_len, **GREEDY)
            reqs = [(f"d{b}-{i}", prompt(a.decode_prompt), sp) for i in range(b)]
            _, cut, wall = drive(engine, rec, reqs, a.section_limit)
            out[str(b)] = dict(pure_decode(rec.steps, b), truncated=cut, run_wall_s=wall)
            save(a.out)
            print(f"decode b{b}:", out[str(b)], flush=True)
        return out

    def offline() -> dict:
        reqs, plen, olen = offline_requests(V, a.requests)
        got, cut, wall = drive(engine, rec, reqs, a.section_limit)
        n, rf = sum(len(v) for v in got.values()), roofline(rd, runner.model_config, kv_tok, plen, olen, bw, peak)
        return dict(requests=len(reqs), output_tokens=n, wall_s=wall, tok_s=n / wall, roofline=rf,
                    vs_roofline=n / wall / rf["output_tok_s"], truncated=cut, steps=len(rec.steps),
                    bad=[r for r, _, p in reqs if len(got[r]) != p.max_tokens])  # fmt: skip

    for name in (s for s in sections if s != "copy"):
        t = time.perf_counter()
        try:
            R[name] = dict(b1=b1, decode=decode, offline=offline)[name]()
        except Exception as e:  # noqa: BLE001 - record it, go on with the next section
            traceback.print_exc()
            R[name] = dict(R.get(name) or {}, error=repr(e)[:500])
        R[f"{name}_s"] = time.perf_counter() - t
        free(dev)
        save(a.out)
        print(f"{name}: {R[f'{name}_s']:.1f} s", flush=True)
    engine.shutdown()
    print(table())


if __name__ == "__main__":
    main()
