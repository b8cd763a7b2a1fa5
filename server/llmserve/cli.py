"""The `llmserve` command: export models, generate offline, serve, show settings, train reference models."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path


def _export(args: argparse.Namespace) -> int:
    if sum(map(bool, (args.demo, args.random_demo, args.hf))) != 1:
        print("llmserve export: give exactly one of --demo, --random-demo or --hf DIR", file=sys.stderr)
        return 2
    if args.seed is not None and not args.random_demo:
        print("llmserve export: --seed is for --random-demo only", file=sys.stderr)
        return 2
    if args.mp != 1 and not args.hf:
        print("llmserve export: --mp is for --hf only", file=sys.stderr)
        return 2
    if args.demo:
        from llmserve.runners.paddle.demo import export_demo

        out = export_demo(args.out)
    elif args.random_demo:
        from llmserve.runners.paddle.demo import export_random_demo

        out = export_random_demo(args.out, seed=args.seed or 0)
    else:
        from llmserve.runners.paddle.export import export_hf

        export_hf(args.hf, args.out, mp=args.mp)
        out = Path(args.out)
    print(f"wrote {out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from llmserve.config import Config
    from llmserve.engine.sampling_params import SamplingParams
    from llmserve.offline import LLM

    overrides = {}
    if args.block_bs is not None:
        overrides["block_bs"] = args.block_bs
    config = Config.from_env(**overrides)
    llm = LLM(args.model or "", config)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or [],
    )
    prompts = args.prompt
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    try:
        for res, original in zip(llm.generate(prompts, params), args.prompt):
            d = res.to_dict()
            d["prompt"] = original
            print(json.dumps(d, ensure_ascii=False), flush=True)
    finally:
        llm.shutdown()
    return 0


def _serve(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parents[2] / "start_server.sh"
    if not script.exists():
        print(f"llmserve serve: {script} not found", file=sys.stderr)
        return 2
    os.execv("/bin/bash", ["bash", str(script), *([args.model_name] if args.model_name else [])])
    return 0  # not reached


SECRET_SETTINGS = frozenset({"API_KEY", "LLMSERVE_EDGE_TOKEN"})


def _config(args: argparse.Namespace) -> int:
    """Every field of Config, one line each: variable (aliases) = value, where it came from, default, meaning."""
    import dataclasses

    from llmserve.config import Config

    cfg = Config.from_env()
    for f in dataclasses.fields(Config):
        env, aliases = f.metadata["env"], f.metadata["aliases"]
        alias = f" ({', '.join(aliases)})" if aliases else ""
        value = getattr(cfg, f.name)
        if env in SECRET_SETTINGS and value:
            value = "<set, hidden>"  # never print a secret (terminals and CI logs keep it)
        source = next((n for n in (env, *aliases) if n in os.environ), None)
        if source is None:
            origin = "default"
        else:
            origin = f"{'set' if source == env else f'set by {source}'}, default {f.default!r}"
        print(f"{env}{alias} = {value!r}  # {origin}: {f.metadata['doc']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmserve", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    e = sub.add_parser("export", help="write a static-graph model directory")
    e.add_argument("--demo", action="store_true", help="the demo model (trained on the Python stdlib: docs/models.md)")
    e.add_argument("--random-demo", action="store_true", help="a random-weight model of the earlier demo's shape")
    e.add_argument("--hf", metavar="DIR", help="a Llama / Qwen2 HF checkpoint to convert")
    e.add_argument("--out", required=True, metavar="DIR")
    e.add_argument("--seed", type=int, default=None, help="--random-demo's weights (default 0)")
    e.add_argument(
        "--mp",
        type=int,
        default=1,
        metavar="N",
        help="--hf: shard over N tensor-parallel ranks (rank_0 ... rank_{N-1})",
    )
    e.set_defaults(func=_export)

    g = sub.add_parser("generate", help="generate offline, one JSON line per prompt")
    g.add_argument(
        "--model", default="", metavar="DIR", help="model directory (default MODEL_DIR, else the demo model)"
    )
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("--block-bs", type=int, default=None, help="override BLOCK_BS")
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="start the service (start_server.sh)")
    s.add_argument("model_name", nargs="?", default="")
    s.set_defaults(func=_serve)

    c = sub.add_parser("config", help="print every setting with its value")
    c.set_defaults(func=_config)

    from llmserve.bench.cli import add_bench_parser

    add_bench_parser(sub)

    from llmserve.train.cli import add_train_parser

    add_train_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"llmserve {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
