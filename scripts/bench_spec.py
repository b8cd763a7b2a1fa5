#!/usr/bin/env python3
"""GPU benchmark of speculative decoding (issue 14): one run, one table, one JSON.

  --oracle: a random-weight Llama-3-8B-shaped bf16 checkpoint and an oracle proposer that proposes
    the target's own greedy continuation (taken from the plain run of the same prompts, which is
    the baseline). Decode tokens/s with k = 1..5 (fixed) and with the adaptive rule (k <= 5),
    against plain decoding, at batch 1, 16, 64, 256; and the verification step's time against a
    plain decode step at batch 1.
  --trained DIR: the models of scripts/train_models.sh (DIR/target with its MTP layer, DIR/draft):
    acceptance rate and mean accepted length of each method for k = 1..5 on held-out stdlib
    completions (greedy; SKIP_ACCEPTANCE=1 skips them), and decode tokens/s at 1, 8 and 64
    concurrent requests with each method (adaptive, k <= 5) against no speculation: the engines take
    turns over ROUNDS (5) counted rounds after an uncounted one, and the median counts. TRACE_RULE=1
    keeps the draft-length rule's choices and observations of the last round in the JSON.

Decode tokens/s counts the tokens after each request's first, over the time from the step that
gave the last request its first token to the end (prefill excluded; all requests start together).

Usage: PYTHONPATH=server python scripts/bench_spec.py --out spec.json [--oracle] [--trained DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from llmserve.config import Config
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.request import Request
from llmserve.engine.sampling_params import SamplingParams
from llmserve.engine.speculative import Proposer
from llmserve.runners.torch.runner import TorchRunner

R: dict = {}
RUNS = [0]  # request ids are unique over the whole run: a proposer shared by engines keeps per-id state
GREEDY = dict(temperature=0.0, ignore_eos=True)


def save(out: str) -> None:
    Path(out).write_text(json.dumps(R, indent=1))


class OracleProposer(Proposer):
    """Proposes the continuation a plain greedy run produced: what the target will accept."""

    def __init__(self, continuations: list[list[int]]) -> None:
        self.cont = continuations  # of the prompts in order (request ids "r<run>-<index>")

    def propose(self, reqs: list[Request], k: int) -> None:
        for r in reqs:
            n = len(r.output_token_ids)
            r.draft_token_ids = self.cont[int(r.req_id.rsplit("-", 1)[1])][n : n + k]


def trace_rule(engine: LLMEngine) -> list:
    """Record the draft-length rule's choices and observations (for the JSON: what it saw and did)."""
    log: list = []
    rule = engine.draft_length
    choose, observe = rule.choose, rule.observe

    def traced_choose(batch: int, acceptance: float) -> int:
        k = choose(batch, acceptance)
        log.append(["choose", round(time.perf_counter(), 6), batch, k, round(acceptance, 3)])
        return k

    def traced_observe(batch: int, k: int, seconds: float, tokens: int) -> None:
        log.append(["observe", round(time.perf_counter(), 6), batch, k, round(seconds * 1e3, 4), tokens])
        observe(batch, k, seconds, tokens)

    rule.choose, rule.observe = traced_choose, traced_observe
    return log


def decode_run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once; decode tokens/s and ms/step after the last first token, the tokens, spec stats."""
    s0 = engine.stats()
    pauses: dict[int, list[float]] = {}  # the garbage collector's pauses during the run, by generation
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.setdefault(info["generation"], []).append(time.perf_counter() - started[0])

    gc.callbacks.append(on_gc)
    RUNS[0] += 1
    ids_of = {f"r{RUNS[0]}-{i}": ids for i, ids in enumerate(prompts)}
    for rid, ids in ids_of.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, **GREEDY))
    got = {rid: [] for rid in ids_of}
    t_first = steps_after = None
    while engine.has_unfinished():
        for o in engine.step():
            got[o.req_id] += o.new_token_ids
        if t_first is None and all(got.values()):
            torch.cuda.synchronize()
            t_first, steps_after = time.perf_counter(), engine.stats().steps
    torch.cuda.synchronize()
    wall = time.perf_counter() - t_first
    gc.callbacks.remove(on_gc)
    s1 = engine.stats()
    n_dec = sum(len(t) - 1 for t in got.values())
    steps = max(1, s1.steps - steps_after)
    verified = s1.spec_verified - s0.spec_verified
    drafted = s1.spec_draft_tokens - s0.spec_draft_tokens
    accepted = s1.spec_accepted_tokens - s0.spec_accepted_tokens
    return dict(
        decode_tok_s=n_dec / wall,
        ms_per_step=wall / steps * 1e3,
        steps=steps,
        decode_tokens=n_dec,
        preemptions=s1.preemptions - s0.preemptions,
        kv_blocks=s1.kv_blocks_total,
        gc_pauses={g: [len(v), round(sum(v) * 1e3, 3), round(max(v) * 1e3, 3)] for g, v in pauses.items()},
        # The device's share (the runner's step events; the prefill steps too, a few of many).
        gpu_ms_per_step=(s1.model_time - s0.model_time) / max(1, s1.steps - s0.steps) * 1e3,
        acceptance=accepted / drafted if drafted else None,
        mean_accepted_len=1 + accepted / verified if verified else None,
        tokens=list(got.values()),  # in prompt order
    )


def engine_for(runner: TorchRunner, cfg: Config, k: int, adaptive: bool, proposer: Proposer | None) -> LLMEngine:
    spec = dataclasses.replace(cfg, speculate_max_draft_tokens=max(1, k), speculate_adaptive=adaptive)
    engine = LLMEngine(spec, runner)
    if proposer is not None:
        engine.proposer = proposer
    return engine


def oracle_run(runner, cfg: Config, k: int, oracle: OracleProposer, prompts, max_tokens: int, tries: int = 3) -> dict:
    """A run whose proposals are its own greedy continuation. The plain run's continuation is not
    quite that: a random-weight model's logits are nearly flat, and a verification step's different
    shapes round differently, so some argmaxes flip. So run again proposing the last run's output,
    until all proposals are accepted (then the steps' shapes, hence their rounding, repeat)."""
    for _ in range(tries):
        r = decode_run(engine_for(runner, cfg, k or 5, k == 0, oracle), prompts, max_tokens)
        oracle = OracleProposer(r.pop("tokens"))
        if r["acceptance"] == 1.0:
            break
    return r


def bench_oracle(out: str, batches: list[int], max_tokens: int, shape: str = "llama3-8b") -> None:
    from llmserve.models.random_model import write_random_checkpoint

    root = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    model_dir = f"{root}/llmserve-random-v3-{shape}"
    t = time.perf_counter()
    write_random_checkpoint(
        model_dir, shape, **({} if torch.cuda.is_available() else dict(device="cpu", dtype=torch.float32))
    )
    R["oracle_build_s"] = time.perf_counter() - t
    base = Config(batch_size=max(batches), max_seq_len=1024, block_size=64, max_num_batched_tokens=4096)
    base = dataclasses.replace(
        base, enable_prefix_caching=False, speculate_method="ngram", speculate_max_draft_tokens=5,
        kernel_switches=Config.read("kernel_switches"),  # LLMSERVE_KERNEL_SWITCHES (scripts/lab/device_skinny.sh)
    )  # fmt: skip
    t = time.perf_counter()
    runner = TorchRunner(model_dir, base)  # graphs for decode and for verification with k = 1..5
    R["oracle_load_s"] = time.perf_counter() - t
    plain_cfg = dataclasses.replace(base, speculate_method="none")
    rng = np.random.default_rng(0)
    V = runner.vocab_size
    decode_run(LLMEngine(plain_cfg, runner), [rng.integers(0, V, 200).tolist() for _ in range(4)], 16)  # warm-up
    R["oracle"] = rows = []
    for B in batches:
        prompts = [rng.integers(0, V, 128).tolist() for _ in range(B)]
        plain = decode_run(LLMEngine(plain_cfg, runner), prompts, max_tokens)
        oracle = OracleProposer(plain.pop("tokens"))
        row = dict(batch=B, plain_tok_s=plain["decode_tok_s"], plain_ms_per_step=plain["ms_per_step"])
        for k in [*range(1, 6), 0]:  # 0: adaptive, k <= 5
            r = oracle_run(runner, base, k, oracle, prompts, max_tokens)
            row[f"k{k}" if k else "adaptive"] = dict(r, speedup=r["decode_tok_s"] / plain["decode_tok_s"])
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items()}, default=str), flush=True)
        save(out)
    b1 = next((r for r in rows if r["batch"] == 1), None)
    if b1:
        R["oracle_verify_step_vs_plain_b1_k4"] = b1["k4"]["ms_per_step"] / b1["plain_ms_per_step"]
        R["oracle_profile_b1"] = profile_b1(runner, base, plain_cfg, rng, max_tokens)
        save(out)
    del runner
    torch.cuda.empty_cache()


def profile_engine(engine: LLMEngine, prompt: list[int], max_tokens: int, steps: int = 12) -> dict:
    """Where a batch-1 step's time goes: torch.profiler's per-step device kernel time, the top kernels
    and the top host (CPU) work, over `steps` decoding steps of one request."""
    from torch.profiler import ProfilerActivity, profile

    RUNS[0] += 1
    engine.add_request(f"r{RUNS[0]}-0", prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
    for _ in range(8):  # past the prefill
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    ev = prof.key_averages()
    kernels = sorted((e for e in ev if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    return dict(
        device_ms_per_step=sum(e.self_device_time_total for e in ev) / 1e3 / steps,
        top_kernels=[[e.key[:70], e.count // steps, round(e.device_time_total / 1e3 / steps, 4)] for e in kernels[:12]],
        top_host=[
            [e.key[:70], round(e.self_cpu_time_total / 1e3 / steps, 4)]
            for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:15]
        ],
    )


def profile_b1(runner, base: Config, plain_cfg: Config, rng, max_tokens: int) -> dict:
    """A batch-1 step, plain and verifying k = 4 oracle proposals (profile_engine)."""
    prompt = [rng.integers(0, runner.vocab_size, 128).tolist()]
    plain = decode_run(LLMEngine(plain_cfg, runner), prompt, max_tokens)
    out = {
        "plain": profile_engine(LLMEngine(plain_cfg, runner), prompt[0], max_tokens),
        "k4": profile_engine(
            engine_for(runner, base, 4, False, OracleProposer(plain["tokens"])), prompt[0], max_tokens
        ),
    }
    print(json.dumps(out), flush=True)
    return out


def heldout_prompts(tokenizer, n: int, length: int, corpus_root: str = "", seed: int = 0) -> list[list[int]]:
    """n windows of `length` tokens from the held-out files of the training corpus (a window from
    each file in turn, as many rounds as it takes: there are fewer held-out files than requests)."""
    from llmserve.train.corpus import load_corpus, read_source

    corpus = load_corpus(Path(corpus_root) if corpus_root else None)
    rng = np.random.default_rng(seed)
    files = []
    for rel in rng.permutation(np.array(corpus.heldout, dtype=object)):
        text = read_source(corpus.root / rel)
        ids = tokenizer.encode(text) if text else []
        if len(ids) > length + 8:
            files.append(ids)
    out = []
    while files and len(out) < n:
        for ids in files[: n - len(out)]:
            s = int(rng.integers(0, len(ids) - length))
            out.append(ids[s : s + length])
    return out


def bench_trained(out: str, models: str, max_tokens: int, corpus: str = "") -> None:
    from llmserve.engine.tokenizer import load_tokenizer

    target, draft = Path(models) / "target", Path(models) / "draft"
    # Fixed KV caches (64 sequences each): the MTP method has a runner of its own (its cache holds one
    # more layer, and its steps run the module), so plain decoding and the others never pay for it.
    base = Config(batch_size=64, max_seq_len=1024, block_size=16, max_num_batched_tokens=4096, block_bs=64)
    base = dataclasses.replace(
        base, speculate_method="ngram", speculate_max_draft_tokens=5, kernel_switches=Config.read("kernel_switches")
    )
    runner = TorchRunner(str(target), base)
    prompts = heldout_prompts(load_tokenizer(str(target)), 64, 256, corpus)
    methods = {"ngram": dict(speculate_method="ngram")}
    runners = {"ngram": runner}
    if draft.is_dir():
        methods["draft"] = dict(speculate_method="draft", speculate_model_path=str(draft))
        runners["draft"] = runner
    if json.loads((target / "config.json").read_text()).get("num_nextn_predict_layers"):
        methods["mtp"] = dict(speculate_method="mtp")
        runners["mtp"] = TorchRunner(str(target), dataclasses.replace(base, speculate_method="mtp"))
    R["trained_acceptance"] = acc = {}
    R["trained_decode"] = dec = []
    plain_cfg = dataclasses.replace(base, speculate_method="none")
    for r in set(runners.values()):
        decode_run(LLMEngine(plain_cfg, r), prompts[:4], 16)  # warm-up
    proposers = {}
    for name, kw in methods.items():
        acc[name] = {}
        try:  # one proposer (and draft model) per method, shared by its engines
            proposers[name] = engine_for(runners[name], dataclasses.replace(base, **kw), 5, False, None).proposer
        except Exception as e:  # a method this build cannot run: say so in the table
            acc[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        for k in () if os.environ.get("SKIP_ACCEPTANCE") else range(1, 6):
            engine = engine_for(runners[name], base, k, False, proposers[name])
            r = decode_run(engine, prompts[:32], max_tokens)
            acc[name][f"k{k}"] = dict(acceptance=r["acceptance"], mean_accepted_len=r["mean_accepted_len"])
        print(name, json.dumps(acc[name]), flush=True)
        save(out)

    # Decode rows: each engine serves the same requests ROUNDS + 1 times, the engines taking turns
    # (plain, then each method, round after round: a drift of the machine's speed over the call
    # touches all alike), and the first round is not counted (the draft-length rule, like a server's,
    # has then measured its options at this load). Each figure is the median over the rounds.
    rounds = int(os.environ.get("ROUNDS", "5"))

    def decode_rows(dest: list) -> None:
        for c in (1, 8, 64):
            engines = {"none": LLMEngine(plain_cfg, runner)}
            for name in methods:
                if name in proposers:
                    engines[name] = engine_for(runners[name], base, 5, True, proposers[name])
            runs: dict[str, list[dict]] = {name: [] for name in engines}
            for r in range(rounds + 1):
                for name, engine in engines.items():
                    log = (
                        trace_rule(engine) if r == rounds and name != "none" and os.environ.get("TRACE_RULE") else None
                    )
                    got = decode_run(engine, prompts[:c], max_tokens)
                    got.pop("tokens", None)
                    if log is not None:
                        got["rule_trace"] = log
                    if r:
                        runs[name].append(got)
            row: dict = {"concurrency": c, "rounds": rounds}
            for name, got in runs.items():
                rates = [g["decode_tok_s"] for g in got]
                row[name] = dict(got[-1], decode_tok_s=float(np.median(rates)), decode_tok_s_runs=rates)
            for name in engines:
                row[name]["speedup"] = row[name]["decode_tok_s"] / row["none"]["decode_tok_s"]
            dest.append(row)
            print(json.dumps({k: v for k, v in row.items()}, default=str)[:3000], flush=True)
            save(out)

    decode_rows(dec)
    if "mtp" in proposers:  # where an MTP step's time goes, at k = 0 and at k = 3
        R["trained_mtp_profile"] = prof = {}
        for k in (0, 3):
            cfg = dataclasses.replace(base, speculate_method="mtp", speculate_max_draft_tokens=max(k, 1))
            engine = LLMEngine(dataclasses.replace(cfg, speculate_adaptive=False), runners["mtp"])
            if not k:
                engine.draft_length.choose = lambda batch, acceptance: 0
            prof[f"k{k}"] = profile_engine(engine, prompts[0], max_tokens)
        print(json.dumps(R["trained_mtp_profile"]), flush=True)
        save(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_spec.json")
    ap.add_argument("--oracle", action="store_true")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--shape", default="llama3-8b", help="random-weight shape of --oracle")
    ap.add_argument("--trained", default="")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--corpus", default="", help="--trained: the stdlib root the models were trained on")
    args = ap.parse_args()
    R["device"] = torch.cuda.get_device_name()
    R["torch"] = torch.__version__
    if args.oracle:
        bench_oracle(args.out, [int(b) for b in args.batches.split(",")], args.max_tokens, args.shape)
    if args.trained:
        bench_trained(args.out, args.trained, args.max_tokens, args.corpus)
    save(args.out)


if __name__ == "__main__":
    main()
