"""The training loop: transformers' LlamaForCausalLM (or DeepseekV3ForCausalLM) on the stdlib corpus, CPU or CUDA.

Each step takes `batch_size` random windows of `seq_len + 1` tokens from the training stream
(start offsets drawn from a torch.Generator seeded with `seed`), AdamW (betas 0.9/0.95, weight
decay on matrices), linear warmup then cosine to `min_lr_ratio * lr`, gradient clipping at 1.
CUDA: bf16 autocast over float32 weights. CPU: float32, deterministic algorithms and a fixed
thread count, so the same seed, thread count and machine give byte-identical weights.

Output directory: the HF checkpoint (checkpoint.py), the tokenizer, `train_log.jsonl` (the
mean loss every `log_every` steps) and `train_metrics.json` (held-out perplexity on fixed,
evenly spaced held-out windows, parameter count, steps, seconds, device, seed, versions).

With `init_from` (and `mtp`), only an MTP module trains, on a trained model's frozen trunk (attach.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from llmserve.train import attach
from llmserve.train.balance import ExpertBalance
from llmserve.train.checkpoint import causal_lm, model_config, save_checkpoint
from llmserve.train.corpus import load_corpus, token_streams
from llmserve.train.evaluate import evaluate, forward
from llmserve.train.mtp import mtp_layer
from llmserve.train.presets import PRESETS, Preset
from llmserve.train.tokenizer import build_tokenizer, copy_tokenizer, save_tokenizer, special_ids

DEFAULT_CPU_THREADS = 2  # fixed, so that a CPU run is reproducible on another machine with the same CPU


@dataclass
class TrainOptions:
    preset: str
    out: Path
    tokenizer: Path | None = None  # reuse this tokenizer instead of training one
    device: str = "auto"
    seed: int = 0
    max_steps: int | None = None  # default: the preset's
    max_seconds: float | None = None  # default: the preset's
    mtp: bool = False
    max_files: int | None = None  # only the first N corpus files (tests)
    corpus: Path | None = None  # a stdlib tree to read instead of this interpreter's (the same corpus anywhere)
    eval_every: int | None = None  # held-out check every N steps (default: 20 per run); the best weights win
    patience: int = 3  # stop after this many checks without a better held-out loss
    cache_dir: Path | None = None  # token streams; default LLMSERVE_CACHE_DIR/train
    threads: int | None = None  # CPU threads; default DEFAULT_CPU_THREADS
    log_every: int = 10
    tokenizer_only: bool = False
    init_from: Path | None = None  # a trained model: train only an MTP module on its frozen trunk (attach.py)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


@contextlib.contextmanager
def reproducible(device: torch.device, threads: int):
    """Deterministic kernels and a fixed thread count on CPU (both restored on exit); TF32 on CUDA."""
    saved = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        if device.type == "cpu":
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(True)
        else:
            torch.backends.cuda.matmul.allow_tf32 = True
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])


def lr_factor(step: int, total: int | None, warmup: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then a cosine from 1 to min_ratio at step `total`."""
    if step < warmup or total is None:
        return min(1.0, (step + 1) / max(1, warmup))
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def _progress(total: int | None):
    try:
        from tqdm import tqdm
    except ImportError:  # the GPU box may lack tqdm: the log lines below stand in for the bar
        return None
    return tqdm(total=total, unit="step", mininterval=1.0 if sys.stderr.isatty() else 10.0, dynamic_ncols=True)


def _prepare_tokenizer(opts: TrainOptions, preset: Preset) -> Tokenizer:
    out = Path(opts.out)
    if opts.init_from is not None:  # its own tokenizer, as it is (model_max_length included)
        src = Path(opts.init_from)
        copy_tokenizer(src, out, json.loads((src / "config.json").read_text())["max_position_embeddings"])
    elif opts.tokenizer is not None:
        copy_tokenizer(Path(opts.tokenizer), out, preset.max_position_embeddings)
    else:
        corpus = load_corpus(opts.corpus, max_files=opts.max_files)
        t0 = time.perf_counter()
        save_tokenizer(build_tokenizer(corpus.texts("train"), preset.vocab_size), out, preset.max_position_embeddings)
        print(f"tokenizer: {preset.vocab_size} ids from {len(corpus.train)} files in {time.perf_counter() - t0:.1f} s")
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def train(opts: TrainOptions) -> dict:
    preset = PRESETS[opts.preset]
    attach.check_options(opts, preset)
    device = resolve_device(opts.device)
    threads = opts.threads or DEFAULT_CPU_THREADS
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    with reproducible(device, threads):
        tok = _prepare_tokenizer(opts, preset)
        if opts.tokenizer_only:
            return {"tokenizer": str(out), "vocab_size": tok.get_vocab_size()}
        if opts.cache_dir is None:
            from llmserve.config import Config

            opts.cache_dir = Config.from_env().cache_path / "train"
        streams, corpus_stats = token_streams(out, Path(opts.cache_dir), opts.max_files, opts.corpus, preset.chat_every)
        print(
            f"corpus: {corpus_stats['train']['tokens']:,} training tokens from {corpus_stats['train']['files']} files,"
            f" {corpus_stats['heldout']['tokens']:,} held-out tokens from {corpus_stats['heldout']['files']}"
        )
        return _run(opts, preset, device, threads, tok, streams, corpus_stats)


def _run(opts, preset: Preset, device, threads, tok, streams, corpus_stats) -> dict:
    out = Path(opts.out)
    bos, eos = special_ids(tok)
    frozen = opts.init_from is not None  # only the MTP module trains
    src = Path(opts.init_from) if frozen else None
    if frozen:
        config = attach.source_config(src, tok.get_vocab_size())
    else:
        config = model_config(preset, tok.get_vocab_size(), bos, eos, opts.mtp)
    torch.manual_seed(opts.seed)
    model = causal_lm(config).float()  # float32 master weights, whatever dtype DIR's config names
    if frozen:
        trunk = attach.trunk_tensors(src, config.num_hidden_layers)
        attach.load_frozen_trunk(model, trunk)
    model.to(device)
    mtp = mtp_layer(config).float().to(device) if opts.mtp else None
    ds = preset.deepseek
    balance = ExpertBalance([model, *([mtp] if mtp else [])], ds.bias_update_speed) if ds is not None else None
    params = [] if frozen else list(model.parameters())
    params += list(mtp.parameters()) if mtp is not None else []
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": preset.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(groups, lr=preset.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda)

    S, B = preset.seq_len, preset.batch_size
    data = torch.from_numpy(streams["train"].astype(np.int64)).to(device)
    if len(data) < S + 2:
        raise ValueError(f"training split has {len(data)} tokens, fewer than one window of {S + 1}")
    gen = torch.Generator().manual_seed(opts.seed)  # on the CPU: the same windows on every device
    offsets = torch.arange(S + 1)

    max_steps = opts.max_steps if opts.max_steps is not None else preset.max_steps
    if frozen and opts.max_steps is None and preset.mtp_steps is not None:
        max_steps = preset.mtp_steps
    max_seconds = opts.max_seconds if opts.max_seconds is not None else preset.max_seconds
    if max_steps is None and max_seconds is None:
        raise ValueError(f"preset {preset.name}: give --max-steps or --max-seconds")
    total = max_steps  # None: set from the step time measured over steps calib_from .. calib_to
    calib_to = max(2, preset.warmup_steps)  # the pace is measured over the last 2/3 of the warmup
    calib_from, calib_t = calib_to // 3, 0.0

    log_path = out / "train_log.jsonl"
    log = log_path.open("w")
    log.writelines(attach.source_log_lines(src) if frozen else [])
    bar = _progress(total)
    acc = torch.zeros(2, device=device)  # loss sums since the last log line: no sync per step
    n_acc, step, last, stopped_by = 0, 0, {}, "steps"
    # Early stopping: a small corpus (a stdlib without its tests is ~2M tokens) is soon learnt by heart,
    # so the held-out loss is checked along the way and the best weights are the ones kept.
    best = {"ppl": math.inf, "step": 0, "state": None, "misses": 0}
    checks: list[list] = []  # [step, held-out perplexity on check_windows]
    checked = "mtp_heldout_ppl" if frozen else "heldout_ppl"  # a frozen trunk's does not move
    trained = None if frozen else model  # what the checks snapshot and restore, besides the MTP
    check_windows = max(8, preset.eval_windows // 4)
    model.train(not frozen)
    t0 = time.perf_counter()
    while total is None or step < total:
        elapsed = time.perf_counter() - t0
        if max_seconds is not None and elapsed >= max_seconds:
            stopped_by = "time"
            break
        lr = preset.lr * lr_factor(step, total, preset.warmup_steps, preset.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(data) - S, (B,), generator=gen)
        w = data[(starts[:, None] + offsets).to(device)]
        x, y = w[:, :-1], w[:, 1:]
        logits, mtp_logits = forward(model, mtp, x, cuda, frozen)
        if frozen:  # the MTP loss alone
            total_loss = F.cross_entropy(mtp_logits.flatten(0, 1), y[:, 1:].flatten())
            acc[1] += total_loss.detach()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            total_loss = loss
            if mtp_logits is not None:
                mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1), y[:, 1:].flatten())
                total_loss = loss + preset.mtp_loss_weight * mtp_loss
                acc[1] += mtp_loss.detach()
            acc[0] += loss.detach()
        n_acc += 1
        opt.zero_grad(set_to_none=True)
        total_loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if balance is not None:
            balance.update()
        step += 1
        if total is None and step in (calib_from, calib_to):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter() - t0
            if step == calib_from:
                calib_t = now
            else:  # the schedule's length: what fits in the budget at the measured pace (5% margin)
                per_step = (now - calib_t) / (calib_to - calib_from)
                total = step + max(0, int(0.95 * (max_seconds - now) / per_step))
                if bar is not None:
                    bar.total = total
        if step % opts.log_every == 0 or step == total:
            means = (acc / n_acc).tolist()
            shown = means[1] if frozen else means[0]
            last = {"step": step, "loss": round(means[0], 5), "lr": lr, "tokens": step * B * S}
            if mtp is not None:
                last["mtp_loss"] = round(means[1], 5)
            if frozen:  # the trunk's loss is not computed
                del last["loss"]
                last["phase"] = "mtp"
            last["seconds"] = round(time.perf_counter() - t0, 2)
            log.write(json.dumps(last) + "\n")
            log.flush()
            acc.zero_()
            n_acc = 0
            if bar is not None:
                bar.set_postfix(loss=f"{shown:.3f}", refresh=False)
            else:
                print(f"step {step}/{total or '?'} loss {shown:.4f} lr {lr:.2e} {last['seconds']:.0f} s", flush=True)
        if bar is not None:
            bar.update(1)
        every = opts.eval_every or max(10, (total or max_steps or 1000) // 20)
        if step % every == 0 and step >= preset.warmup_steps:
            ppl = evaluate(model, mtp, streams["heldout"], S, check_windows, max(1, B // 2), cuda)[checked]
            checks.append([step, round(ppl, 4)])
            if ppl < best["ppl"]:
                best.update(ppl=ppl, step=step, misses=0, state=_snapshot(trained, mtp))
            else:
                best["misses"] += 1
                if best["misses"] >= opts.patience:
                    stopped_by = "early"
                    break
    if cuda:
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - t0
    if total is None:  # the time budget ran out before the pace was measured: what ran is the plan
        total = step
    final_ppl = evaluate(model, mtp, streams["heldout"], S, check_windows, max(1, B // 2), cuda)[checked]
    kept = step
    if best["state"] is not None and best["ppl"] < final_ppl:  # an earlier check was better: keep those weights
        _restore(trained, mtp, best["state"])
        kept = best["step"]
    if bar is not None:
        bar.close()
    log.close()
    if stopped_by == "time":
        print(f"stopped by the time budget ({max_seconds} s) at step {step} of {total}: the schedule was cut short")
    elif stopped_by == "early":
        print(f"stopped early at step {step} of {total}: held-out loss no better for {opts.patience} checks")
    if kept != step:
        print(f"kept the weights of step {kept} (held-out check {best['ppl']:.3f} against {final_ppl:.3f} at the end)")

    if preset.save_dtype != "float32":  # rounded as they will be written: the metrics below are the file's
        with torch.no_grad():
            for p in [*(() if frozen else model.parameters()), *(mtp.parameters() if mtp is not None else ())]:
                p.copy_(p.to(getattr(torch, preset.save_dtype)).float())
    t1 = time.perf_counter()
    if balance is not None:  # the loads of the held-out pass below
        balance.reset_totals()
    ev = evaluate(model, mtp, streams["heldout"], S, preset.eval_windows, max(1, B // 2), cuda)
    eval_seconds = time.perf_counter() - t1
    if frozen:
        attach.save_attached(out, src, trunk, model, mtp, preset.mtp_copies, preset.save_dtype)
    else:
        save_checkpoint(out, model, mtp, preset.save_dtype, preset.repetition_penalty)
    metrics = {
        "preset": asdict(preset),
        "params": sum(p.numel() for p in model.parameters()),
        "mtp_params": sum(p.numel() for p in mtp.parameters()) if mtp is not None else 0,
        "vocab_size": config.vocab_size,
        "steps": step,
        "kept_step": kept,
        "heldout_checks": checks,
        "planned_steps": total,
        "stopped_by": stopped_by,
        "tokens_seen": step * B * S,
        "train_seconds": round(train_seconds, 2),
        "eval_seconds": round(eval_seconds, 2),
        "final_train_loss": last.get("mtp_loss" if frozen else "loss"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "precision": "bf16 autocast, fp32 weights" if cuda else "fp32",
        "save_dtype": preset.save_dtype,
        "threads": threads if not cuda else None,
        "seed": opts.seed,
        "mtp": opts.mtp,
        "corpus": corpus_stats,
        # per MoE router (the trunk's layers, then the MTP layer's), over the held-out pass
        "expert_load": balance.report() if balance is not None else None,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, **_versions()},
        **ev,
    }
    if frozen:  # DIR's metrics (the trunk's), this run's under "mtp"
        metrics = attach.merge_metrics(src, {k: v for k, v in metrics.items() if k not in ev}, ev)
    (out / "train_metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    line = f"{preset.name}: held-out perplexity {ev['heldout_ppl']:.3f} ({metrics['params']:,} parameters, "
    line += "frozen trunk; MTP module: " if frozen else ""
    line += f"{step} steps, {train_seconds:.0f} s on {device})"
    if mtp is not None:
        line += f"; MTP (token after next) perplexity {ev['mtp_heldout_ppl']:.3f}, top-1 {ev['mtp_top1']:.3f}"
    if balance is not None:
        line += f"; busiest expert {max(r.get('max_over_mean', 0) for r in metrics['expert_load']):.2f}x the mean load"
    print(line, flush=True)
    return metrics


def _snapshot(model, mtp) -> list[dict]:
    return [
        {k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()} for m in (model, mtp) if m is not None
    ]


def _restore(model, mtp, state: list[dict]) -> None:
    for m, sd in zip([m for m in (model, mtp) if m is not None], state):
        m.load_state_dict(sd)


def _versions() -> dict:
    import tokenizers
    import transformers

    return {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
