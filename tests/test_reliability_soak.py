"""Load and soak: over 1,000 mixed requests against one running stack, bounded in count and time.

Mix: native and OpenAI, streaming and not, some cancelled mid-stream, some with a short `timeout`,
and enough concurrency to pass the queue limit (MAX_CACHED_TASK_NUM=8, BATCH_SIZE=8, 24 clients).
Every request must end with its whole output (the token count asked for, or finish_reason `stop`
before it) or a clear error (429 queue full, 408 timeout); afterwards the engine's gauges return
to 0 and the stack's processes, threads and file descriptors have not grown beyond the bounds below.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from llmserve.serving.testing import http_stack, resource_counts

N_REQUESTS = int(os.environ.get("LLMSERVE_SOAK_REQUESTS", "1200"))
CLIENTS = 20
BUDGET_S = 180  # the whole run stops submitting after this
REQUEST_TIMEOUT = 60
# Growth allowed after the run, over the counts taken after a warm-up.
BOUND = {"processes": 0, "threads": 16, "fds": 32}
GAUGES = ("llmserve_requests_running", "llmserve_requests_waiting", "llmserve_kv_blocks_used")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = http_stack(
        tmp_path_factory.mktemp("soak"),
        PUSH_MODE_HTTP_WORKERS=2,
        MAX_CACHED_TASK_NUM=8,
        BATCH_SIZE=8,
        BLOCK_BS=8,
        MAX_SEQ_LEN=1024,
        MAX_DEC_LEN=256,
    )
    s.start()
    yield s
    assert s.stop().returncode == 0


_local = threading.local()


def session() -> requests.Session:
    if not hasattr(_local, "s"):
        _local.s = requests.Session()
    return _local.s


class Unexpected(AssertionError):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise Unexpected(what)


def error_of(r: requests.Response) -> tuple[int, str]:
    body = r.json()
    return r.status_code, body["error"]["message"] if "error" in body else body["error_msg"]


def clear_error(status: int, msg: str) -> str:
    """The outcome name for an acceptable error, else raise."""
    if status == 429:
        check("MAX_CACHED_TASK_NUM" in msg, f"429 without the reason: {msg}")
        return "429"
    if status == 408:
        check("timed out" in msg or "timeout" in msg.lower(), f"408 without the reason: {msg}")
        return "408"
    raise Unexpected(f"unexpected error {status}: {msg}")


def native_plain(base: str, k: int, i: int) -> str:
    body = {"text": f"soak {i} native", "max_dec_len": k, "min_dec_len": k, "return_usage": True}
    r = session().post(base + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT)
    if r.status_code != 200:
        return clear_error(*error_of(r))
    out = r.json()
    check(out["error_code"] == 0 and len(out["token_ids"]) == k == out["usage"]["completion_tokens"], str(out))
    return "ok"


def native_stream(base: str, k: int, i: int) -> str:
    body = {"text": f"soak {i} stream", "max_dec_len": k, "min_dec_len": k, "stream": True}
    with session().post(base + "/v1/chat/completions", json=body, stream=True, timeout=REQUEST_TIMEOUT) as r:
        if r.status_code != 200:
            return clear_error(*error_of(r))
        lines = [json.loads(x) for x in r.iter_lines() if x]
    last = lines[-1]
    if last.get("error_code"):
        return clear_error(last["error_code"], last["error_msg"])
    check(last["is_end"] == 1 and sum(len(x["token_ids"]) for x in lines) == k, f"stream ended short: {last}")
    check([x["send_idx"] for x in lines] == list(range(len(lines))), "send_idx has gaps")
    return "ok"


def openai_completion(base: str, k: int, i: int) -> str:
    body = {"model": "default", "prompt": f"soak {i} completion", "max_tokens": k}
    r = session().post(base + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT)
    if r.status_code != 200:
        return clear_error(*error_of(r))
    out = r.json()
    n, reason = out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]
    check((n == k and reason == "length") or (n <= k and reason == "stop"), f"{n}/{k} tokens, {reason}")
    return "ok"


def openai_chat_stream(base: str, k: int, i: int) -> str:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": f"soak {i} chat"}],
        "max_tokens": k,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with session().post(base + "/v1/chat/completions", json=body, stream=True, timeout=REQUEST_TIMEOUT) as r:
        if r.status_code != 200:
            return clear_error(*error_of(r))
        events = [x[len(b"data: ") :] for x in r.iter_lines() if x.startswith(b"data: ")]
    check(events and events[-1] == b"[DONE]", f"no [DONE]: {events[-2:]}")
    chunks = [json.loads(e) for e in events[:-1]]
    if "error" in chunks[-1]:
        err = chunks[-1]["error"]
        return clear_error(
            429 if err["code"] == "queue_full" else 408 if err["code"] == "timeout" else 500, err["message"]
        )
    usage = chunks[-1]["usage"]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    n = usage["completion_tokens"]
    check(reasons in (["length"], ["stop"]), f"finish reasons {reasons}")
    check((n == k) if reasons == ["length"] else (n <= k), f"{n}/{k} tokens, {reasons}")
    return "ok"


def cancelled_stream(base: str, k: int, i: int) -> str:
    body = {"text": f"soak {i} cancel", "max_dec_len": 200, "min_dec_len": 200, "stream": True}
    with session().post(base + "/v1/chat/completions", json=body, stream=True, timeout=REQUEST_TIMEOUT) as r:
        if r.status_code != 200:
            return clear_error(*error_of(r))
        lines = r.iter_lines()
        for _ in range(2):
            first = json.loads(next(lines))
            if first.get("error_code"):
                return clear_error(first["error_code"], first["error_msg"])
        r.raw.close()  # hang up mid-stream
    _local.__dict__.pop("s", None)  # that connection is gone
    return "cancelled"


def short_timeout(base: str, k: int, i: int) -> str:
    body = {"text": f"soak {i} timeout", "max_dec_len": 200, "min_dec_len": 200, "timeout": 0.05}
    r = session().post(base + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT)
    check(r.status_code != 200, "a 200-token answer within 50 ms")
    return clear_error(*error_of(r))


KINDS = [
    (native_plain, 5),
    (native_stream, 5),
    (openai_completion, 4),
    (openai_chat_stream, 4),
    (cancelled_stream, 1),
    (short_timeout, 1),
]


def gauges(stack) -> dict[str, float]:
    m = stack.metrics()
    return {g: m[g] for g in GAUGES}


def wait_gauges_zero(stack, timeout: float = 15) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        g = gauges(stack)
        if not any(g.values()) or time.monotonic() > deadline:
            return g
        time.sleep(0.2)


def test_soak_mixed_requests(stack):
    base = stack.http_base
    seed = random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    funcs, weights = zip(*KINDS)
    plan = [(rng.choices(funcs, weights)[0], rng.randint(3, 12), i) for i in range(N_REQUESTS)]
    # Warm up (connections, worker threads), then take the baseline.
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(lambda i: native_plain(base, 4, -i) != "x", range(CLIENTS * 2)))
    assert wait_gauges_zero(stack) == dict.fromkeys(GAUGES, 0.0)
    pid = stack.supervisor_pid
    before = resource_counts(pid)

    deadline = time.monotonic() + BUDGET_S
    outcomes: Counter = Counter()
    failures: list[str] = []

    def run(item) -> None:
        func, k, i = item
        if time.monotonic() > deadline:
            outcomes["not run (budget)"] += 1
            return
        try:
            outcomes[f"{func.__name__}:{func(base, k, i)}"] += 1
        except Exception as e:  # noqa: BLE001 - every failure is collected and reported
            failures.append(f"{func.__name__} #{i} (k={k}): {type(e).__name__}: {e}")

    t0 = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(run, plan))
    elapsed = time.monotonic() - t0
    after_gauges = wait_gauges_zero(stack)
    time.sleep(1.0)  # let closed connections and finished threads go
    after = resource_counts(pid)
    total = sum(outcomes.values())
    summary = {
        "seed": seed,
        "requests": total,
        "seconds": round(elapsed, 1),
        "outcomes": dict(sorted(outcomes.items())),
        "failures": len(failures),
        "resources_before": before,
        "resources_after": after,
        "gauges_after": after_gauges,
    }
    print("\nsoak:", json.dumps(summary))
    assert not failures, "\n".join(failures[:20])
    assert outcomes["not run (budget)"] == 0 and total == N_REQUESTS > 1000
    by_result: Counter = Counter()
    for key, n in outcomes.items():
        by_result[key.split(":")[1]] += n
    # No share of completions is asserted: it is a throughput, the machine's speed against how soon a turned-away
    # client is back (the engine server answers 429 at once, so a slow engine turns more of the fixed request
    # list away: 573 of 1,200 completed on a loaded CI box once, 258-358 since), and speed is the benchmarks'
    # business. What the soak asserts is that each request ended as it must (no `failures`: its whole output or
    # a clear 429 / 408), that every kind of ending happened, and that nothing leaked (below).
    assert by_result["ok"] > 0 and by_result["429"] > 0 and by_result["408"] > 0, by_result
    assert by_result["cancelled"] > 0
    assert after_gauges == dict.fromkeys(GAUGES, 0.0)
    for key, slack in BOUND.items():
        assert after[key] <= before[key] + slack, (key, before, after)
    assert stack.ready()[0] == 200
