"""The whole serving stack on this CPU machine (demo model, start_server.sh on free loopback ports).

--cpu-cost     CPU milliseconds per streamed token of each process layer (supervisor, engine,
               tritonserver, Triton Python stub, HTTP front end), from /proc/<pid>/stat, while
               K concurrent greedy streams of N tokens run for some rounds: once over HTTP
               (native, POST /v1/chat/completions) and once over Triton gRPC alone.
--long-prompt  8 running streams, then one ~8000-token prompt: does it complete, are the streams
               cut, does readiness fail, and how long do the streams stall (token gaps)?

The stack is the tree that `llmserve` is imported from (PYTHONPATH): its start_server.sh starts it.

    PYTHONPATH=server .venv/bin/python scripts/bench_stack_cpu.py --cpu-cost --long-prompt --out x.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

import llmserve
from llmserve.runners.model_dir import ensure_demo_model
from llmserve.serving import testing
from llmserve.triton.client import TritonStream

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
# Layer of a process, by the first pattern its command line holds (checked in this order).
LAYERS = (
    ("llmserve.serving.engine_core", "engine_core"),
    ("engine_core", "engine_core"),
    ("llmserve.serving.engine_process", "engine_server"),
    ("triton_python_backend_stub", "triton_stub"),
    ("tritonserver", "tritonserver"),
    ("llmserve.http", "http"),
)
PROMPT = "The quick brown fox jumps over the lazy dog. "


# ---- the stack and its processes -------------------------------------------------------
@contextlib.contextmanager
def running_stack(work_dir: Path, **env) -> Iterator[testing.ServingStack]:
    """The stack of the imported tree, with its HTTP front end and this python's venv on PATH; stopped at the end."""
    stack = testing.http_stack(work_dir, PUSH_MODE_HTTP_WORKERS=1, **env)
    stack.env["PATH"] = f"{Path(sys.executable).parent}:{stack.env.get('PATH', '')}"
    if Path(stub_llmserve(stack)).resolve() != Path(llmserve.__file__).resolve():
        sys.exit(f"Triton's stub would run {stub_llmserve(stack)}, not {llmserve.__file__}: see stub_llmserve()")
    try:
        stack.start()
        stack.wait_ready()
        yield stack
    finally:
        stack.stop()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def classify(pid: int, root: int, parent_layer: str) -> str:
    """The layer named by the command line; else 'other<parent's layer>'."""
    if pid == root:
        return "supervisor"
    cmd = cmdline(pid)
    return next((layer for pattern, layer in LAYERS if pattern in cmd), f"other<{parent_layer}>")


def stack_processes(root: int) -> dict[int, dict]:
    """The supervisor and its descendants: pid -> {layer, cmd, ticks}."""
    table, procs, frontier = testing.proc_stats(), {}, [(root, "")]
    while frontier:
        pid, parent_layer = frontier.pop()
        if pid not in table:
            continue
        layer = classify(pid, root, parent_layer)
        procs[pid] = {"layer": layer, "cmd": cmdline(pid)[:160], "ticks": table[pid][1]}
        frontier += [(p, layer) for p, (pp, _) in table.items() if pp == pid]
    return procs


def stub_llmserve(stack: testing.ServingStack) -> str:
    """Where Triton's Python stub gets llmserve. Its embedded interpreter runs isolated (it ignores
    PYTHONPATH), so at 1d0a2a7 it is the site-packages of the python start_server.sh picks (the
    tree's .venv, else python3 on PATH), e.g. an editable install of another tree. Found by running
    the tree's model.py the same way (it fails past the import: no triton_python_backend_utils here)."""
    venv_py = testing.ROOT / ".venv" / "bin" / "python"
    py = str(venv_py) if venv_py.exists() else shutil.which("python3", path=stack.env["PATH"])
    model = testing.ROOT / "model_repository" / "model" / "1" / "model.py"
    env = stack.env | {"PYTHONPATH": f"{testing.ROOT / 'server'}:{stack.env.get('PYTHONPATH', '')}"}
    code = "import runpy, sys\ntry:\n    runpy.run_path(sys.argv[1])\nexcept Exception:\n    pass\n"
    code += "print(sys.modules['llmserve'].__file__)"
    return subprocess.run([py, "-I", "-c", code, str(model)], env=env, capture_output=True, text=True).stdout.strip()


def tree_of(stack: testing.ServingStack) -> dict:
    """Which tree runs: the imported package, the script started, the engine's PYTHONPATH, the stub's package."""
    engine = engine_pid(stack)
    environ = Path(f"/proc/{engine}/environ").read_bytes().split(b"\0") if engine else []
    pythonpath = next((e[11:].decode() for e in environ if e.startswith(b"PYTHONPATH=")), None)
    return {
        "llmserve": llmserve.__file__,
        "start_server": str(testing.ROOT / "start_server.sh"),
        "engine_pythonpath": pythonpath,
        "stub_llmserve": stub_llmserve(stack),
    }


def engine_pid(stack: testing.ServingStack) -> int | None:
    return next((p for p, v in stack_processes(stack.supervisor_pid).items() if v["layer"] == "engine_server"), None)


def cpu_delta(before: dict[int, dict], after: dict[int, dict]) -> tuple[dict[str, int], list[dict]]:
    """CPU ticks spent between two snapshots, per layer and per process."""
    layers: dict[str, int] = {}
    rows = []
    for pid, p in after.items():
        ticks = p["ticks"] - before.get(pid, {"ticks": 0})["ticks"]
        layers[p["layer"]] = layers.get(p["layer"], 0) + ticks
        rows.append({"pid": pid, "layer": p["layer"], "cmd": p["cmd"], "cpu_ms": ticks * TICK_MS})
    return layers, rows


# ---- clients ---------------------------------------------------------------------------
def native_body(n_tokens: int, **extra) -> dict:
    """A greedy (top_k 1: the HTTP front end refuses temperature 0) streaming request of exactly n_tokens."""
    body = {"text": PROMPT, "max_dec_len": n_tokens, "min_dec_len": n_tokens, "stream": True, "top_k": 1}
    return body | extra


def http_stream(base: str, body: dict, on_token=None, limit: float = 240) -> dict:
    """POST a streaming native request, for at most `limit` s; count its tokens, call on_token(time) per token line."""
    out, end = {"status": None, "tokens": 0, "error": None}, time.monotonic() + limit
    try:
        with requests.post(base + "/v1/chat/completions", json=body, stream=True, timeout=(5, limit)) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                msg = json.loads(line)
                if msg.get("error_code"):
                    out["error"] = f"{msg['error_code']}: {msg.get('error_msg')}"
                n = len(msg.get("token_ids") or [])
                out["tokens"] += n
                if n and on_token:
                    on_token(time.monotonic())
                if msg.get("is_end") or time.monotonic() > end:
                    break
    except (requests.RequestException, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out | {"t_end": time.monotonic()}


def grpc_stream(triton: TritonStream, body: dict, limit: float = 240) -> dict:
    q, out = triton.submit(body), {"status": None, "tokens": 0, "error": None}
    try:
        while True:
            msg = q.get(timeout=limit)
            if msg.get("error_code"):
                out["error"] = f"{msg['error_code']}: {msg.get('error_msg')}"
            out["tokens"] += len(msg.get("token_ids") or [])
            if msg.get("is_end"):
                return out
    except queue.Empty:
        return out | {"error": f"no message for {limit} s"}


# ---- A: CPU per streamed token ---------------------------------------------------------
def measure_path(stack: testing.ServingStack, send, k: int, n: int, rounds: int) -> dict:
    """Rounds of k concurrent n-token streams through `send(body)`; CPU per token per layer."""
    send(native_body(8))  # warm the path up
    before, t0, client0 = stack_processes(stack.supervisor_pid), time.monotonic(), resource.getrusage(0)
    results = []
    with ThreadPoolExecutor(k) as pool:
        for _ in range(rounds):
            results += pool.map(send, [native_body(n) for _ in range(k)])
    wall, client1 = time.monotonic() - t0, resource.getrusage(0)
    layers, rows = cpu_delta(before, stack_processes(stack.supervisor_pid))
    tokens = sum(r["tokens"] for r in results)
    client_ms = (client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime) * 1e3
    return {
        "requests": len(results),
        "failed": [r for r in results if r["error"] or r["tokens"] != n],
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "cpu_ms_per_token": {layer: t * TICK_MS / max(tokens, 1) for layer, t in sorted(layers.items())},
        "total_ms_per_token": sum(layers.values()) * TICK_MS / max(tokens, 1),
        "client_ms_per_token": client_ms / max(tokens, 1),
        "processes": rows,
    }


def cpu_cost(work_dir: Path, k: int, n: int, rounds: int) -> dict:
    with running_stack(work_dir / "cpu") as stack:
        triton = TritonStream(stack.grpc_url)
        try:
            return {
                "tree": tree_of(stack),
                "k": k,
                "n": n,
                "rounds": rounds,
                "http": measure_path(stack, lambda b: http_stream(stack.http_base, b), k, n, rounds),
                "grpc": measure_path(stack, lambda b: grpc_stream(triton, b), k, n, rounds),
            }
        finally:
            triton.close()


# ---- B: a long prompt among running streams --------------------------------------------
def poll_ready(stack: testing.ServingStack, stop: threading.Event, polls: list) -> None:
    while not stop.wait(0.2):
        try:
            polls.append((time.monotonic(), stack.ready()[0]))
        except OSError:
            polls.append((time.monotonic(), 0))


def longest_failure(polls: list[tuple[float, int]]) -> tuple[int, float]:
    """Failed polls, and the longest run of consecutive failures in seconds (first to last failure + 0.2)."""
    longest, start = 0.0, None
    for t, status in polls:
        if status != 200:
            start = t if start is None else start
            longest = max(longest, t - start + 0.2)
        else:
            start = None
    return sum(s != 200 for _, s in polls), longest


def wait_steady_ready(polls: list, until: float, steady: int = 10) -> None:
    """Wait until the last `steady` polls (2 s) answered 200, or until `until`."""
    while time.monotonic() < until and not (len(polls) >= steady and all(s == 200 for _, s in polls[-steady:])):
        time.sleep(0.2)


def gap_stats(arrivals: list[list[float]], ends: list[float], t_long: float) -> dict:
    """Longest and p99 gap between consecutive tokens of a stream; longest wait from a stream's last token to its end."""
    gaps = sorted((b - a, a - t_long) for times in arrivals for a, b in zip(times, times[1:]))
    tails = [end - times[-1] for times, end in zip(arrivals, ends) if times]
    if not gaps:
        return {"max_gap_s": None, "p99_gap_s": None, "max_last_token_to_end_s": max(tails, default=None)}
    return {
        "max_gap_s": gaps[-1][0],
        "max_gap_starts_after_long_prompt_s": gaps[-1][1],
        "p99_gap_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))][0],
        "gaps": len(gaps),
        "max_last_token_to_end_s": max(tails, default=None),
    }


def long_prompt_ids(prompt_len: int) -> list[int]:
    vocab = json.loads((ensure_demo_model() / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    return [rng.randrange(4, vocab) for _ in range(prompt_len)]


def start_streams(pool: ThreadPoolExecutor, base: str, n: int, tokens: int, limit: float):
    """n streams of `tokens` tokens each, once all of them stream (or one ended, or 60 s): futures, arrival times."""
    arrivals: list[list[float]] = [[] for _ in range(n)]
    runs = [pool.submit(http_stream, base, native_body(tokens), a.append, limit) for a in arrivals]
    t0 = time.monotonic()
    while not all(arrivals) and time.monotonic() - t0 < 60 and not any(r.done() for r in runs):
        time.sleep(0.05)
    return runs, arrivals


def long_prompt(work_dir: Path, streams: int, stream_tokens: int, prompt_len: int, interval: float, limit: float):
    env = {"CHECK_HEALTH_INTERVAL": interval, "MAX_SEQ_LEN": 8192}
    # The stack stops first on the way out: a stream still running then ends at once.
    with ThreadPoolExecutor(streams + 1) as pool, running_stack(work_dir / "long", **env) as stack:
        tree, pid_before, stop, polls = tree_of(stack), engine_pid(stack), threading.Event(), []
        poller = threading.Thread(target=poll_ready, args=(stack, stop, polls), daemon=True)
        poller.start()
        runs, arrivals = start_streams(pool, stack.http_base, streams, stream_tokens, limit)
        t_long, all_streaming, first = time.monotonic(), all(arrivals), []
        long_body = {"input_ids": long_prompt_ids(prompt_len), "max_dec_len": 16, "stream": True, "top_k": 1}
        long_res = pool.submit(http_stream, stack.http_base, long_body, first.append, limit).result()
        results = [r.result() for r in runs]
        wait_steady_ready(polls, t_long + limit)
        stop.set()
        poller.join()
        pid_after = engine_pid(stack)
    failures, longest = longest_failure(polls)
    return {
        "tree": tree,
        "settings": {"streams": streams, "stream_tokens": stream_tokens, "prompt_len": prompt_len} | env,
        "all_streaming_before_long_prompt": all_streaming,
        "long_prompt": long_res | {"ttft_s": first[0] - t_long if first else None, "end_s": long_res["t_end"] - t_long},
        "streams_cut": [r for r in results if r["error"] or r["tokens"] != stream_tokens],
        "streams_end_s": [round(r["t_end"] - t_long, 2) for r in results],
        "stream_results": results,
        "engine_restarted": pid_after != pid_before,
        "ready_polls": len(polls),
        "ready_failures": failures,
        "ready_longest_failure_s": longest,
        "ready_statuses": sorted({s for _, s in polls}),
        "ready_failures_s": [round(t - t_long, 1) for t, s in polls if s != 200],
        **gap_stats(arrivals, [r["t_end"] for r in results], t_long),
        "logs": str(work_dir / "long" / "log"),
    }


# ---- report ----------------------------------------------------------------------------
def cpu_table(res: dict) -> str:
    layers = sorted(set(res["http"]["cpu_ms_per_token"]) | set(res["grpc"]["cpu_ms_per_token"]))
    lines = [f"CPU ms per streamed token (K={res['k']} x N={res['n']} x {res['rounds']} rounds)"]
    lines.append(f"{'layer':<24}{'HTTP native':>14}{'Triton gRPC':>14}")
    for layer in layers:
        h, g = (res[p]["cpu_ms_per_token"].get(layer, 0.0) for p in ("http", "grpc"))
        lines.append(f"{layer:<24}{h:>14.3f}{g:>14.3f}")
    for label, key, fmt in (
        ("total", "total_ms_per_token", ".3f"),
        ("client (this script)", "client_ms_per_token", ".3f"),
        ("tokens", "tokens", "d"),
        ("wall tokens/s", "tokens_per_s", ".0f"),
    ):
        lines.append(f"{label:<24}{res['http'][key]:>14{fmt}}{res['grpc'][key]:>14{fmt}}")
    lines.append(f"{'failed requests':<24}{len(res['http']['failed']):>14d}{len(res['grpc']['failed']):>14d}")
    return "\n".join(lines)


def sec(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def long_table(res: dict) -> str:
    lp, s = res["long_prompt"], res["settings"]
    rows = [
        ("long prompt", f"HTTP {lp['status']}, {lp['tokens']} tokens, error: {lp['error']}"),
        ("long prompt TTFT / end", f"{sec(lp['ttft_s'])} / {sec(lp['end_s'])}"),
        ("streams cut", f"{len(res['streams_cut'])} of {s['streams']}: {[r['error'] for r in res['streams_cut']][:1]}"),
        ("engine restarted", f"{res['engine_restarted']}"),
        (
            "ready failures",
            f"{res['ready_failures']} of {res['ready_polls']} polls, longest {res['ready_longest_failure_s']:.1f} s",
        ),
        ("max / p99 token gap", f"{sec(res['max_gap_s'])} / {sec(res['p99_gap_s'])}"),
        ("last token to end", f"{sec(res['max_last_token_to_end_s'])} (longest over the streams)"),
    ]
    title = f"Long prompt ({s['prompt_len']} tokens) among {s['streams']} x {s['stream_tokens']}-token streams"
    return "\n".join([title] + [f"{k:<24}{v}" for k, v in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-cost", action="store_true")
    ap.add_argument("--long-prompt", action="store_true")
    ap.add_argument("-k", "--concurrency", type=int, default=8)
    ap.add_argument("-n", "--tokens", type=int, default=256, help="tokens per request (--cpu-cost)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=1000, help="tokens per running stream (--long-prompt)")
    ap.add_argument("--prompt-len", type=int, default=8000)
    ap.add_argument("--check-health-interval", type=float, default=3.0)
    ap.add_argument("--limit", type=float, default=240.0, help="seconds any request may take")
    ap.add_argument("--work-dir", type=Path, help="logs go under it (default: a new temporary directory)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not (args.cpu_cost or args.long_prompt):
        ap.error("give --cpu-cost and/or --long-prompt")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))  # still stop the stack
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_stack_"))
    result: dict = {"llmserve": llmserve.__file__, "work_dir": str(work_dir)}
    if args.cpu_cost:
        result["cpu_cost"] = cpu_cost(work_dir, args.concurrency, args.tokens, args.rounds)
    if args.long_prompt:
        result["long_prompt"] = long_prompt(
            work_dir, args.streams, args.stream_tokens, args.prompt_len, args.check_health_interval, args.limit
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(f"llmserve from {llmserve.__file__}; logs under {work_dir}")
    if args.cpu_cost:
        print(cpu_table(result["cpu_cost"]))
    if args.long_prompt:
        print(long_table(result["long_prompt"]))


if __name__ == "__main__":
    main()
