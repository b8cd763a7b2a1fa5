"""Per-request results and the run's aggregate metrics.

Definitions (as in vLLM's `bench serve`), all on the client's clock:
- TTFT: request sent -> first output token received.
- ITL: gaps between consecutive chunks that carry tokens (one per chunk;
  a chunk holding several tokens counts once; OpenAI: every chunk with
  `choices`, even one whose text is still empty).
- TPOT: per request, (E2E - TTFT) / (output tokens - 1), for requests with
  more than one output token.
- E2E: request sent -> last byte of the response.
- Throughput: successful requests and their tokens divided by the run's wall
  time (first request sent -> last request done).
Failed requests count in `failures` (by error code) and in no latency or token figure.

Speculative decoding (`spec_decode`, when drafts were verified during the level): the
difference of the server's cumulative counters before and after the level (the engine's
stats in-process, else the llmserve_spec_decode_* Prometheus counters): acceptance rate =
accepted / proposed draft tokens, mean accepted length = 1 + accepted / drafts verified
(tokens a request gains per verifying step), and the acceptance rate at each draft position.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    input_len: int = 0  # as the server reported (usage) when it did, else as sent
    output_len: int = 0
    expected_input_len: int = 0
    expected_output_len: int = 0
    success: bool = False
    error_code: str = ""  # protocol error_code, HTTP status, or an exception name
    error_msg: str = ""
    start: float = 0.0  # perf_counter when sent
    sent: float = 0.0  # start to the request written on the socket (HTTP backends; 0: not measured)
    ttft: float = 0.0
    latency: float = 0.0  # E2E
    itl: list[float] = field(default_factory=list)

    def fail(self, code: object, msg: str) -> RequestResult:
        self.success, self.error_code, self.error_msg = False, str(code), msg[:500]
        return self


def stats(values: list[float] | np.ndarray, scale: float = 1000.0) -> dict[str, float]:
    """mean, median, p90, p99 (and std) in milliseconds; zeros when empty."""
    a = np.asarray(values, dtype=np.float64) * scale
    if a.size == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    out = {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std())}
    # Percentiles are computed together so they come out ordered.
    for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES)):
        out[f"p{p}"] = float(v)
    return out


def tpot(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_len - 1) if r.success and r.output_len > 1 else None


def summarize(results: list[RequestResult], duration: float, **meta: object) -> dict:
    """Aggregate metrics of one run (one concurrency level) as a JSON-able dict."""
    ok = [r for r in results if r.success]
    failures = Counter(r.error_code for r in results if not r.success)
    dur = max(duration, 1e-9)
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [t for t in map(tpot, ok) if t is not None]
    return {
        **meta,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failures": dict(sorted(failures.items())),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "input_throughput": total_in / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "ttft_ms": stats([r.ttft for r in ok]),
        "tpot_ms": stats(tpots),
        "itl_ms": stats([g for r in ok for g in r.itl]),
        "e2e_ms": stats([r.latency for r in ok]),
        # The client's own share of TTFT in a burst: how long a request waited in this process to be sent;
        # and TTFT counted from that send, the server's share (with the network's).
        **(
            {"send_ms": stats([r.sent for r in ok]), "ttft_after_send_ms": stats([r.ttft - r.sent for r in ok])}
            if any(r.sent for r in ok)
            else {}
        ),
        # Output lengths the server gave vs asked: a server that stops early shows here.
        "output_len_mismatch": sum(1 for r in ok if r.expected_output_len and r.output_len != r.expected_output_len),
        "input_len_mismatch": sum(1 for r in ok if r.expected_input_len and r.input_len != r.expected_input_len),
    }


def results_to_dicts(results: list[RequestResult]) -> list[dict]:
    return [asdict(r) for r in results]


# ---- speculative decoding: counters (cumulative snapshots) and their difference over a level ----
SPEC_PREFIX = "llmserve_spec_decode_"
SPEC_KEYS = ("num_drafts", "draft_tokens", "accepted_tokens")
SPEC_POS_KEYS = ("draft_tokens_per_pos", "accepted_tokens_per_pos")
_SAMPLE = re.compile(r"^(llmserve_\w+?)(?:\{([^}]*)\})?[ \t]+(\S+)", re.M)
_POSITION = re.compile(r'position="(\d+)"')


def stats_counters(stats) -> dict:
    """A snapshot from the engine's `LLMEngine.stats()` (EngineStats)."""
    return {
        "generation_tokens": stats.generation_tokens,
        "num_drafts": stats.spec_verified,
        "draft_tokens": stats.spec_draft_tokens,
        "accepted_tokens": stats.spec_accepted_tokens,
        "draft_tokens_per_pos": list(stats.spec_drafted_at or []),
        "accepted_tokens_per_pos": list(stats.spec_accepted_at or []),
    }


def prometheus_counters(text: str) -> dict | None:
    """A snapshot from the server's metrics exposition; None when it has no llmserve_spec_decode_*
    counters (a server from before them)."""
    snap: dict = {"generation_tokens": 0, **dict.fromkeys(SPEC_KEYS, 0)}
    per_pos: dict[str, dict[int, int]] = {k: {} for k in SPEC_POS_KEYS}
    found = False
    for name, labels, value in _SAMPLE.findall(text):
        try:
            v = int(float(value))
        except (ValueError, OverflowError):
            continue
        key = name[len(SPEC_PREFIX) : -len("_total")]
        if name == "llmserve_generation_tokens_total":
            snap["generation_tokens"] = v
        elif not (name.startswith(SPEC_PREFIX) and name.endswith("_total")):
            continue
        elif key in SPEC_KEYS:
            snap[key], found = v, True
        elif key in per_pos and (m := _POSITION.search(labels)):
            per_pos[key][int(m.group(1))] = v
    for key, at in per_pos.items():
        snap[key] = [at.get(j, 0) for j in range(max(at, default=-1) + 1)]
    return snap if found else None


def spec_summary(before: dict | None, after: dict | None) -> dict | None:
    """Speculative decoding over a level from two snapshots; None without both, or when no drafts
    were verified in between."""
    if before is None or after is None:
        return None
    num, drafted, accepted = (after[k] - before[k] for k in SPEC_KEYS)
    if num <= 0:
        return None

    def grown(key: str) -> list[int]:
        a, b = after[key], before[key]
        return [x - (b[j] if j < len(b) else 0) for j, x in enumerate(a)]

    per_pos = [a / d if d > 0 else None for d, a in zip(*map(grown, SPEC_POS_KEYS))]
    return {
        "num_drafts": num,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted > 0 else 0.0,
        "mean_accepted_len": 1.0 + accepted / num,
        "acceptance_rate_per_pos": per_pos,
    }
