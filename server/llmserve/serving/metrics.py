"""The llmserve_* Prometheus metrics, fed by the engine's stats messages.

They live in the supervisor, not in the engine process, so that counters
survive an engine restart. The metrics endpoint serves Triton's own metrics
followed by these (one scrape target). Triton's are fetched in the background
(TritonMetrics): on a busy machine Triton's /metrics can take seconds, and a
scrape must neither wait for it nor see stale llmserve_* gauges.
"""

from __future__ import annotations

import http.client
import os
import threading
import time
import urllib.request

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmserve.serving import http_failures

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class EngineMetrics:
    def __init__(self, log_dir: str | None = None) -> None:
        # Where the HTTP front end's workers count the 5xx they answer themselves (serving/http_failures.py);
        # None: LOG_DIR, read at the first scrape.
        self.log_dir = log_dir
        self._http_seen: dict[str, int] = {}
        r = self.registry = CollectorRegistry()
        self.running = Gauge("llmserve_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("llmserve_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_used = Gauge("llmserve_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge("llmserve_kv_blocks_total", "KV cache blocks", registry=r)
        self.prompt_tokens = Counter("llmserve_prompt_tokens_total", "Prompt tokens admitted", registry=r)
        self.gen_tokens = Counter("llmserve_generation_tokens_total", "Tokens generated", registry=r)
        self.success = Counter("llmserve_request_success_total", "Requests finished", ["finish_reason"], registry=r)
        self.failure = Counter("llmserve_request_failure_total", "Requests failed", ["error_code"], registry=r)
        self.cancelled = Counter(
            "llmserve_request_cancelled_total", "Requests aborted because their client went away", registry=r
        )
        self.ttft = Histogram(
            "llmserve_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "llmserve_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "llmserve_e2e_request_latency_seconds",
            "Request latency, arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Speculative decoding (acceptance rate = accepted / draft tokens, mean accepted length =
        # 1 + accepted / num_drafts), overall and per draft position.
        self.spec_drafts = Counter(
            "llmserve_spec_decode_num_drafts_total", "Request-steps that verified draft tokens", registry=r
        )
        self.spec_draft_tokens = Counter(
            "llmserve_spec_decode_draft_tokens_total", "Draft tokens proposed and verified", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "llmserve_spec_decode_accepted_tokens_total", "Draft tokens accepted", registry=r
        )
        self.spec_draft_at = Counter(
            "llmserve_spec_decode_draft_tokens_per_pos_total",
            "Draft tokens proposed at each draft position (0: the first)",
            ["position"],
            registry=r,
        )
        self.spec_accepted_at = Counter(
            "llmserve_spec_decode_accepted_tokens_per_pos_total",
            "Draft tokens accepted at each draft position (0: the first)",
            ["position"],
            registry=r,
        )

    def apply(self, msg: dict) -> None:
        """Fold one engine stats message (gauges now, counters as deltas) in."""
        self.running.set(msg["running"])
        self.waiting.set(msg["waiting"])
        self.kv_used.set(msg["kv_blocks_used"])
        self.kv_total.set(msg["kv_blocks_total"])
        self.prompt_tokens.inc(msg["prompt_tokens"])
        self.gen_tokens.inc(msg["generation_tokens"])
        for reason, ttft, tpot, e2e in msg["finished"]:
            self.success.labels(finish_reason=reason).inc()
            self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)
            self.e2e.observe(e2e)
        for code in msg["failed"]:
            self.failure.labels(error_code=str(code)).inc()
        self.cancelled.inc(msg.get("cancelled", 0))
        self.apply_spec(msg.get("spec"))

    def apply_spec(self, spec: list | None) -> None:
        """A stats message's "spec": [num_drafts, draft_tokens, accepted_tokens, [draft tokens at
        position j], [accepted at j]] as deltas; absent (no speculation, an older engine): nothing."""
        if not spec:
            return
        verified, drafted, accepted, drafted_at, accepted_at = spec
        self.spec_drafts.inc(verified)
        self.spec_draft_tokens.inc(drafted)
        self.spec_accepted_tokens.inc(accepted)
        for counter, counts in ((self.spec_draft_at, drafted_at), (self.spec_accepted_at, accepted_at)):
            for j, n in enumerate(counts):
                counter.labels(position=str(j)).inc(n)

    def fold_http_failures(self) -> None:
        """Add the front end's own 5xx (counted in files by its workers) to the failure counter."""
        if self.log_dir is None:
            from llmserve.config import Config  # here: the supervisor's environment is the stack's

            try:
                self.log_dir = Config.from_env().log_dir
            except Exception:  # noqa: BLE001 - no settings, no front end to count
                self.log_dir = ""
        if not self.log_dir:
            return
        for code, n in http_failures.totals(self.log_dir, os.getpid()).items():
            new = n - self._http_seen.get(code, 0)
            if new > 0:
                self.failure.labels(error_code=code).inc(new)
                self._http_seen[code] = n

    def engine_down(self) -> None:
        self.running.set(0)
        self.waiting.set(0)
        self.kv_used.set(0)

    def exposition(self, triton: TritonMetrics | None = None) -> bytes:
        """Triton's metrics (the last good copy) followed by ours (live)."""
        self.fold_http_failures()
        parts = [triton.text()] if triton else []
        parts.append(generate_latest(self.registry))
        return b"".join(parts)


class TritonMetrics:
    """Triton's /metrics text, fetched by a background thread every `refresh` s.

    text() never blocks: it returns the last good copy, which is at most `refresh` + `timeout` s old
    while Triton answers (1 + 5 s by default); after `max_age` s without a good fetch (Triton down or
    hung) it is dropped, so that dead counters are not served as current.
    """

    def __init__(self, url: str, refresh: float = 1.0, timeout: float = 5.0, max_age: float = 15.0) -> None:
        self.url, self.refresh, self.timeout, self.max_age = url, refresh, timeout, max_age
        self._last: tuple[float, bytes] | None = None  # (monotonic start of the fetch, its body)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> TritonMetrics:
        self._thread = threading.Thread(target=self._run, name="triton-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def fetch(self) -> bool:
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout) as r:
                body = r.read().rstrip(b"\n") + b"\n"
        except (OSError, http.client.HTTPException):  # refused while Triton (re)starts, too slow, cut off
            return False
        self._last = (t0, body)  # one assignment: the HTTP threads read it without a lock
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self.fetch()
            self._stop.wait(self.refresh)

    def text(self) -> bytes:
        last = self._last
        if last is None or time.monotonic() - last[0] > self.max_age:
            return b"# Triton metrics unavailable\n"
        return last[1]
