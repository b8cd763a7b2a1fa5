"""`llmserve bench`: load-test a running server (or the engine in-process) and report.

    llmserve bench --backend native --num-prompts 200 --max-concurrency 1,8,32
    llmserve bench --backend engine --model DIR --workload sharegpt-synthetic
    llmserve bench --backend triton-grpc --max-concurrency 256 --client-processes 4

Prints a table per concurrency level, writes `<name>.json` and PNG plots
(`<name>-latency-c<N>.png`; `<name>-sweep.png` for several levels) into --out-dir.
When the server (or engine) verified speculative drafts during a level, its table and
JSON also give the draft acceptance rate and the mean accepted length (`spec_decode`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import signal
import sys
import time
from pathlib import Path

from llmserve.bench.backends import BACKENDS, Backend
from llmserve.bench.metrics import results_to_dicts, spec_summary, summarize
from llmserve.bench.processes import ClientProcessError, ClientSpec, run_processes
from llmserve.bench.report import format_table, plot_latencies, plot_sweep, save_json
from llmserve.bench.runner import run_level, warmup
from llmserve.bench.workload import SHAREGPT, Vocab, arrival_offsets, build_workload


def _concurrency_list(raw: str) -> list[int | None]:
    if not raw:
        return [None]
    try:
        levels = [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {raw!r}") from None
    if not levels or any(c < 1 for c in levels):
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {raw!r}")
    return levels  # type: ignore[return-value]


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    b = subparsers.add_parser(
        "bench",
        help="benchmark a running server or the engine: TTFT, TPOT, ITL, throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("--backend", choices=BACKENDS, default="native")
    b.add_argument("--host", default="127.0.0.1")
    b.add_argument(
        "--port", type=int, default=None, help="default SERVICE_HTTP_PORT (SERVICE_GRPC_PORT for triton-grpc)"
    )
    b.add_argument(
        "--metrics-url",
        default="",
        metavar="URL",
        help="served backends: the server's Prometheus metrics, read before and after each level for speculative "
        "decoding's acceptance (default http://HOST:METRICS_HTTP_PORT/metrics; 'none': not read)",
    )
    b.add_argument(
        "--model", default="", metavar="DIR", help="engine backend: model to load (default MODEL_DIR, else the demo)"
    )
    b.add_argument("--tokenizer", default="", metavar="DIR", help="tokenizer for prompts (default: --model's)")
    b.add_argument("--workload", choices=("random", "sharegpt-synthetic", "jsonl"), default="random")
    b.add_argument("--dataset-path", default=None, metavar="FILE", help="jsonl workload: one JSON object a line")
    b.add_argument("--num-prompts", type=int, default=100)
    b.add_argument("--input-len", type=int, default=256, help="random: mean input tokens")
    b.add_argument("--output-len", type=int, default=128, help="random: mean output tokens; jsonl: default")
    b.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths in [L*(1-r), L*(1+r)]")
    b.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals in req/s, or inf")
    b.add_argument(
        "--max-concurrency",
        type=_concurrency_list,
        default=[None],
        help="cap on requests in flight; a comma list (1,8,32,128) runs a sweep",
    )
    b.add_argument("--seed", type=int, default=0, help="same seed, same workload and arrivals")
    b.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    b.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    b.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent first, one at a time")
    b.add_argument(
        "--client-processes",
        type=int,
        default=1,
        metavar="N",
        help="served backends: split each level's requests over N client processes (one asyncio client "
        "saturates a core at high concurrency)",
    )
    b.add_argument("--out-dir", default=".", help="where the JSON and PNG files go (default: here)")
    b.add_argument("--result-name", default="", help="file name stem (default bench-<backend>)")
    b.add_argument("--no-plots", action="store_true")
    b.add_argument("--save-requests", action="store_true", help="also save every request's timings in the JSON")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(func=run_bench)
    return b


def _make_backend(args: argparse.Namespace) -> tuple[Backend, Vocab, ClientSpec | None]:
    """The backend, the prompts' vocabulary, and (served backends) how client processes build theirs."""
    from llmserve.config import Config

    config = Config.from_env()
    if args.backend == "engine":
        from llmserve.bench.engine_backend import EngineBackend
        from llmserve.engine.heap import freeze_startup_objects
        from llmserve.serving.compose import build_engine

        engine = build_engine(dataclasses.replace(config, model_dir=args.model or config.model_dir))
        vocab = Vocab(_load_tokenizer(args.tokenizer) if args.tokenizer else engine.tokenizer)
        freeze_startup_objects()  # as the engine core does: the baseline without full-collection stalls
        return EngineBackend(engine, vocab, temperature=args.temperature, timeout=args.timeout), vocab, None
    from llmserve.runners.model_dir import resolve_model_dir

    tok_dir = args.tokenizer or str(
        resolve_model_dir(dataclasses.replace(config, model_dir=args.model or config.model_dir))
    )
    vocab = Vocab(_load_tokenizer(tok_dir))
    port = args.port or (config.service_grpc_port if args.backend == "triton-grpc" else config.service_http_port)
    spec = ClientSpec(args.backend, args.host, port, tok_dir, args.temperature, args.timeout)
    backend = spec.build(vocab)
    url = args.metrics_url or f"http://{args.host}:{config.metrics_http_port}/metrics"
    backend.metrics_url = "" if url == "none" else url
    return backend, vocab, spec


def _load_tokenizer(path: str):
    from llmserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(path)


def _tokens(results) -> int:
    return sum(r.output_len for r in results)


@contextlib.contextmanager
def _plain_ctrl_c():
    """Ctrl-C raises KeyboardInterrupt: asyncio.run (3.11+) makes the first one a cancellation of
    the main task, which a blocking call inside it never sees."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


async def _run_all(args: argparse.Namespace, backend: Backend, spec: ClientSpec | None, requests) -> list[tuple]:
    """[(results, duration, max concurrency, speculative decoding summary or None, [client CPU s per process])]
    per level. Warm-ups and the counters go through `backend`, in this process."""
    procs = spec if args.client_processes > 1 else None  # how each client process builds its backend
    await backend.start()
    runs = []
    try:
        seen = await backend.counters()  # the server's counters before each level
        warm = await warmup(backend, requests, args.num_warmups)
        if warm:
            seen = await backend.counters(seen, _tokens(warm))
        if procs is not None:  # e.g. text prompts: made once here, not in each client process's measured time
            for req in requests:
                backend.prepare(req)
        for conc in args.max_concurrency:
            desc, progress = f"{args.backend} c={conc or 'inf'}", not args.no_progress
            if procs is not None:
                # Blocks this loop on purpose: nothing else is to run in it meanwhile.
                offsets = arrival_offsets(len(requests), args.request_rate, args.seed)
                with _plain_ctrl_c():
                    n = args.client_processes
                    results, duration, cpus = run_processes(procs, requests, offsets, conc, n, progress, desc)
            else:
                cpu = time.process_time()
                results, duration = await run_level(
                    backend, requests, args.request_rate, conc, args.seed, progress, desc
                )
                cpus = [time.process_time() - cpu]
            now = await backend.counters(seen, _tokens(results))
            runs.append((results, duration, conc, spec_summary(seen, now), cpus))
            seen = now
    finally:
        await backend.close()
    return runs


def run_bench(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        print("llmserve bench: --num-prompts must be >= 1", file=sys.stderr)
        return 2
    if args.client_processes < 1:
        print("llmserve bench: --client-processes must be >= 1", file=sys.stderr)
        return 2
    if args.client_processes > 1 and args.backend == "engine":
        msg = "the engine backend runs the engine in the client's process: --client-processes must be 1"
        print(f"llmserve bench: {msg}", file=sys.stderr)
        return 2
    backend, vocab, spec = _make_backend(args)
    requests = build_workload(
        args.workload,
        vocab,
        args.num_prompts,
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        path=args.dataset_path,
    )
    try:
        runs = asyncio.run(_run_all(args, backend, spec, requests))
    except ClientProcessError as e:
        print(f"llmserve bench: error: {e}", file=sys.stderr)
        return 1
    if args.backend == "engine":
        backend.engine.shutdown()

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.result_name or f"bench-{args.backend}"
    meta = {
        "backend": args.backend,
        "workload": args.workload,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "seed": args.seed,
    }
    summaries, files = [], []
    for results, duration, conc, spec_decode, cpus in runs:
        s = summarize(results, duration, **meta, max_concurrency=conc)
        s["spec_decode"] = spec_decode  # None: no drafts verified (or the server's metrics not reachable)
        # The client's CPU time over the level's wall time, summed over its processes: near 1 in a process,
        # the client (one Python thread) is what paces the streams it reads; with the engine backend it
        # includes the engine's host work.
        s["client_processes"] = len(cpus)
        s["client_cpu_share"] = sum(cpus) / max(duration, 1e-9)
        s["client_cpu_share_max"] = max(cpus) / max(duration, 1e-9)  # the busiest process
        if args.save_requests:
            s["requests"] = results_to_dicts(results)
        summaries.append(s)
        print(format_table(s))
        if not args.no_plots:
            title = f"{args.backend}, {args.workload}, max concurrency {conc or 'inf'}"
            files.append(plot_latencies(out_dir / f"{stem}-latency-c{conc or 'inf'}.png", results, title))
    if not args.no_plots and len(summaries) > 1:
        files.append(plot_sweep(out_dir / f"{stem}-sweep.png", summaries, f"{args.backend}, {args.workload}"))
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["request_rate"] = meta["request_rate"]
    if args.workload == "sharegpt-synthetic":
        config["sharegpt_distribution"] = SHAREGPT
    payload = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": config, "runs": summaries}
    files.insert(0, save_json(out_dir / f"{stem}.json", payload))
    print("wrote " + ", ".join(str(f) for f in files))
    return 1 if any(s["completed"] == 0 for s in summaries) else 0
