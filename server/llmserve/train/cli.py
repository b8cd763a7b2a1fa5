"""`llmserve train`: train a reference model on the Python standard library (docs/models.md).

llmserve train --preset demo --tokenizer DEMO_DIR --out models/demo  # the default model: ~70 s on one H100
llmserve train --tokenizer-only --out models/tokenizer              # the shared tokenizer alone
llmserve train --preset target --mtp --tokenizer models/tokenizer --out models/target
llmserve train --preset demo --init-from models/demo --mtp --out models/demo-mtp   # MTP on a frozen trunk
llmserve train --preset demo-cpu --device cpu --out models/demo-cpu  # the first demo: ~8 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
from pathlib import Path


def _train(args: argparse.Namespace) -> int:
    from llmserve.train.trainer import TrainOptions, train

    train(
        TrainOptions(
            preset=args.preset,
            out=Path(args.out),
            tokenizer=Path(args.tokenizer) if args.tokenizer else None,
            device=args.device,
            seed=args.seed,
            max_steps=args.max_steps,
            max_seconds=args.max_seconds,
            mtp=args.mtp,
            max_files=args.max_files,
            corpus=Path(args.corpus) if args.corpus else None,
            eval_every=args.eval_every,
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
            threads=args.threads,
            log_every=args.log_every,
            tokenizer_only=args.tokenizer_only,
            init_from=Path(args.init_from) if args.init_from else None,
        )
    )
    return 0


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    from llmserve.train.presets import PRESETS

    t = subparsers.add_parser("train", help="train a model on the Python standard library (HF directory)")
    t.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="demo-cpu",
        help="model shape and schedule (default: one a CPU trains)",
    )
    t.add_argument("--out", required=True, metavar="DIR", help="the HF model directory to write")
    t.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-steps", type=int, default=None, help="training steps (default: the preset's)")
    t.add_argument(
        "--max-seconds", type=float, default=None, help="time budget; sets the step count when none is given"
    )
    t.add_argument("--tokenizer", metavar="DIR", help="reuse this tokenizer (one for all models)")
    t.add_argument("--tokenizer-only", action="store_true", help="train the tokenizer into --out and stop")
    t.add_argument("--mtp", action="store_true", help="also train a DeepSeek-V3-style MTP module")
    t.add_argument(
        "--init-from",
        metavar="DIR",
        help="with --mtp: train only an MTP module on DIR's trained model, its trunk frozen and copied bit for bit",
    )
    t.add_argument("--max-files", type=int, default=None, help="only the first N corpus files (tests)")
    t.add_argument("--corpus", metavar="DIR", help="a Python stdlib tree to train on (default: this interpreter's)")
    t.add_argument("--eval-every", type=int, default=None, metavar="N", help="held-out check every N steps")
    t.add_argument("--cache-dir", metavar="DIR", help="token stream cache (default LLMSERVE_CACHE_DIR/train)")
    t.add_argument("--threads", type=int, default=None, help="CPU threads (default 2; part of reproducibility)")
    t.add_argument("--log-every", type=int, default=10, metavar="N", help="loss log line every N steps")
    t.set_defaults(func=_train)
    return t
